"""A byte budget spent by importance (``kv_bytes`` on every prompt method): which tokens each layer keeps, and in
which precision, so that the prompt's kept tokens cost at most a share of its 16-bit cache's bytes.

The allocation is a rate-distortion choice made per prompt, every layer's scores at hand (as ``layers="global"``),
in the spirit of RDKV and KVTuner (layer-wise precision) with SnapKV-style eviction inside each layer:

* **Distortion of dropping.** A method's scores of one KV head, normalised to sum to one over the positions it may
  drop, are read as each position's share of the head's attention: dropping a set of positions costs their share
  (the head's output loses that much of its mix), averaged over the layer's heads.
* **Distortion of coding.** Each layer's cost of storing its tokens with a codec is measured on the prompt itself:
  the relative error of the attention output of the layer's last queries (the method's own, or its last keys where
  the method reads no queries) over its best tokens (as many as a uniform share of the bytes in the fewest bits)
  coded, against them as computed. Nothing is a constant per model.
* **Bytes.** A kept token of one KV head costs its key and value rows as the device holds them (codes, scales and
  minimums, or the model's own precision) and its position (and, packed, its validity; each packed head's start,
  length and capacity besides).

For a multiplier ``lam`` each layer picks the precision minimising its coding distortion plus its heads' dropping
distortion plus ``lam`` times its bytes, a head keeping exactly the positions whose share exceeds ``lam`` times a
token's bytes (the Lagrangian's optimum for a fixed precision; with ``heads="uniform"`` every head of a layer keeps
the same count, by the heads' mean share at each rank, so the layer's storage stays dense and its codes are read
by the decoding kernel as they are); ``lam`` is the smallest found by bisection whose bytes fit. Tokens a method
always keeps (``+inf``: SnapKV's window, sinks) are kept and paid for first.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..storage.attention import grouped_logits
from ..storage.codec import KVCodec, encoded_pair, make_kv_codec, restored_pair

PRECISIONS: tuple[str | None, ...] = (None, "int8", "int6+int4", "int4")  # None: the model's own precision
PROBE_QUERIES = 32  # the last queries a layer's coding error is measured with
POSITION_BYTES = 8  # a kept token's prompt position (int64), per KV head
PACKED_BYTES = 1  # and, packed, its validity (bool)
SEGMENT_BYTES = 24  # a packed head's start, length and capacity (int64 each), whatever it keeps
SIXTEEN_BIT = 2  # bytes per element of the 16-bit cache a share is of


@dataclasses.dataclass
class LayerScores:
    """What the allocation reads of one compressed layer of one prompt: its scores ``[kv_heads, seq]`` (``+inf``:
    always kept; only real positions), its keys and values ``[kv_heads, seq, dim]`` and the queries it is probed
    with ``[heads, n, dim]`` (its query heads, or its KV heads where its last keys stand in)."""

    scores: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    probe: torch.Tensor
    scaling: float


@dataclasses.dataclass
class LayerPlan:
    """One layer's share of the bytes: its codec (None: the model's precision) and the positions each KV head keeps
    ``[kv_heads, seq]`` bool."""

    codec: str | None
    keep: torch.Tensor


def token_bytes(codec: str | None, head_dim: int, dtype: torch.dtype, packed: bool) -> int:
    """Bytes one kept token of one KV head costs the device with ``codec``: its key and value rows and its position
    (``packed``: and its validity)."""
    index = POSITION_BYTES + (PACKED_BYTES if packed else 0)
    if codec is None:
        return 2 * head_dim * dtype.itemsize + index
    coded = make_kv_codec(codec, head_dim, dtype)
    return coded.keys.row_bytes + coded.values.row_bytes + index


def probe_output(
    probe: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, seq: int, scaling: float
) -> torch.Tensor:
    """The attention output of the prompt's last ``n`` queries ``probe [q_heads, n, dim]`` over the keys and values
    ``[kv_heads, k, dim]`` at prompt ``positions [kv_heads, k]`` of ``seq`` (causal), ``[kv_heads, group * n, dim]``
    in float32."""
    heads, n, _ = probe.shape
    kv_heads, k = positions.shape
    logits = grouped_logits(probe[None], keys[None], scaling)[0].view(kv_heads, heads // kv_heads, n, k)
    rows = torch.arange(seq - n, seq, device=keys.device)
    logits.masked_fill_(positions[:, None, None, :] > rows[None, None, :, None], -math.inf)
    return logits.softmax(-1).view(kv_heads, -1, k) @ values.float()


def coding_errors(layer: LayerScores, codecs: list[KVCodec | None], probed: int) -> list[float]:
    """Each codec's relative error of the layer's probe output, its keys and values coded against as computed, over
    each head's ``probed`` best positions by the method's scores (the tokens worth coding; a uniform allocation in
    the fewest bits keeps that many) and the probe's own."""
    seq, n, dim = layer.keys.shape[1], layer.probe.shape[1], layer.keys.shape[-1]
    ranked = layer.scores.float().clone()
    ranked[:, seq - n :] = math.inf
    positions = ranked.topk(min(seq, probed + n), dim=-1).indices.sort(-1).values
    index = positions[..., None].expand(-1, -1, dim)
    keys, values = layer.keys.gather(1, index), layer.values.gather(1, index)
    exact = probe_output(layer.probe, keys, values, positions, seq, layer.scaling)
    errors = []
    for codec in codecs:
        coded = (
            exact
            if codec is None
            else probe_output(
                layer.probe, *restored_pair(codec, *encoded_pair(codec, keys, values)), positions, seq, layer.scaling
            )
        )
        errors.append(float((coded - exact).norm() / exact.norm().clamp(min=1e-30)))
    return errors


@dataclasses.dataclass
class Candidates:
    """One layer's options: per precision its coding distortion and token bytes; per head its droppable shares
    sorted high to low ``[kv_heads, free]`` (0 past a head's own; one row, the heads' mean, where every head keeps
    the same count), their running sums, and each head's pinned tokens ``[kv_heads]``."""

    errors: list[float]
    costs: list[int]
    shares: torch.Tensor
    cumulative: torch.Tensor
    pinned: torch.Tensor

    def best(self, lam: float) -> tuple[int, torch.Tensor, int]:
        """The precision (an index into ``PRECISIONS``) minimising distortion plus ``lam`` times bytes, each head's
        count of droppable positions kept ``[kv_heads]`` and the layer's bytes."""
        heads = self.pinned.shape[0]
        options = []
        for index, (error, cost) in enumerate(zip(self.errors, self.costs)):
            counts = (self.shares > lam * cost * heads).sum(-1)  # the shares are sorted: each head's top ``count``
            kept = self.cumulative.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0] * (counts > 0)
            counts = counts.expand(heads)
            tokens = int((counts + self.pinned).sum())
            options.append((error + float((1 - kept).mean()) + lam * cost * tokens, index, counts, cost * tokens))
        _, index, counts, spent = min(options, key=lambda option: option[0])
        return index, counts, spent


def candidates(
    layer: LayerScores, codecs: list[KVCodec | None], costs: list[int], uniform_heads: bool, probed: int
) -> Candidates:
    """The layer's distortions and costs (``codecs``: each precision's, as its storage would code; ``uniform_heads``:
    every head keeps the same count, chosen by the heads' mean share at each rank; ``probed``: the tokens per head
    its coding errors are measured over)."""
    scores = layer.scores.float()
    pinned = scores == math.inf
    if not bool(pinned.any(-1).all()):  # a head keeps at least its best position
        first = scores.argmax(-1, keepdim=True)
        pinned = pinned.scatter(-1, first, True)
    free = scores.masked_fill(pinned, 0.0).clamp(min=0.0)
    total = free.sum(-1, keepdim=True)
    droppable = (~pinned).sum(-1, keepdim=True).clamp(min=1)
    shares = torch.where(total > 0, free / total.clamp(min=1e-30), (~pinned).float() / droppable)
    shares = shares.masked_fill(pinned, -1.0).sort(-1, descending=True).values.clamp(min=0.0)
    if uniform_heads:
        shares = shares.mean(0, keepdim=True)
    errors = coding_errors(layer, codecs, probed)
    return Candidates(errors, costs, shares, shares.double().cumsum(-1).float(), pinned.sum(-1))


def allocate(
    layers: list[LayerScores], budget: float, head_dim: int, dtype: torch.dtype, rotated: bool, uniform_heads: bool
) -> list[LayerPlan]:
    """Each layer's plan for one prompt under ``budget`` bytes (see the module; ``uniform_heads``: every head of a
    layer keeps the same count, stored dense; else each its own, packed). Where even the tokens every layer must
    keep do not fit in the fewest bits, those are what each layer keeps, in the fewest bits (as a token budget never
    keeps fewer than them: a short prompt then holds more than its share, which its stats say)."""
    codecs = [None if name is None else make_kv_codec(name, head_dim, dtype, rotated) for name in PRECISIONS]
    costs = [token_bytes(name, head_dim, dtype, packed=not uniform_heads) for name in PRECISIONS]
    heads = layers[0].scores.shape[0]
    probed = math.ceil(budget / (len(layers) * heads * min(costs)))  # a uniform share in the fewest bits
    options = [candidates(layer, codecs, costs, uniform_heads, probed) for layer in layers]

    def spend(lam: float) -> tuple[list[tuple[int, torch.Tensor, int]], int]:
        chosen = [option.best(lam) for option in options]
        return chosen, sum(spent for _, _, spent in chosen)

    packing = 0 if uniform_heads else sum(packing_bytes(layer.scores.shape[0]) for layer in layers)
    pinned = sum(int(option.pinned.sum()) for option in options)
    budget = max(budget - packing, pinned * min(costs))  # (at the floor, an infinite multiplier: the pinned alone)
    low, high = 0.0, 1.0
    while spend(high)[1] > budget:
        low, high = high, high * 16
    if spend(low)[1] > budget:
        for _ in range(60):  # the smallest multiplier whose bytes fit, to a relative 1e-18
            middle = (low + high) / 2
            low, high = (low, middle) if spend(middle)[1] <= budget else (middle, high)
        low = high
    chosen, _ = spend(low)
    return [
        LayerPlan(PRECISIONS[index], kept_positions(layer.scores, counts))
        for layer, (index, counts, _) in zip(layers, chosen)
    ]


def packing_bytes(heads: int) -> int:
    """What a packed layer of one prompt holds whatever it keeps: each head's start, length and capacity, and the
    sentinel slot's validity."""
    return SEGMENT_BYTES * heads + PACKED_BYTES


def kept_positions(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, seq]`` bool: each head's pinned positions (``+inf``; its best where none is) and its ``counts``
    highest others (ties to the earlier position)."""
    heads, seq = scores.shape
    pinned = scores == math.inf
    order = scores.float().masked_fill(pinned, math.inf).argsort(dim=-1, descending=True, stable=True)
    room = pinned.sum(-1).clamp(min=1) + counts
    ranks = torch.arange(seq, device=scores.device)[None, :] < room[:, None]
    return torch.zeros_like(pinned).scatter(-1, order, ranks)
