"""``DenseSlots``: a layer's keys and values as ``[batch, kv_heads, slots, head_dim]`` buffers with spare room at the
end, every KV head the same slots. The prompt is held as the prefill computed it until the first later step moves it
into buffers of a fixed capacity, after which a step writes at ``cursor`` (a device tensor) and keeps every shape; a
layer that keeps some of its prompt's tokens (``keep``) keeps them here, in order (slots.py: the interface)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch

from .attention import causal_slot_mask, dense_attention, hands_codes
from .codec import (
    KVCodec,
    attended_pair,
    coded_rows,
    decoded_pair,
    encoded_pair,
    kv_from_spec,
    restored_pair,
    token_bytes,
)
from .slots import Slots, SlotView, capacity_bucket, on_device, spare_slots
from .tensors import gather_rows, gather_tokens, nbytes, prompt_positions


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
        # a decoding step may read coded rows as stored (decode_kernel.decode_attention)
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
