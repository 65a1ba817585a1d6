"""Dense slots with a limit while decoding: ``CappedSlots`` hold at most ``limit`` tokens after each step (a layer that
evicts while decoding keeps its best at the front, per-slot annotations moved along), ``BoundedSlots`` never grow past
``limit`` (the layer compacts what it re-selects to the front, in place: a decoding bound for every prompt method)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from .dense import DenseSlots
from .slots import Slots, on_device, spare_slots
from .tensors import gather_tokens


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
