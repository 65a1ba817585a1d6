"""A prompt method's policy under a decoding bound (``decode_budget``): ``BoundedPolicy`` compresses the prompt as
``EvictionPolicy`` does, then re-selects between steps by the method's ``decode_scores`` (``BoundsDecoding``: what
it reads of the method), so the device never holds more than the bound."""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple, Protocol, cast

import torch

from ..cache.held import hold
from ..cache.policy import present
from ..storage.attention import scoring_sinks
from ..storage.capped import BoundedSlots
from ..storage.codec import restored_pair
from ..storage.dense import DenseSlots
from .eviction import EvictionPolicy, KeepsPrompt
from .selection import select_kept


class HeldTokens(NamedTuple):
    """What a layer under a decoding bound holds when it re-selects, in the model's basis: keys and values
    ``[b, h, n, d]``, validity ``[b, n]`` and each slot's position ``[b, h, n]`` (-1: filler), oldest first."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor


def note_step_positions(slots: DenseSlots, next_position: torch.Tensor, positions: torch.Tensor, new: int) -> None:
    """Write the positions of a step's ``new`` tokens (the real ones from ``next_position [b]`` on, -1 for padding)
    into ``positions [b, h, slots]`` at their slots, and move ``next_position`` past them (on the device)."""
    slot = slots.new_slots(new)
    real = slots.stepping()[1].index_select(1, slot)
    position = (next_position[:, None] + real.long().cumsum(-1) - 1).masked_fill(~real, -1)
    next_position.add_(real.sum(-1))
    positions.index_copy_(2, slot, position[:, None].expand(-1, positions.shape[1], -1))


def prompt_positions_held(positions: torch.Tensor, prompt_tokens: torch.Tensor) -> torch.Tensor:
    """Of the positions ``[b, h, n]`` a layer holds, its prompt's (below ``prompt_tokens [b]``), ascending per
    head; -1 for the rest (answer tokens, filler)."""
    return positions.masked_fill(positions >= prompt_tokens[:, None, None], -1).sort(dim=-1).values


class BoundsDecoding(KeepsPrompt, Protocol):
    """What ``BoundedPolicy`` reads of its method beyond ``KeepsPrompt``: the bound and the scores while decoding."""

    decode_budget: int | None

    @property
    def decode_window_tokens(self) -> int: ...

    def decode_reserved(self) -> int: ...

    def decode_scores(
        self, policy: BoundedPolicy, held: HeldTokens, query: torch.Tensor, scaling: float
    ) -> torch.Tensor: ...


class BoundedPolicy(EvictionPolicy):
    """A prompt method's policy under a decoding bound (``decode_budget``, ``every``): the prompt is compressed as
    ``EvictionPolicy`` does; then, before a step would make a row hold more than ``decode_budget + every`` tokens,
    that row keeps ``decode_budget`` of its prompt and answer tokens by the method's ``decode_scores`` (the last
    ``decode_window`` steps' queries vote, as SnapKV's observation window does at the prompt's end, and their own
    tokens stay), compacted to the front of the same buffers (``BoundedSlots``), so the device never holds more than
    the bound and a compiled step keeps its graph (the re-selection runs between steps, never inside one). Each row
    re-selects on its own count, so a row of a batch does exactly as it would alone."""

    SAVED_AS = "BoundedLayer"  # the layer kind files record (docs/file-format.md)

    method: BoundsDecoding

    window_queries: torch.Tensor | None = hold(rows=True, counted=True)  # [b, q_heads, W, d]: the last W queries
    next_position: torch.Tensor | None = hold(rows=True)  # [b]: the position of each row's next token
    held_real: torch.Tensor | None = hold(rows=True)  # [b], host: real tokens each row holds (a finished row: fewer)
    scaling: float | None = hold()
    reselections: int = hold(join=max, default=0)
    reselect_s: float = hold(join=max, default=0.0)

    def __init__(self, method: BoundsDecoding, share: float = 1.0) -> None:
        super().__init__(method, share)
        pinned, bound = method.decode_reserved(), cast(int, method.decode_budget)
        self.bound = pinned + math.ceil((bound - pinned) * share)  # a pyramid's share of what the scores choose

    @property
    def slots(self) -> BoundedSlots:
        return cast(BoundedSlots, self.layer.slots)  # (make_layer gives its layer BoundedSlots at the bound)

    def queries_needed(self) -> int | None:
        needed = self.method.queries_needed()
        return None if needed is None else max(needed, self.method.decode_window_tokens)

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        super().compress(query, scaling)
        window = self.method.decode_window_tokens
        recent = present(query)[0][..., -window:, :]
        missing = window - recent.shape[-2]  # a prompt shorter than the window: zero queries vote evenly
        self.window_queries = torch.nn.functional.pad(recent, (0, 0, missing, 0)).contiguous()
        self.scaling = scaling
        self.next_position = self.layer.held_prompt()[0].clone()
        self.held_real = self.layer.slot_validity().sum(dim=-1).cpu()

    def prepare_step(self, new: int) -> None:
        """Re-select the rows a step of ``new`` tokens would take past the bound (before the buffers are laid out,
        too: a prompt kept over it)."""
        if self.held_real is None:
            return
        if self.held_real.device.type != "cpu":  # loaded from a file or moved: the mirror lives in host memory
            self.held_real = self.held_real.cpu()
        over = self.held_real + new > self.slots.limit
        if bool(over.any()):
            self.reselect(over)

    def reselect(self, over: torch.Tensor) -> None:
        """Rows ``over [b]`` (host) keep ``bound`` of their tokens by the method's scores; the others keep all."""
        start = time.perf_counter()
        held = self.held_tokens()
        window_queries, held_real = present(self.window_queries, self.held_real)
        scaling = cast(float, self.scaling)  # set with the window's queries
        with scoring_sinks(self.layer.sinks):  # a model's learned sinks take their share of the scorer's softmax
            scores = self.method.decode_scores(self, held, window_queries, scaling)
        slot = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(slot >= scores.shape[-1] - window_queries.shape[-2], math.inf)  # the window
        wanted = torch.where(over, torch.full_like(held_real, self.bound), held_real)
        counts = torch.minimum(wanted.to(held.valid.device), held.valid.sum(dim=-1))
        self.slots.compact(*select_kept(scores, held.valid, counts))
        self.held_real = counts.cpu()
        self.reselections += 1
        self.reselect_s += time.perf_counter() - start

    def held_tokens(self) -> HeldTokens:
        """The held slots as the scores read them (decoded, in the model's basis)."""
        slots, used = self.slots, self.slots.used
        keys, values = restored_pair(slots.codec, slots.keys[:, :, :used], slots.values[:, :, :used])
        return HeldTokens(keys, values, slots.slot_validity()[:, :used], slots.held_positions())

    def advanced(self, new: int) -> None:
        if self.held_real is not None:
            self.held_real += new

    def after_step(self, query: torch.Tensor, scaling: float) -> None:
        """The step's positions noted, its queries the newest of the window."""
        new = query.shape[-2]
        next_position, positions, window_queries = present(
            self.next_position, self.slots.positions, self.window_queries
        )
        note_step_positions(self.slots, next_position, positions, new)
        window = window_queries.shape[-2]
        latest = query[..., -window:, :] if new >= window else torch.cat([window_queries[..., new:, :], query], dim=2)
        window_queries.copy_(latest)

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions still held per head, ascending; -1 for slots of answer tokens and filler."""
        if self.slots.cursor is None:
            return super().kept_positions()
        return prompt_positions_held(self.slots.held_positions(), self.layer.held_prompt()[0])

    def stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {**stats, "reselections": self.reselections, "reselect_s": self.reselect_s, "bounded_layers": 1}

    def info(self) -> dict[str, Any]:
        return {"decode_bound": self.slots.limit}
