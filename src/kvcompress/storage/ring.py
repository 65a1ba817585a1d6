"""``RingSlots``: a sliding window's slots, a ring (the token of logical index ``t`` in slot ``t % capacity``): the
layout of every sliding-window layer, whatever the method."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .dense import DenseSlots
from .slots import on_device, spare_slots


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
