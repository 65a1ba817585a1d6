"""Where a layer's keys and values live: one small interface, one class per layout.

A cache layer (cache/layer.py) holds one ``Slots`` object and drives it; the storage knows no method. Every
layout keeps the layer's lengths, the one place they live: the device-side write position and
validity are the truth a step reads (``write`` at the position, ``close_step`` moves it), and
``seen`` (tokens fed, padding included: the layer's length to transformers) and ``used`` (slots
holding tokens) are host mirrors that describe the cache before a step until it commits, then move
in ``advance``, eager or compiled alike (a compiled step reads none of them). The layouts:

* ``DenseSlots``: ``[batch, kv_heads, slots, head_dim]`` buffers with spare room at the end; the
  prompt is held as the prefill computed it until the first later step moves it into buffers of a
  fixed capacity, after which a step writes at ``cursor`` (a device tensor) and keeps every shape.
* ``RingSlots``: a sliding window's ring (the token of logical index ``t`` in slot ``t % capacity``).
* ``CappedSlots``: dense slots that hold at most ``limit`` tokens after each step (a layer that
  evicts while decoding keeps its best at the front), with per-slot annotations moved along.
* ``BoundedSlots``: dense slots whose buffers never grow past ``limit`` while decoding; the layer
  compacts what it re-selects to the front, in place (a decoding bound for every prompt method).
* ``packed.PackedSlots``: one segment per (row, KV head), each with its own length.

An offload store of chunks (``offload.ChunkStore``) is held beside a layer's slots, not instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, cast

import torch

from .attention import causal_slot_mask, dense_attention, hands_codes, spelled_out_with_lse, with_sinks
from .codec import (
    KVCodec,
    attended_pair,
    coded_rows,
    decoded_pair,
    encoded_pair,
    into_basis,
    kv_from_spec,
    out_of_basis,
    restored_pair,
    token_bytes,
)
from .tensors import gather_rows, gather_tokens, nbytes, prompt_positions


def spare_slots(slots: int) -> int:
    """Room a slot buffer gets beyond ``slots`` when it grows: ~6%, at least 16 and at most 1024 slots."""
    return min(1024, max(16, slots // 16))


def capacity_bucket(slots: int) -> int:
    """The capacity a compiled decoding step's buffer of ``slots`` slots takes: the next power of two
    (at least 64), so requests of other lengths in the same bucket reuse the compiled step."""
    return 1 << max(6, (slots - 1).bit_length())


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` moved to ``device`` if it is a tensor (a saved state's entries: tensors or plain values)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def nested(prefix: str, state: dict[str, Any] | None) -> dict[str, Any]:
    """An object's saved state inside its holder's, its names under ``prefix.`` (None: ``prefix`` is None)."""
    return {prefix: None} if state is None else {f"{prefix}.{name}": value for name, value in state.items()}


def held_state(held: Any) -> dict[str, Any] | None:
    """The saved state of an object a layer holds (None where it holds none)."""
    return None if held is None else held.state_dict()


def inner(state: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    """The entries ``nested`` put under ``prefix``, without it (None where the object was None)."""
    if state.get(prefix, "") is None:
        return None
    return {name[len(prefix) + 1 :]: value for name, value in state.items() if name.startswith(prefix + ".")}


class SlotView(NamedTuple):
    """What a layer's attention and its callers see of the slots, whatever the layout."""

    keys: torch.Tensor  # [b, h, slots, d] handed to attention (a layout that attends itself: no slots)
    values: torch.Tensor
    valid: torch.Tensor | None  # [b, slots]; None while every slot is real
    positions: torch.Tensor | None  # [b, h, prompt slots]: prompt positions held (None: slot order)
    cursor: torch.Tensor | None  # [1] on the device: the slot of the next token (None: no step yet)


class Slots:
    """The storage interface a layer drives (see the module docstring)."""

    NAME: ClassVar[str] = ""  # the prefix of the layout's own saved entries, for layouts a layer swaps to

    seen: int  # tokens fed, padding included
    used: int  # slots holding tokens (per row and KV head: the longest)
    codec: KVCodec | None = None  # how tokens are stored from ``encode_with`` on (None: as the model computed them)

    def view(self, decoded: bool = True) -> SlotView:
        """The attend-ready views (``decoded=False``: keys and values as stored, coded rows where a codec writes
        them: for shapes and validity, without decoding every token)."""
        raise NotImplementedError

    def encode_with(self, codec: KVCodec) -> None:
        """Store the held tokens, and every later one, with ``codec`` (codec.py)."""
        raise NotImplementedError

    def reads_codes(self, new_keys: torch.Tensor) -> bool:
        """Whether ``attend`` reads this step's slots as stored, so a step of ``new_keys`` may hand the coded rows
        on instead of decoding them (``view(decoded=False)``)."""
        raise NotImplementedError

    def make_room(self, new: int) -> None:
        """Room for a step of ``new`` tokens (the buffers move only when the room runs out)."""
        raise NotImplementedError

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        """Room for ``tokens`` more tokens now; ``buckets``: a capacity other requests share (``capacity_bucket``)."""
        raise NotImplementedError

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a step's tokens at the device-side position (valid until ``mark_padding`` says otherwise)."""
        raise NotImplementedError

    def mark_padding(self, valid: torch.Tensor) -> None:
        """The validity ``[b, q]`` of this step's tokens."""
        raise NotImplementedError

    def close_step(self, new: int) -> None:
        """Move the device-side position past this step's ``new`` tokens."""
        raise NotImplementedError

    def advance(self, new: int) -> None:
        """The host mirrors after a step of ``new`` tokens."""
        raise NotImplementedError

    def visibility(
        self, new_block: torch.Tensor | None, q_len: int, new_valid: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The mask a later step's queries attend with (``new_block``: the new tokens among themselves; ``new_valid
        [b, q]``: which of them are real, None: all)."""
        raise NotImplementedError

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` over the slots (``keys``/``values``: the view, as ``update`` returned it)."""
        raise NotImplementedError

    def kept_positions(self, prefill_len: int) -> torch.Tensor:
        """Prompt positions held ``[b, h, n]`` ascending per head (-1: filler); the prompt is ``prefill_len`` slots."""
        raise NotImplementedError

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """The held tokens as a context a later prompt continues without writing to them: keys, values
        ``[b, h, n, d]``, validity ``[b, n]`` and prompt positions ``[b, h, n]`` (None: tokens in order);
        None where the layout cannot be read as one (a ring, packed segments)."""
        raise NotImplementedError

    def memory(self, full_tokens: int) -> dict[str, int]:
        """Bytes: ``kv_tokens``, ``kv_bytes_full`` (``full_tokens`` per head), ``kv_bytes_kept``, ``spare_bytes``,
        ``index_bytes``, ``bytes_read_per_step`` (a step reads every slot, room included)."""
        raise NotImplementedError

    def batch_apply(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A batch operation (select, repeat, reorder rows) on every tensor with the batch first."""
        raise NotImplementedError

    def joined(self, others: list[Slots]) -> Slots:
        """These rows, then ``others``' (groups of one batch, compressed, not decoded yet), as one storage."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The layout's saved entries (docs/file-format.md)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Put ``state`` (``state_dict``'s entries in host memory) into this fresh storage on ``device``."""
        raise NotImplementedError


def store_coded(slots: Slots, codec: KVCodec | None) -> None:
    """From compression on, the held tokens and every later one stored with ``codec`` (None: as computed); a storage
    already coded (loaded, or continued) keeps its codes."""
    if codec is not None and slots.codec is None:
        slots.encode_with(codec)


def step_attention(
    slots: Slots,
    attend: Callable[..., torch.Tensor],
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    new_block: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    new_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """A later step's attention over ``slots`` by ``attend`` (the layer's: ``Slots.attend``, or a method's own): what
    each query sees (``visibility``), in the basis the codec decodes keys in, the output turned back (codec.py);
    with learned sinks (gpt-oss) the same attention spelled out, each sink taking its share."""
    mask, codec = slots.visibility(new_block, query.shape[-2], new_valid), slots.codec
    turned = into_basis(codec, query)
    if sinks is None:
        return out_of_basis(codec, attend(turned, keys, values, mask, scaling, softcap))
    out, lse = spelled_out_with_lse(turned, *attended_pair(codec, keys, values), mask, scaling, softcap)
    return out_of_basis(codec, with_sinks(out, lse, sinks))


class DenseSlots(Slots):
    """``[batch, kv_heads, slots, head_dim]`` buffers, every KV head the same slots (module docstring)."""

    # set by the first fill (hold, write_block, set, load_state_dict): read only from then on (the layer's phase)
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self) -> None:
        self.valid: torch.Tensor | None = None  # [batch, slots]; None while every slot is real (no padding)
        self.positions: torch.Tensor | None = None  # [batch, kv_heads, prompt slots]: prompt positions held
        self.cursor: torch.Tensor | None = None  # [1] on the device: the next token's slot (in a step: its first's)
        self.seen = 0
        self.used = 0  # slots holding tokens: [0, used)

    def view(self, decoded: bool = True) -> SlotView:
        if decoded and self.codec is not None:
            return SlotView(*decoded_pair(self.codec, self.keys, self.values), self.valid, self.positions, self.cursor)
        return SlotView(self.keys, self.values, self.valid, self.positions, self.cursor)

    def encode_with(self, codec: KVCodec) -> None:
        self.codec = codec
        self.keys, self.values = encoded_pair(codec, self.keys, self.values)

    def reads_codes(self, new_keys: torch.Tensor) -> bool:
        # a decoding step over codes a kernel may read as stored (attention.hands_codes)
        coded = coded_rows(self.codec, self.keys, self.values)
        return new_keys.shape[-2] == 1 and coded is not None and hands_codes(new_keys, *coded[2:])

    # --- the prompt ---------------------------------------------------------------------------------

    def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The first fill, held as computed (not copied)."""
        self.keys, self.values = keys, values

    def write_block(self, keys: torch.Tensor, values: torch.Tensor, total: int) -> None:
        """A block of a prompt ``total`` tokens long, written after the blocks before it into one buffer."""
        if self.used == 0:
            self.keys, self.values = (t.new_empty(*t.shape[:2], total, t.shape[-1]) for t in (keys, values))
        end = self.used + keys.shape[-2]
        self.keys[:, :, self.used : end] = keys
        self.values[:, :, self.used : end] = values

    def set(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Replace every slot (e.g. by the kept ones). ``valid [b, slots]`` (None: all real),
        ``positions [b, kv_heads, prompt slots]`` (None: derived from validity)."""
        self.keys, self.values, self.valid, self.positions = keys, values, valid, positions
        self.used, self.cursor = keys.shape[-2], None

    def keep(self, indices: torch.Tensor, slot_valid: torch.Tensor) -> None:
        """Keep, per row and KV head, the prompt slots ``indices [b, kv_heads, n]`` (ascending);
        ``slot_valid [b, n]`` marks filler slots of rows that keep fewer."""
        if self.positions is not None:  # slots that are not the prompt's tokens in order (a thinned context, continued)
            kept = self.positions.gather(2, indices)
        else:
            kept = gather_rows(prompt_positions(self.slot_validity()), indices)
        kept = kept.masked_fill(~slot_valid[:, None, :], -1)
        valid = None if bool(slot_valid.all()) else slot_valid
        self.set(gather_tokens(self.keys, indices), gather_tokens(self.values, indices), valid, kept)

    def slot_validity(self) -> torch.Tensor:
        """``[batch, slots]`` bool, True for real tokens."""
        if self.valid is not None:
            return self.valid
        return torch.ones(self.keys.shape[0], self.keys.shape[-2], dtype=torch.bool, device=self.keys.device)

    # --- steps --------------------------------------------------------------------------------------

    def make_room(self, new: int) -> None:
        if self.cursor is None or self.keys.shape[-2] - self.used < new:
            self.relayout(self.used + new + spare_slots(self.used + new))

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        if buckets:
            capacity = capacity_bucket(self.used + tokens)
            if self.cursor is None or self.keys.shape[-2] != capacity:
                self.relayout(capacity)
        elif self.cursor is None or self.keys.shape[-2] - self.used < tokens:
            self.relayout(self.used + max(tokens, spare_slots(self.used)))

    def relayout(self, capacity: int) -> None:
        """Move the ``used`` slots into buffers of ``capacity`` slots (the rest: room, invalid)."""
        held = (self.keys[:, :, : self.used], self.values[:, :, : self.used])
        self.keys, self.values = (t.new_zeros(*t.shape[:2], capacity, t.shape[-1]) for t in held)
        for buffer, tensor in zip((self.keys, self.values), held):
            buffer[:, :, : self.used].copy_(tensor)
        valid = torch.zeros(self.keys.shape[0], capacity, dtype=torch.bool, device=self.keys.device)
        valid[:, : self.used] = True if self.valid is None else self.valid[:, : self.used]
        self.valid = valid
        self.cursor = torch.tensor([self.used], device=self.keys.device)

    def stepping(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cursor, valid)`` while steps run: ``relayout``, which a step's ``make_room`` or ``reserve`` reaches
        before its first write, sets both (the step phase, said once to the type checker)."""
        if self.cursor is None or self.valid is None:
            raise RuntimeError("kvcompress: a step reached slots that make_room or reserve did not lay out")
        return self.cursor, self.valid

    def new_slots(self, new: int) -> torch.Tensor:
        """Slot indices ``[new]`` of this step's ``new`` tokens."""
        cursor = self.stepping()[0]
        return cursor if new == 1 else cursor + torch.arange(new, device=cursor.device)

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        slots = self.new_slots(keys.shape[-2])
        keys, values = encoded_pair(self.codec, keys, values)
        self.keys.index_copy_(2, slots, keys)
        self.values.index_copy_(2, slots, values)
        self.stepping()[1].index_fill_(1, slots, True)

    def mark_padding(self, valid: torch.Tensor) -> None:
        self.stepping()[1].index_copy_(1, self.new_slots(valid.shape[-1]), valid)

    def close_step(self, new: int) -> None:
        self.stepping()[0].add_(new)

    def advance(self, new: int) -> None:
        self.seen += new
        self.used += new

    def visibility(
        self, new_block: torch.Tensor | None, q_len: int, new_valid: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``[b, 1, q_len, slots]`` from each slot's validity and ``new_block [b, 1, q_len, q_len]`` (None: causal)."""
        valid = self.stepping()[1]
        seen = valid.view(valid.shape[0], 1, 1, -1)
        if q_len == 1:
            return seen  # a decoding token is valid from its write on: it sees itself and every real slot
        block = new_block if new_block is not None else causal_slot_mask(q_len, q_len, self.keys.device)
        mask = seen.expand(-1, -1, q_len, -1).clone()
        mask[..., self.used : self.used + q_len] = block  # the step's tokens, after the held ones
        return mask

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        # a decoding step may read coded rows as stored (attention.decode_attention)
        if softcap is not None:  # soft-capped logits are spelled out from decoded keys
            keys, values = attended_pair(self.codec, keys, values)
        return dense_attention(
            query, keys, values, mask, scaling, softcap, coded_rows(self.codec, self.keys, self.values)
        )

    def kept_positions(self, prefill_len: int) -> torch.Tensor:
        if self.positions is not None:
            return self.positions
        return prompt_positions(self.slot_validity()[:, :prefill_len])[:, None, :].expand(-1, self.keys.shape[1], -1)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        valid = None if self.valid is None else self.valid[:, : self.used]
        keys, values = restored_pair(self.codec, self.keys[:, :, : self.used], self.values[:, :, : self.used])
        return keys, values, valid, self.positions

    def index_tensors(self) -> list[torch.Tensor]:
        """The layout's own device tensors besides the slots."""
        return [t for t in (self.valid, self.positions, self.cursor) if t is not None]

    def memory(self, full_tokens: int) -> dict[str, int]:
        batch, heads = self.keys.shape[:2]
        stored, uncoded = token_bytes(self.codec, self.keys, self.values)
        per_token = batch * heads * stored
        held = nbytes(self.keys, self.values)
        return {
            "kv_tokens": self.used,
            "kv_bytes_full": batch * heads * uncoded * full_tokens,
            "kv_bytes_kept": per_token * self.used,
            "spare_bytes": held - per_token * self.used,
            "index_bytes": nbytes(*self.index_tensors()),
            "bytes_read_per_step": held,
        }

    # --- batches and files ----------------------------------------------------------------------------

    BATCH: ClassVar[tuple[str, ...]] = ("keys", "values", "valid", "positions")  # attributes with the batch first

    def batch_apply(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self.BATCH:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, apply(value))

    def joined(self, others: list[Slots]) -> Slots:
        parts = [self, *cast(list[DenseSlots], others)]
        if any(part.valid is not None for part in parts):  # a group without padding holds None
            for part in parts:
                part.valid = part.slot_validity()
        if any(part.positions is not None for part in parts):
            for part in parts:
                part.positions = DenseSlots.kept_positions(part, part.used)  # every slot: a ring is not a ring yet
        for name in self.BATCH:
            values = [getattr(part, name) for part in parts]
            if values[0] is not None:
                setattr(self, name, torch.cat(values, dim=0))
            for other in others:
                setattr(other, name, None)  # freed as the join goes, not held twice
        self.used = self.keys.shape[-2]
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "values": self.values,
            "valid": self.valid,
            "positions": self.positions,
            "cursor": self.cursor,
            "seen_tokens": self.seen,
            "used": self.used,
            "codec": None if self.codec is None else self.codec.spec(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.keys, self.values, self.valid, self.positions, self.cursor = (
            on_device(state[name], device) for name in ("keys", "values", "valid", "positions", "cursor")
        )
        self.seen, self.used = state["seen_tokens"], state["used"]
        self.codec = kv_from_spec(state.get("codec"))  # files before codecs: stored as computed


class RingSlots(DenseSlots):
    """A sliding window's slots: after the prefill a ring, the token of logical index ``t`` in slot
    ``t % capacity``, ``slot_index`` saying which token each slot holds; a step overwrites the oldest
    token in place and sees the slots less than ``window`` of its row's real tokens before it. It holds the last
    ``window - 1`` tokens, all the model attends to from the next token on.

    The window counts each row's real tokens (``real``), not slots: a batch's questions of different lengths over one
    stored context are right-aligned, so padding lies between the context and a shorter question, and counted as
    tokens it would hide from that row context its window reaches when the row is alone."""

    BATCH: ClassVar[tuple[str, ...]] = (*DenseSlots.BATCH, "real", "count")

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.slot_index: torch.Tensor | None = None  # [capacity]: logical index of each slot's token (-window: empty)
        self.real: torch.Tensor | None = None  # [b, capacity]: each slot's index among its row's real tokens
        self.count: torch.Tensor | None = None  # [b]: real tokens each row has written (on the same count as real)

    def advance(self, new: int) -> None:
        self.seen += new
        self.used = self.used + new if self.cursor is None else min(self.used + new, self.window - 1)

    def make_room(self, new: int) -> None:
        needed = self.window - 1 + new  # every token of a longer turn sees the window before it
        if self.cursor is not None and new > 1:  # a turn: padding among what its rows still see counts (one sync)
            needed = self.reach() + new  # (a decoding step's rows never reach further back than the turn's did)
        if self.cursor is None or self.keys.shape[-2] < needed:
            self.relayout(needed + spare_slots(needed))

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        self.make_room(1)  # steps overwrite the oldest token: the ring is the model's window, whatever the request

    def relayout(self, capacity: int) -> None:
        """The held tokens (the last ``used`` before ``seen``) into a ring of ``capacity`` slots."""
        if self.cursor is None:
            order = torch.arange(self.used, device=self.keys.device)
            logical = order + (self.seen - self.used)
            valid = self.slot_validity()
            real = valid.long().cumsum(-1) - 1
            self.count = valid.sum(-1)
        else:
            span = self.reach()
            capacity = max(capacity, span + 1)
            logical = torch.arange(self.seen - span, self.seen, device=self.keys.device)
            order = logical % self.keys.shape[-2]
            valid = self.stepping()[1][:, order]
            real = self.counted()[0][:, order]
        slots = logical % capacity
        keys, values = (t.new_zeros(*t.shape[:2], capacity, t.shape[-1]) for t in (self.keys, self.values))
        keys.index_copy_(2, slots, self.keys[:, :, order])
        values.index_copy_(2, slots, self.values[:, :, order])
        self.keys, self.values = keys, values
        self.valid = torch.zeros(keys.shape[0], capacity, dtype=torch.bool, device=keys.device)
        self.valid.index_copy_(1, slots, valid)
        self.slot_index = torch.full((capacity,), -self.window, device=keys.device).index_copy_(0, slots, logical)
        self.real = torch.full_like(self.valid, -self.window, dtype=torch.long).index_copy_(1, slots, real)
        self.cursor = torch.tensor([self.seen], device=keys.device)

    def reach(self) -> int:
        """How many of the newest slots (logically) a later token may still see: ``used``, or more where a row's
        padding lies among them (its window reaches as many real tokens back as alone)."""
        index, (real, count) = self.ring(), self.counted()
        needed = self.stepping()[1] & (real > count[:, None] - self.window) & (index >= 0)
        oldest = int(torch.where(needed, index, self.seen).min()) if needed.numel() else self.seen
        return max(self.used, self.seen - oldest)

    def counted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(real, count)`` while steps run (``relayout`` sets them with the ring), as ``stepping()`` its cursor."""
        if self.real is None or self.count is None:
            raise RuntimeError("kvcompress: a step reached a ring that make_room or reserve did not lay out")
        return self.real, self.count

    def new_slots(self, new: int) -> torch.Tensor:
        return self.new_logical(new) % self.keys.shape[-2]

    def new_logical(self, new: int) -> torch.Tensor:
        """Logical indices ``[new]`` of this step's tokens."""
        return super().new_slots(new)

    def ring(self) -> torch.Tensor:
        """``slot_index`` while steps run (``relayout`` sets it with the cursor)."""
        if self.slot_index is None:
            raise RuntimeError("kvcompress: a step reached a ring that make_room or reserve did not lay out")
        return self.slot_index

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        new = keys.shape[-2]
        self.ring().index_copy_(0, self.new_slots(new), self.new_logical(new))
        self.counted()[0].index_copy_(1, self.new_slots(new), self.new_real(None, new))  # real until mark_padding
        super().write(keys, values)

    def new_real(self, valid: torch.Tensor | None, new: int) -> torch.Tensor:
        """``[b, new]``: each new token's index among its row's real tokens (``valid [b, new]``, None: all real)."""
        count = self.counted()[1][:, None]
        if valid is None:
            return count + torch.arange(new, device=count.device)
        return count + valid.long().cumsum(-1) - 1

    def mark_padding(self, valid: torch.Tensor) -> None:
        super().mark_padding(valid)
        self.counted()[0].index_copy_(1, self.new_slots(valid.shape[-1]), self.new_real(valid, valid.shape[-1]))

    def close_step(self, new: int) -> None:
        self.counted()[1].add_(self.stepping()[1].index_select(1, self.new_slots(new)).sum(-1))
        super().close_step(new)

    def visibility(
        self, new_block: torch.Tensor | None, q_len: int, new_valid: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Each new query sees its row's real slots less than ``window`` real tokens before it (and the new
        tokens as ``new_block`` says, which carries the window too)."""
        query, index = self.new_logical(q_len)[:, None], self.ring()  # [q, 1], [slots]
        query_real = self.new_real(new_valid, q_len)[:, :, None]  # [b, q, 1]
        near = (self.counted()[0][:, None, :] > query_real - self.window) & (index[None, :] <= query)[None]
        mask = (self.stepping()[1][:, None, :] & near)[:, None]
        if q_len == 1 or new_block is None:
            return mask
        return mask.index_copy(3, self.new_slots(q_len), new_block.expand(mask.shape[0], -1, -1, -1))

    def stored(self) -> None:
        return None  # a ring: a later prompt continues a copy of it (WindowLayer.continue_prompt)

    def kept_positions(self, prefill_len: int, prompt_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Prompt positions the next token still sees ``[b, kv_heads, n]``, ascending (-1: filler, first, of rows
        that hold fewer). Once steps run the slots are a ring, read by each slot's index among its row's real tokens:
        ``prompt_tokens [b]`` (the rows' real prompt tokens) places the last prompt token, every token since is real."""
        if self.slot_index is None:  # the prompt's slots in order, or the window kept at its end
            positions = super().kept_positions(prefill_len)
            gone = max(0, positions.shape[-1] + self.seen - prefill_len - (self.window - 1))  # pushed out since
            return positions[..., gone:]
        if prompt_tokens is None:
            raise RuntimeError("kvcompress: a ring's prompt positions need the rows' prompt token counts")
        real, count = self.counted()
        count = count[:, None]
        held = self.stepping()[1] & (real > count - self.window) & (self.ring() < prefill_len) & (self.ring() >= 0)
        positions = real + (prompt_tokens[:, None].to(real.device) - count + self.seen - prefill_len)
        positions = positions.masked_fill(~held, -1).sort(-1).values
        width = int(held.sum(-1).max()) if held.numel() else 0
        return positions[:, positions.shape[-1] - width :][:, None, :].expand(-1, self.keys.shape[1], -1)

    def index_tensors(self) -> list[torch.Tensor]:
        return [*super().index_tensors(), *(t for t in (self.slot_index, self.real, self.count) if t is not None)]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "slot_index": self.slot_index, "real": self.real, "count": self.count}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        super().load_state_dict(state, device)
        self.slot_index = on_device(state["slot_index"], device)
        self.real, self.count = on_device(state.get("real"), device), on_device(state.get("count"), device)
        if self.real is None and self.slot_index is not None:  # saved before rows counted their own tokens
            index, order = self.slot_index.sort()
            valid = self.stepping()[1][:, order] & (index >= 0)
            self.real = torch.full_like(self.stepping()[1], -self.window, dtype=torch.long)
            self.real[:, order] = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -self.window)
            self.count = valid.sum(-1)


class CappedSlots(DenseSlots):
    """Dense slots that hold at most ``limit`` tokens once decoding starts: each step writes after the
    held ones and the layer moves the ``limit`` it keeps to the front (``after_step``), so the device
    position stops at ``limit``. ``notes`` are per-slot annotations ``[b, h, slots]`` (a score, a
    position) that move with the slots, empty slots at their fill value; the ``accumulated`` ones (a
    score a step adds to) restart at it in every slot a step writes, the layer writes the others."""

    def __init__(self, limit: int, fills: dict[str, float], accumulated: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.limit = limit
        self.fills = fills  # each note's value in empty slots
        self.accumulated = accumulated
        self.notes: dict[str, torch.Tensor | None] = dict.fromkeys(fills)

    def advance(self, new: int) -> None:
        super().advance(new)
        if self.cursor is not None:
            self.used = min(self.used, self.limit)

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        super().reserve(max(1, min(tokens, self.limit + 1 - self.used)), buckets)  # at most the limit and a step

    def relayout(self, capacity: int) -> None:
        held = self.used
        super().relayout(capacity)
        for name, note in self.notes.items():
            if note is not None:
                pad = (0, capacity - held)
                self.notes[name] = torch.nn.functional.pad(note[..., :held], pad, value=self.fills[name])

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        slots = self.new_slots(keys.shape[-2])
        for name in self.accumulated:  # the room may hold an evicted slot's note
            cast(torch.Tensor, self.notes[name]).index_fill_(2, slots, self.fills[name])  # set as the prompt ended
        super().write(keys, values)

    def close_step(self, new: int) -> None:
        self.stepping()[0].add_(new).clamp_(max=self.limit)  # the slots after the limit were evicted

    def index_tensors(self) -> list[torch.Tensor]:
        return [*super().index_tensors(), *(note for note in self.notes.values() if note is not None)]

    def batch_apply(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().batch_apply(apply)
        self.notes = {name: None if note is None else apply(note) for name, note in self.notes.items()}

    def joined(self, others: list[Slots]) -> Slots:
        parts = [self, *cast(list[CappedSlots], others)]  # a note is held by every part of a join or by none
        notes = {
            name: None if note is None else torch.cat([cast(torch.Tensor, part.notes[name]) for part in parts])
            for name, note in self.notes.items()
        }
        super().joined(others)
        self.notes = notes
        return self

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "budget": self.limit, **self.notes}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        super().load_state_dict(state, device)
        self.limit = state["budget"]
        self.notes = {name: on_device(state[name], device) for name in self.notes}


class BoundedSlots(DenseSlots):
    """Dense slots whose buffers hold at most ``limit`` slots while decoding (a turn longer than the room left grows
    them for that turn, the next re-selection shrinks them back): the layer re-selects before a step would pass the
    limit and ``compact`` moves what it keeps to the front of the same buffers, in place, so a compiled step's graph
    (and a CUDA graph's addresses) stays valid. ``positions`` covers every held slot once a step has run (prompt and
    answer tokens; -1: room)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def held_positions(self) -> torch.Tensor:
        """The position of every held slot's token ``[b, h, used]`` (-1: filler)."""
        if self.positions is not None:
            return self.positions[..., : self.used]
        return DenseSlots.kept_positions(self, self.used)

    def make_room(self, new: int) -> None:
        if self.cursor is None or self.keys.shape[-2] - self.used < new:
            self.relayout(self.used + new + spare_slots(self.used + new), new)

    def relayout(self, capacity: int, new: int = 1) -> None:
        """The held slots into buffers of ``capacity`` slots, never more than ``limit`` unless the held slots and
        a step of ``new`` tokens need more."""
        held = self.held_positions()
        super().relayout(max(min(capacity, self.limit), self.used + new))
        self.positions = held.new_full((*held.shape[:2], self.keys.shape[-2]), -1)
        self.positions[..., : self.used] = held

    def compact(self, indices: torch.Tensor, slot_valid: torch.Tensor) -> None:
        """Keep the slots ``indices [b, h, n]`` (ascending per head; ``slot_valid [b, n]`` marks filler) at the
        front of the buffers, in place; the rest becomes room (before the first step: kept as ``keep`` does)."""
        if self.cursor is None:
            self.keep(indices, slot_valid)
            return
        n = indices.shape[-1]
        for buffer in (self.keys, self.values):
            buffer[:, :, :n].copy_(gather_tokens(buffer, indices))
        cursor, valid = self.stepping()
        positions = cast(torch.Tensor, self.positions)  # this layout's relayout sets them with the cursor
        kept = positions.gather(2, indices).masked_fill(~slot_valid[:, None, :], -1)
        positions[..., :n].copy_(kept)
        positions[..., n:] = -1
        valid[:, :n].copy_(slot_valid)
        valid[:, n:] = False
        cursor.fill_(n)
        self.used = n
        if self.keys.shape[-2] > self.limit:  # a turn longer than the room grew the buffers: back to the limit
            self.relayout(self.limit)
