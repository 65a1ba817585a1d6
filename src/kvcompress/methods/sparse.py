"""Sparse decoding (ShadowKV, Quest, Loki): nothing is dropped; each decoding step attends exactly to
the prompt chunks a method selects for it, plus the dense slots.

At the end of prefill, each row's first ``n`` whole chunks of ``unit`` tokens (counted from the
row's own first token, so a row in a batch is chunked exactly as it would be alone) form the
*region*: the method builds its selection index from the region's keys (``prepare``), and the
region goes to a ``ChunkStore`` (on the device, or offloaded to host memory). The row's remaining
tokens stay dense, together with any chunks the method wants kept dense (ShadowKV's outliers) and
everything generated later. Each step the method scores the chunks (``chunk_scores``), the top
``budget / unit`` selectable chunks of each row are gathered (from the previous step's buffer when
they were selected then too, if the store is offloaded), and attention runs exactly over
[selected chunks; dense slots].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from ..cache.errors import CacheMisuseError
from ..cache.held import counted_bytes, hold
from ..cache.policy import LayerPolicy, present
from ..storage.attention import dense_attention
from ..storage.codec import attended_pair, token_bytes
from ..storage.dense import DenseSlots
from ..storage.offload import ChunkStore
from ..storage.tensors import chunk_tokens, gather_tokens, prompt_positions
from .base import BudgetMethod, batch_prompt_tokens
from .fields import require, setting


@dataclass
class SparseMethod(BudgetMethod):
    """A method that attends to ``budget`` selected prompt tokens per KV head at every step."""

    default_budget = 2048
    keys_apart = False  # a chunk store codes every stored row, keys and values, with one codec
    codes_turned = False  # a step's front slots take keys gathered or rebuilt in the model's basis
    unit_setting: ClassVar[tuple[str, str] | None] = None  # (field, word) of the selection unit, when it is a setting

    def attends_slots(self) -> bool:
        return False  # each step gathers the chunks it selects

    def validate(self) -> None:
        super().validate()
        require(
            self.key_bits in (None, self.kv_bits),
            "{owner}: {key_bits=} differs from {kv_bits=}, which its chunk store (one codec for every stored row) "
            "cannot hold; valid: {key_bits=None}",
            owner=type(self).__name__,
            key_bits=self.key_bits,
            kv_bits=self.kv_bits,
        )
        if self.unit_setting is not None and self.ratio is None:
            field, word = self.unit_setting
            size = getattr(self, field)
            require(
                self.budget_tokens >= size,
                "{owner}: {budget=} is smaller than one {word} (" + setting(field) + "); valid: {budget!n} >= {size}",
                owner=type(self).__name__,
                budget=self.budget_tokens,
                word=word,
                size=size,
                **{field: size},
            )

    def step_tokens(self, lengths: torch.Tensor) -> torch.Tensor:
        """Prompt tokens each row attends to per step ``[batch]``."""
        return self.token_budgets(lengths)

    def summarize(self, totals: dict[str, Any]) -> dict[str, Any]:
        lookups, layers = totals.get("chunk_lookups", 0), totals.get("sparse_layers", 0)
        return {
            "selected_tokens_per_step": totals["selected_tokens"] / layers if layers else None,
            "chunk_hit_rate": totals["chunk_hits"] / lookups if lookups and "chunk_hits" in totals else None,
            "fetched_bytes_per_step": totals.get("fetched_bytes_per_step"),
        }


def chunks_as_slots(
    keys: torch.Tensor, values: torch.Tensor, chunks: torch.Tensor, chunk_valid: torch.Tensor, unit: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The region's ``chunks [b, h, k]`` (of ``unit`` tokens; ``chunk_valid [b, k]``) as dense slots: their keys,
    values, validity ``[b, k * unit]`` and positions in the region (-1: filler)."""
    tokens = chunk_tokens(chunks, unit)
    token_valid = chunk_valid.repeat_interleave(unit, dim=-1)
    positions = tokens.masked_fill(~token_valid[:, None, :], -1)
    return gather_tokens(keys, tokens), gather_tokens(values, tokens), token_valid, positions


def dense_slots(
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    lengths: torch.Tensor,
    rest: torch.Tensor,
    tail: int,
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots a sparse layer attends densely: ``kept`` (chunks kept dense, ``chunks_as_slots``), then each row's
    last ``rest [b]`` prompt tokens after its region, in the prompt's last ``tail`` slots (rows of ``lengths [b]``
    tokens, left-padded): keys, values, validity ``[b, n]`` and prompt positions ``[b, h, n]`` (-1: filler)."""
    heads, seq, device = prompt_keys.shape[1], prompt_keys.shape[-2], prompt_keys.device
    tail_valid = torch.arange(tail, device=device)[None, :] >= (tail - rest)[:, None]
    tail_positions = (lengths - tail)[:, None] + torch.arange(tail, device=device)[None, :]
    parts = [
        (
            prompt_keys[:, :, seq - tail :],
            prompt_values[:, :, seq - tail :],
            tail_valid,
            tail_positions.masked_fill(~tail_valid, -1)[:, None, :].expand(-1, heads, -1),
        )
    ]
    if kept is not None:
        parts.insert(0, kept)
    keys, values, valid, positions = (
        torch.cat(column, dim=-2 if i < 2 else -1) for i, column in enumerate(zip(*parts))
    )
    return keys, values, valid, positions


class SparseDecodePolicy(LayerPolicy):
    """The storage and step of every sparse-decoding method; subclasses say how to chunk the prompt,
    what to index and how to score chunks."""

    SAVED_AS = "SparseDecodeLayer"  # the entries every sparse kind has (its subclasses name their own)

    method: SparseMethod
    store: ChunkStore | None = hold(rows=True, kind=ChunkStore)  # region chunks [b, h, n, unit, d'] (stored_chunks)
    selectable: torch.Tensor | None = hold(rows=True, counted=True)  # [b, h, n]: chunk may be selected
    unselectable: torch.Tensor | None = hold(rows=True, counted=True)  # ~selectable, kept for the step
    step_chunks: torch.Tensor | None = hold(rows=True, counted=True)  # [b]: chunks each row selects per step
    selected: torch.Tensor | None = hold(rows=True, counted=True)  # [b, h, k]: last step's (an offload store reuses)
    step_count: int = hold(default=0)  # chunks gathered per step (the largest row's)
    batch_chunks: torch.Tensor | None = hold()  # region chunks of every row of the batch (they set the shapes)
    all_counted: bool = hold(join=all, default=False)  # every gathered chunk counts (the front slots need no mask)
    front: int = hold(default=0)  # slots at the front of the buffers that hold the step's selected chunks
    front_slots: torch.Tensor | None = hold(counted=True)  # [front]: their indices
    hits: torch.Tensor | None = hold(counted=True)  # a device scalar: counted without a host sync
    steps: int = hold(default=0)  # decoding steps taken, and chunk lookups made (stats)
    lookups: int = hold(default=0)

    def __init__(self, method: SparseMethod, unit: int, offload: bool) -> None:
        super().__init__()
        self.method, self.unit, self.offloads = method, unit, offload  # offloads: the store in host memory

    @property
    def slots(self) -> DenseSlots:
        return cast(DenseSlots, self.layer.slots)  # the step's front slots, then the dense tail

    # --- what a method implements ---------------------------------------------------------------------

    def region_chunks(self, lengths: torch.Tensor) -> torch.Tensor:
        """Whole chunks of each row's prompt ``[batch]`` that become selectable (the rest stays dense)."""
        raise NotImplementedError

    def prepare(
        self, keys: torch.Tensor, valid: torch.Tensor, chunks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Build the selection index from the region's keys ``[b, h, n * unit, d]`` (``valid`` per
        token, ``chunks [b]`` real chunks per row). May return a pair: chunk ids ``[b, h, m]`` to keep
        dense instead (never selected) and their validity ``[b, m]``; or None."""
        raise NotImplementedError

    def chunk_scores(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Score of every region chunk for this step's queries ``[b, h, n]`` (higher is attended)."""
        raise NotImplementedError

    def stored_chunks(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What the store holds per chunk ``[b, h, n, unit, d']``: keys and values side by side."""
        batch, heads, _, dim = keys.shape
        return torch.cat([keys, values], dim=-1).view(batch, heads, -1, self.unit, 2 * dim)

    def rebuild_keys(self, chunks: torch.Tensor) -> torch.Tensor | None:
        """Keys of ``chunks [b, h, k]`` computed while their stored chunks are gathered, for methods
        that store values only (ShadowKV); None: the keys are in the store."""
        return None

    def selected_kv(self, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[b, h, k * unit, d]`` of ``chunks [b, h, k]``."""
        gathered, rebuilt = self.gather(chunks, overlap=lambda: self.rebuild_keys(chunks))
        if rebuilt is not None:
            return rebuilt, gathered
        keys, values = gathered.chunk(2, dim=-1)
        return keys, values

    def previous_chunks(self) -> torch.Tensor:
        """Last step's gathered chunks as the store holds them (the front slots; keys and values side by side)."""
        front = slice(0, self.front)
        return torch.cat([self.layer.keys[:, :, front], self.layer.values[:, :, front]], dim=-1)

    # --- the contract ----------------------------------------------------------------------------------

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        prompt_keys, prompt_values, lengths = self.layer.keys, self.layer.values, self.layer.held_prompt()[0]
        heads, seq, device = prompt_keys.shape[1], prompt_keys.shape[-2], prompt_keys.device
        counts = self.region_chunks(lengths).clamp(min=0)
        everyone = batch_prompt_tokens(self.layer)  # the batch's rows set the shapes (a group of them too)
        self.batch_chunks = self.region_chunks(everyone).clamp(min=0)
        n = int(self.batch_chunks.max())
        if n == 0:
            return
        token = torch.arange(n * self.unit, device=device)
        region_valid = token[None, :] < (counts * self.unit)[:, None]  # [b, n * unit]
        slots = ((seq - lengths)[:, None] + token[None, :]).clamp(max=seq - 1)[:, None, :].expand(-1, heads, -1)
        keys = gather_tokens(prompt_keys, slots) * region_valid[:, None, :, None]
        values = gather_tokens(prompt_values, slots) * region_valid[:, None, :, None]
        real_chunks = torch.arange(n, device=device)[None, :] < counts[:, None]
        self.selectable = real_chunks[:, None, :].expand(-1, heads, -1).clone()
        kept_dense = self.prepare(keys, region_valid, counts)

        # Dense slots: the chunks the method keeps dense, then each row's tokens after its region.
        kept = None
        if kept_dense is not None:
            chunks, chunk_valid = kept_dense
            self.selectable.scatter_(-1, chunks, self.selectable.gather(-1, chunks) & ~chunk_valid[:, None, :])
            kept = chunks_as_slots(keys, values, chunks, chunk_valid, self.unit)
        tail = int((everyone - self.batch_chunks * self.unit).max())
        dense_keys, dense_values, valid, positions = dense_slots(
            prompt_keys, prompt_values, lengths, lengths - counts * self.unit, tail, kept
        )
        codec = None if self.layer.kv_codec is None else self.layer.kv_codec.keys  # (one codec for both: validate)
        self.store = ChunkStore(self.stored_chunks(keys, values), self.offloads, codec)
        per_step = torch.div(self.method.step_tokens(lengths), self.unit, rounding_mode="floor").clamp(min=1)
        self.step_chunks = torch.minimum(per_step, counts)
        batch_steps = torch.minimum(
            torch.div(self.method.step_tokens(everyone), self.unit, rounding_mode="floor").clamp(min=1),
            self.batch_chunks,
        )
        self.step_count = int(batch_steps.max())  # chunks gathered per step: a fixed shape
        self.front = self.step_count * self.unit
        self.front_slots = torch.arange(self.front, device=device)
        front = dense_keys.new_zeros(*dense_keys.shape[:2], self.front, dense_keys.shape[-1])
        # per head: from each step's selection
        front_valid = torch.ones(valid.shape[0], self.front, dtype=torch.bool, device=device)
        self.slots.set(
            torch.cat([front, dense_keys], dim=2),
            torch.cat([front, dense_values], dim=2),
            None if bool(valid.all()) else torch.cat([front_valid, valid], dim=1),
            positions,
        )
        self.selected = torch.full((valid.shape[0], heads, self.step_count), -1, device=device)  # no chunk yet
        self.hits = torch.zeros((), dtype=torch.long, device=device)
        self.unselectable = ~self.selectable
        # Every row selects as many chunks as the step gathers, from enough selectable ones: every
        # gathered chunk counts, so the front slots need no mask of their own (checked once, here).
        self.all_counted = bool(
            (self.step_chunks == self.step_count).all() and (self.selectable.sum(-1) >= self.step_count).all()
        )
        self.index_selection(scaling)

    def index_selection(self, scaling: float) -> None:
        """After ``compress``: lay out what ``chunk_scores`` reads each step (``selectable`` is final)."""

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Exact attention over the step's selected chunks, written into the front slots, and the dense slots."""
        if self.store is None:
            return super().attend(query, keys, values, mask, scaling, softcap)
        chosen, counted = self.select(query, scaling)
        selected_keys, selected_values = self.selected_kv(chosen)
        keys, values = attended_pair(self.slots.codec, keys, values)  # the front slots take rows decoded
        front_slots, seen = present(self.front_slots, mask)  # (a step's slots: dense, hence masked)
        keys.index_copy_(2, front_slots, selected_keys)
        values.index_copy_(2, front_slots, selected_values)
        if counted is not None:  # some gathered chunks do not count: the front slots get a mask per head
            front = counted.repeat_interleave(self.unit, dim=-1)[:, :, None, :].expand(-1, -1, seen.shape[2], -1)
            mask = torch.cat([front, seen[..., self.front :].expand(-1, keys.shape[1], -1, -1)], dim=-1)
        return dense_attention(query, keys, values, mask, scaling, softcap)

    def select(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunks this step attends to ``[b, h, k]`` (ascending where an offload store reuses
        them) and which of them count (None: all do): each row takes its own ``step_chunks`` best
        selectable chunks."""
        unselectable, step_chunks = present(self.unselectable, self.step_chunks)
        scores = self.chunk_scores(query, scaling).masked_fill(unselectable, -math.inf)
        top = scores.topk(self.step_count, dim=-1, sorted=not self.all_counted)
        if self.all_counted:
            return (top.indices.sort(dim=-1).values if self.chunk_store().offloaded else top.indices), None
        # by rank
        in_budget = torch.arange(self.step_count, device=scores.device)[None, None, :] < step_chunks[:, None, None]
        chosen, order = top.indices.sort(dim=-1)
        return chosen, (in_budget & (top.values > -math.inf)).gather(-1, order)

    def gather(self, chunks: torch.Tensor, overlap: Callable[[], Any] = lambda: None) -> tuple[torch.Tensor, Any]:
        """The stored ``chunks [b, h, k]`` as ``[b, h, k * unit, d']`` (chunks last step also selected
        come from its front slots when the store is offloaded) and the result of ``overlap()``, which
        runs meanwhile."""
        store = self.chunk_store()
        if not store.offloaded:
            return store.fetch(chunks, None, None, None, overlap)
        selected, hits = present(self.selected, self.hits)
        if store.codec is not None:  # its chunks are held decoded in the front slots: read again, not reused
            gathered, result = store.fetch(chunks, None, None, None, overlap)
        else:
            gathered, result = store.fetch(chunks, selected, self.previous_chunks(), hits, overlap)
        selected.copy_(chunks)
        return gathered, result

    def chunk_store(self) -> ChunkStore:
        """The prompt's chunks once compressed: the decoding phase said once to the type checker."""
        if self.store is None:
            raise CacheMisuseError("kvcompress: a sparse step read its chunk store before its prompt was compressed")
        return self.store

    def advanced(self, new: int) -> None:
        if self.store is not None:
            self.steps += 1
            self.lookups += present(self.selected)[0].numel() if self.store.offloaded else 0

    def kept_positions(self) -> torch.Tensor:
        """Every prompt position: nothing is dropped (padding of shorter rows reported as -1)."""
        if self.store is None:
            return super().kept_positions()
        layer = self.layer
        prompt_tokens, prefill_len = layer.held_prompt()
        real = torch.arange(prefill_len, device=layer.keys.device)[None, :] >= (prefill_len - prompt_tokens)[:, None]
        return prompt_positions(real)[:, None, :].expand(-1, layer.keys.shape[1], -1)

    def prompt_readable(self) -> bool:
        """Not once the prompt is in chunks (its keys rebuilt or paged per step, not slots a question can attend)."""
        return self.store is None

    def stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        if self.store is None:
            return stats
        stats["offloaded_bytes" if self.store.offloaded else "kv_bytes_kept"] += self.store.nbytes
        batch, heads = self.slots.keys.shape[:2]  # as stored: no decoding for a shape
        # the front slots: the step's chunks, copied from the store
        copies = batch * heads * self.front * token_bytes(self.slots.codec, self.slots.keys, self.slots.values)[0]
        stats["kv_bytes_kept"] -= copies
        stats["spare_bytes"] += copies
        per_chunk = self.store.chunk_bytes
        selected_bytes = batch * heads * self.step_count * per_chunk * self.read_factor()
        stats["bytes_read_per_step"] += selected_bytes + counted_bytes(self.layer, index_only=True)
        hits = int(present(self.hits)[0])
        misses = self.lookups - (0 if self.store.reads_hits() else hits)
        stats.update(
            sparse_layers=1,
            selected_tokens=self.step_count * self.unit,
            chunk_hits=hits,
            chunk_lookups=self.lookups,
            fetched_bytes_per_step=misses * per_chunk / self.steps if self.steps else 0,
        )
        return stats

    def info(self) -> dict[str, Any]:
        return {} if self.store is None else {"value_fetch": self.store.mode}

    def uncapturable(self) -> str | None:
        if self.store is not None and self.store.mode == "host-gather":
            return (
                "its offloaded chunks are gathered through the host (no zero-copy view of pinned memory on this "
                "machine)"
            )
        return None

    def read_factor(self) -> float:
        """Bytes read per selected chunk relative to a stored chunk (ShadowKV stores values and
        rebuilds keys of the same size: 2)."""
        return 1.0
