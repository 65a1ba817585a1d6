"""How a layer's stored tokens are written: at the model's precision, or in 8, 6 (keys only) or 4 bits.

A codec turns each stored vector (one token's keys, or values, for one KV head: ``[..., head_dim]``) into one row of
bytes ``[..., row_bytes]`` (uint8) and back. Because a token stays one row, every layout moves coded tokens exactly as
it moves plain ones (written at a position, gathered by index, rings overwritten, segments packed, chunks offloaded):
the layouts never look inside a row, and the codec knows no layout.

The codecs (docs/quantization.md says why these):

* ``int8`` and ``int4``: per token, asymmetric, in groups of ``group_size(head_dim)`` channels (64 where the head
  divides by it), each group with its scale and minimum in float16 at the end of the row (KIVI's per-token
  grouping; per-token rows keep every layout's token moves exact). A head of 64 or 128 channels costs 68/128 (int8)
  and 36/128 (int4) of its 16-bit bytes, scales included. ``rotated`` (where the layer attends its slots itself):
  each group is first turned by an orthonormal Hadamard matrix (QuaRot's incoherence processing), which spreads a
  key's few large channels over all of them before rounding; attention is unchanged by the turn (q.k = qH.kH) when
  the step's queries are turned the same way and its output turned back (``into_basis``, ``out_of_basis``: one
  small product per query, none per stored token). On SmolLM2's keys at 2K tokens it halves int4's error in the
  attention output of the worst layer (0.35 -> 0.17 relative). ``int6`` (keys with ``key_bits=6``, values in
  int4) is the same scheme at 6 bits: 52/128 per key; on SmolLM2 its answers diverge from the uncoded cache's
  twice as much as int8 keys' and a ninth as much as int4 keys' (docs/accuracy.md, "How many bits the keys need").
* ``fp8``: each element cast to float8 e4m3 with a scale of 1 (saturating at +-448), as vLLM's ``fp8`` cache dtype
  stores tokens when the checkpoint carries no scales.

Rows are encoded once, when a token is stored after the prompt is compressed (the prompt itself and its scoring see
the model's values, as a serving engine's prefill does), and decoded where a step attends to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, cast

import torch

FP8_MAX = 448.0  # the largest finite float8 e4m3 value
FP8_CODE = -8  # what a kernel is told of float8 rows (of integer codes: their bits)


def group_size(head_dim: int) -> int:
    """Channels sharing one scale: 64 (32, 16, ... where the head does not divide by 64)."""
    return math.gcd(head_dim, 64)


@dataclass(frozen=True)
class Codec:
    """One way of writing stored vectors of ``dim`` channels whose model dtype is ``dtype`` (see the module)."""

    name: ClassVar[str] = ""
    dim: int
    dtype: torch.dtype
    rotated: bool = False

    @property
    def row_bytes(self) -> int:
        """Bytes of one coded vector, scales included."""
        raise NotImplementedError

    def encode(self, vectors: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` in any float dtype -> ``[..., row_bytes]`` uint8."""
        raise NotImplementedError

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """``[..., row_bytes]`` uint8 -> ``[..., dim]`` in ``dtype``, in the codec's basis (``rotated``: turned)."""
        raise NotImplementedError

    def restore(self, rows: torch.Tensor) -> torch.Tensor:
        """``decode``, turned back: the vectors as the model computed them (up to rounding)."""
        return self.out_of_basis(self.decode(rows))

    def into_basis(self, vectors: torch.Tensor) -> torch.Tensor:
        """Vectors ``[..., dim]`` in the basis ``decode`` returns (queries attending coded keys)."""
        if not self.rotated:
            return vectors
        turn = hadamard(group_size(self.dim), vectors.device)
        # one product of every group as a row (the groups as a batch of 1-row products took 65x as long at 400 rows)
        return (vectors.float().reshape(-1, turn.shape[0]) @ turn).view(vectors.shape).to(vectors.dtype)

    def out_of_basis(self, vectors: torch.Tensor) -> torch.Tensor:
        """Vectors from ``decode``'s basis back to the model's (an orthonormal Hadamard turn is its own inverse)."""
        return self.into_basis(vectors)

    @property
    def kernel_code(self) -> int:
        """How ``decode_kernel.decode_attention`` is told these rows are coded (integer codes: their bits)."""
        raise NotImplementedError

    def spec(self) -> str:
        """What a saved file holds to make this codec again (``from_spec``)."""
        turned = "/rotated" if self.rotated else ""
        return f"{self.name}/{self.dim}/{str(self.dtype).removeprefix('torch.')}{turned}"


@dataclass(frozen=True)
class IntCodec(Codec):
    """``bits``-bit integers per token, asymmetric, a float16 scale and minimum per group of channels."""

    bits: ClassVar[int] = 8

    @property
    def groups(self) -> int:
        return self.dim // group_size(self.dim)

    @property
    def kernel_code(self) -> int:
        return self.bits

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def code_bytes(self) -> int:
        return self.dim * self.bits // 8

    @property
    def row_bytes(self) -> int:
        return self.code_bytes + 4 * self.groups

    def encode(self, vectors: torch.Tensor) -> torch.Tensor:
        lead = vectors.shape[:-1]
        grouped = self.into_basis(vectors.float()).reshape(*lead, self.groups, -1)
        low, high = torch.aminmax(grouped, dim=-1, keepdim=True)
        half = torch.finfo(torch.float16)
        # scale and minimum as decoding will read them (float16; a scale of 0, all channels equal, kept from dividing)
        scale = ((high - low) / self.levels).clamp(half.tiny, half.max).half()
        low = low.clamp(half.min, half.max).half()
        codes = ((grouped - low) / scale).round_().clamp_(0, self.levels).to(torch.uint8).reshape(*lead, self.dim)
        # every group's scale, then every group's minimum
        meta = torch.cat([scale, low], dim=-1).transpose(-1, -2).reshape(*lead, 2 * self.groups).view(torch.uint8)
        return torch.cat([self.pack(codes), meta], dim=-1)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[..., dim]`` (one per byte) as the row's ``code_bytes`` (8 bits: as they are)."""
        return codes

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``pack``'s inverse, ``[..., dim]`` uint8."""
        return packed

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        lead = rows.shape[:-1]
        codes = self.unpack(rows[..., : self.code_bytes])
        # rows are even-sized, so the float16 scales are read in place; converted, scaled and shifted in place (a
        # product mixing uint8 and float32 takes PyTorch's slow casting loop on a CPU: 4x slower)
        meta = rows[..., self.code_bytes :].view(torch.float16).float().view(*lead, 2, self.groups, 1)
        decoded = codes.reshape(*lead, self.groups, -1).float().mul_(meta[..., 0, :, :]).add_(meta[..., 1, :, :])
        return decoded.reshape(*lead, self.dim).to(self.dtype)


class Int8Codec(IntCodec):
    name = "int8"
    bits = 8


class Int4Codec(IntCodec):
    """Two codes a byte: channel 2i in byte i's low nibble, 2i + 1 in its high one."""

    name = "int4"
    bits = 4

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        return nibbles(codes)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        return from_nibbles(packed)


class Int6Codec(IntCodec):
    """Keys in 6 bits (``key_bits=6``): each code's low 4 bits laid out as int4's (``dim / 2`` bytes), then per
    group of channels its codes' top 2 bits, a quarter of the group a byte, in the order a group unpacks from
    nibbles (its even channels, then its odd ones): place ``m + j * group / 4`` at bits ``2j`` and ``2j + 1`` of the
    group's byte ``m``. A reader takes int4's nibbles and adds 16 times the top bits, each top byte's four places
    a quarter of the group apart (the CPU kernel's loads stay contiguous)."""

    name = "int6"
    bits = 6

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        group = group_size(self.dim)
        top = (codes >> 4).unflatten(-1, (-1, group))
        unpacked_order = torch.cat([top[..., 0::2], top[..., 1::2]], dim=-1)
        # the four places of a byte as one weighted sum (each new token is coded eagerly: few small ops)
        places = _PLACES.get(str(codes.device))
        if places is None:
            places = _PLACES[str(codes.device)] = torch.tensor(
                [[1], [4], [16], [64]], dtype=torch.uint8, device=codes.device
            )
        tops = (unpacked_order.unflatten(-1, (4, -1)) * places).sum(-2, dtype=torch.uint8).flatten(-2)
        return torch.cat([nibbles(codes & 15), tops], dim=-1)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        group = group_size(self.dim)
        tops = packed[..., self.dim // 2 :].unflatten(-1, (-1, group // 4))
        unpacked_order = torch.stack([(tops >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2).flatten(-2)
        top = torch.stack([unpacked_order[..., : group // 2], unpacked_order[..., group // 2 :]], dim=-1)
        return from_nibbles(packed[..., : self.dim // 2]) | (top.flatten(-3) << 4)


_PLACES: dict[str, torch.Tensor] = {}  # int6's top-bit weights, once per device (a compiled step reads them)


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., n]`` two a byte ``[..., n / 2]``: code 2i in byte i's low nibble, 2i + 1 in its high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def from_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``nibbles``' inverse."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


@dataclass(frozen=True)
class Fp8Codec(Codec):
    """float8 e4m3, scale 1, saturating (vLLM's ``fp8`` cache dtype without checkpoint scales)."""

    name = "fp8"

    @property
    def row_bytes(self) -> int:
        return self.dim

    @property
    def kernel_code(self) -> int:
        return FP8_CODE

    def encode(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.view(torch.float8_e4m3fn).to(self.dtype)


_CLASSES: dict[str, type[Codec]] = {"int8": Int8Codec, "int6": Int6Codec, "int4": Int4Codec, "fp8": Fp8Codec}


_TURNS: dict[tuple[int, str], torch.Tensor] = {}  # built once per size and device (a compiled step reads it)


def hadamard(size: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix ``[size, size]`` (``size`` a power of two), float32, symmetric."""
    key = (size, str(device))
    if key not in _TURNS:
        turn = torch.ones(1, 1)
        while turn.shape[0] < size:
            turn = torch.cat([torch.cat([turn, turn], 1), torch.cat([turn, -turn], 1)], 0)
        _TURNS[key] = (turn / math.sqrt(size)).to(device)
    return _TURNS[key]


def make_codec(name: str, dim: int, dtype: torch.dtype, rotated: bool = False) -> Codec:
    """The codec ``name`` (int8, int6, int4 or fp8) for vectors of ``dim`` channels computed in ``dtype``;
    ``rotated``: integer codes of Hadamard-turned vectors (float8 is never turned, as vLLM stores it)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown KV codec {name!r}; valid: {', '.join(_CLASSES)}")
    if dim % 4:
        raise ValueError(f"a {name} KV codec needs a head size divisible by 4, got {dim}")
    return _CLASSES[name](dim, dtype, rotated and name != "fp8")


def from_spec(spec: str | None) -> Codec | None:
    """The codec ``Codec.spec`` wrote (None: the model's own precision)."""
    if spec is None:
        return None
    name, dim, dtype, *turned = spec.split("/")
    return make_codec(name, int(dim), getattr(torch, dtype), rotated=turned == ["rotated"])


@dataclass(frozen=True)
class KVCodec:
    """What a storage writes its keys and its values with: one codec each, the same one unless keys take more bits
    than values (``key_bits``: a key's error moves every attention weight, a value's only its own share of the
    output; docs/quantization.md measures it). Both turn alike where they turn (one Hadamard basis per group)."""

    keys: Codec
    values: Codec

    @property
    def dim(self) -> int:
        return self.keys.dim

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def name(self) -> str:
        """``int4``, or the keys' and the values' names joined by ``+`` where they differ (``int6+int4``)."""
        return self.keys.name if self.keys.name == self.values.name else f"{self.keys.name}+{self.values.name}"

    def spec(self) -> str:
        """``Codec.spec``, or the keys' and the values' joined by ``+`` where they differ."""
        return self.keys.spec() if self.keys == self.values else f"{self.keys.spec()}+{self.values.spec()}"


def make_kv_codec(name: str, dim: int, dtype: torch.dtype, rotated: bool = False) -> KVCodec:
    """``name``: one codec for keys and values (``int4``), or the keys' and the values' (``int8+int4``)."""
    parts = [make_codec(part, dim, dtype, rotated) for part in name.split("+")]
    return KVCodec(parts[0], parts[-1])


def kv_from_spec(spec: str | None) -> KVCodec | None:
    """The storage codec ``KVCodec.spec`` wrote (a single codec's spec, as files before ``key_bits`` hold, codes
    keys and values alike; None: the model's own precision)."""
    if spec is None:
        return None
    parts = [cast(Codec, from_spec(part)) for part in spec.split("+")]
    return KVCodec(parts[0], parts[-1])


# What a storage does with its codec (None: tokens held as computed), in one place for every layout.

ENCODE_TOKENS = 4096  # tokens (along dim -2) coded at a time: coding goes through float32 copies of what it codes


def encoded_pair(codec: KVCodec | None, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as a storage with ``codec`` holds them (one codec: coded in one call, half the small ops).
    A long cache is coded ``ENCODE_TOKENS`` tokens at a time (every vector is coded alone: the same rows, up to the
    turn's float rounding), so the float32 copies coding makes stay a piece's size, not a few times the cache's."""
    if codec is None:
        return keys, values
    if keys.shape[-2] > ENCODE_TOKENS:
        pieces = [
            encoded_pair(codec, k, v) for k, v in zip(keys.split(ENCODE_TOKENS, -2), values.split(ENCODE_TOKENS, -2))
        ]
        return torch.cat([k for k, _ in pieces], -2), torch.cat([v for _, v in pieces], -2)
    if codec.keys != codec.values:
        return codec.keys.encode(keys), codec.values.encode(values)
    coded_keys, coded_values = codec.keys.encode(torch.stack([keys, values])).unbind(0)
    return coded_keys, coded_values


def decoded_pair(codec: KVCodec | None, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored keys and values as a step attends them (in the codec's basis: ``Codec.into_basis``)."""
    return (keys, values) if codec is None else (codec.keys.decode(keys), codec.values.decode(values))


def attended_pair(codec: KVCodec | None, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's keys and values for an attention that does not read codes: decoded where they are still coded rows
    (``Slots.reads_codes``: a layer's update may hand its rows on undecoded), as they are otherwise."""
    return decoded_pair(codec, keys, values) if keys.dtype == torch.uint8 and codec is not None else (keys, values)


def restored_pair(codec: KVCodec | None, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored keys and values as the model computed them (up to rounding: a later prompt continuing them)."""
    return (keys, values) if codec is None else (codec.keys.restore(keys), codec.values.restore(values))


def into_basis(codec: KVCodec | None, query: torch.Tensor) -> torch.Tensor:
    """A step's queries in the basis its storage's keys are decoded in."""
    return query if codec is None else codec.keys.into_basis(query)


def out_of_basis(codec: KVCodec | None, out: torch.Tensor) -> torch.Tensor:
    """A step's attention output (a mix of decoded values) back in the model's basis."""
    return out if codec is None else codec.values.out_of_basis(out)


def token_bytes(codec: KVCodec | None, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
    """Bytes of one token's stored key and value vectors together (``keys``, ``values``: buffers of them), and of
    the same two vectors as computed."""
    held = keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()
    return (held, held) if codec is None else (held, 2 * codec.dim * codec.dtype.itemsize)


def coded_rows(
    codec: KVCodec | None, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """Stored keys and values with their ``kernel_code``s, which a kernel may read as they are
    (``decode_kernel.decode_attention``); None where the storage holds them at the model's precision."""
    if codec is None:
        return None
    return keys, values, codec.keys.kernel_code, codec.values.kernel_code


def codec_of_code(code: int, dim: int, dtype: torch.dtype) -> Codec:
    """The codec whose rows ``kernel_code`` names (turned or not alike: decoding does not turn back)."""
    return make_codec("fp8" if code == FP8_CODE else f"int{code}", dim, dtype)
