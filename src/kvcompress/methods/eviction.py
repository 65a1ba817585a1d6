"""A prompt method's layer policies at the end of the prompt: ``EvictionPolicy`` keeps each KV head's best positions
(the same count per head), ``HeadAdaptivePolicy`` a count of its own per head, packed (Ada-KV), and
``ByteBudgetPolicy`` the positions and precision a byte budget planned for the layer (``plan_bytes``). They read their
method through ``KeepsPrompt`` (what ``prompt.PromptMethod`` offers them), so the method's module sits above them."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, cast

import torch

from ..cache.errors import CacheMisuseError
from ..cache.held import hold
from ..cache.intake import ObservationPass
from ..cache.layer import KVLayer
from ..cache.policy import LayerPolicy, ScoredLayer
from ..storage.attention import scoring_sinks
from ..storage.codec import make_kv_codec
from ..storage.dense import DenseSlots
from ..storage.packed import PackedSlots
from .base import batch_prompt_tokens
from .byte_budget import (
    PACKED_BYTES,
    POSITION_BYTES,
    PROBE_QUERIES,
    SIXTEEN_BIT,
    LayerPlan,
    LayerScores,
    allocate,
    packing_bytes,
)
from .fields import InvalidParameterError
from .selection import allocate_heads, select_kept


class KeepsPrompt(Protocol):
    """What the policies of a method that keeps prompt positions read of it (``prompt.PromptMethod``'s fields and
    rules; the scorer's ``layer_scores`` and ``observe``)."""

    codes_turned: ClassVar[bool]
    head_floor: float
    kv_bytes: float | None

    @property
    def packs_heads(self) -> bool: ...

    def kept_tokens(self, lengths: torch.Tensor, share: float | torch.Tensor = 1.0) -> torch.Tensor: ...

    def queries_needed(self) -> int | None: ...

    def layer_scores(self, layer: ScoredLayer, query: torch.Tensor | None, scaling: float) -> torch.Tensor: ...

    def observe(
        self,
        seen: torch.Tensor | None,
        query: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        prompt: int,
        scaling: float,
        lse: torch.Tensor,
        context: torch.Tensor,
    ) -> torch.Tensor: ...


class EvictionPolicy(LayerPolicy):
    """Each row keeps, per KV head, its ``kept_tokens`` highest-scoring prompt tokens (with the layer's ``share``
    of the budget); decoding then appends to that fixed-size cache."""

    SAVED_AS = "EvictionLayer"  # the layer kind files record (docs/file-format.md)

    share: float | torch.Tensor = hold(rows=False)  # of the budget; per row [b] with layers="global"

    def __init__(self, method: KeepsPrompt, share: float = 1.0) -> None:
        super().__init__()
        self.method = method
        self.share = share

    def counts(self) -> tuple[torch.Tensor, int] | None:
        """Tokens each row keeps per KV head in this layer and the slots the batch needs for them (its
        largest count; a group of a batch prefilled in groups takes the whole batch's), or None when no
        row of the batch is over its count."""
        lengths = batch_prompt_tokens(self.layer)  # (a float share here: a layer of per-row shares packs, below)
        kept = self.method.kept_tokens(torch.cat([lengths, self.layer.held_prompt()[0].to(lengths.device)]), self.share)
        everyone, own = kept[: len(lengths)], kept[len(lengths) :]
        if bool((everyone >= lengths).all()):
            return None
        return own, int(everyone.max())

    def queries_needed(self) -> int | None:
        return self.method.queries_needed()

    def prompt_scores(self, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        with scoring_sinks(self.layer.sinks):  # a model's learned sinks take their share of the scorer's softmax
            return self.method.layer_scores(self.layer, query, scaling)

    def observe(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        lse: torch.Tensor,
        context: torch.Tensor,
    ) -> None:
        observation = self.layer.observation
        if observation is None:  # (the layer's phase, OBSERVING, holds one)
            raise CacheMisuseError("kvcompress: an observation step came to a layer that awaits no pass")
        prompt = self.layer.held_prompt()[1]
        observation.seen = self.method.observe(observation.seen, query, keys, valid, prompt, scaling, lse, context)

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        self.keep_top(lambda: self.prompt_scores(query, scaling))

    def keep_top(self, scores) -> torch.Tensor | None:
        """Keep each row's best positions by ``scores()`` (computed only when some row is over its
        count); returns the kept slots ``[b, kv_heads, n]``, or None if nothing was dropped."""
        kept = self.counts()
        if kept is None:
            return None
        indices, slot_valid = select_kept(scores(), self.layer.slot_validity(), *kept)
        cast(DenseSlots, self.slots).keep(indices, slot_valid)
        return indices


class HeadAdaptivePolicy(EvictionPolicy):
    """Ada-KV: the layer's budget shared by its KV heads by score; once compressed, its storage is a
    packing (``packed.PackedSlots``), each head's tokens in a segment of its own length."""

    SAVED_AS = "HeadAdaptiveLayer"  # the layer kind files record (docs/file-format.md)

    LAYOUTS = (PackedSlots,)

    def counts(self) -> tuple[torch.Tensor, int] | None:
        if isinstance(self.share, float):
            return super().counts()
        counts = self.method.kept_tokens(self.layer.held_prompt()[0], self.share)  # this group's rows: every row packs
        return counts, int(counts.max())

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        kept = self.counts()
        if kept is None:
            return
        valid = self.layer.slot_validity()
        self.pack(allocate_heads(self.prompt_scores(query, scaling), valid, kept[0], self.method.head_floor))

    def pack(self, keep: torch.Tensor) -> None:
        """Keep the positions ``keep [b, kv_heads, slots]`` marks, each (row, head) in a segment of its own."""
        # [b, h, slots]: the slots' prompt positions (a thinned context's are not in order)
        positions = self.kept_positions()
        keys, values = self.layer.keys, self.layer.values
        segments: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        for row in range(keep.shape[0]):
            segments.append([])
            for head in range(keep.shape[1]):
                slots = keep[row, head].nonzero()[:, 0]
                segments[row].append((keys[row, head, slots], values[row, head, slots], positions[row, head, slots]))
        self.layer.slots = PackedSlots(segments, self.slots.seen)  # the dense slots (the prompt's KV) are freed

    @property
    def packed(self) -> PackedSlots | None:
        """The packing, once the layer compressed (None: the dense slots hold the prompt, under budget)."""
        return self.slots if isinstance(self.slots, PackedSlots) else None


class ByteBudgetPolicy(HeadAdaptivePolicy):
    """``kv_bytes``: the layer keeps the positions ``plan_bytes`` chose for it (the same count per head,
    dense; ``heads="adaptive"``: each head its own, packed), stored with the codec it chose (the layer's, from
    compression on)."""

    def __init__(self, method: KeepsPrompt, share: float = 1.0) -> None:
        super().__init__(method, share)
        self.plan: LayerPlan | None = None  # set by the method once every layer is scored, read by compress

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        if self.plan is None:
            raise CacheMisuseError("kvcompress: a kv_bytes layer compressed before its method planned the bytes")
        plan, self.plan = self.plan, None
        real, keys = self.layer.slot_validity()[0], self.layer.keys
        keep = torch.zeros_like(real)[None, None].expand(1, plan.keep.shape[0], -1).clone()
        keep[0][:, real] = plan.keep
        self.layer.kv_codec = (
            None
            if plan.codec is None
            else make_kv_codec(plan.codec, keys.shape[-1], keys.dtype, self.method.codes_turned)
        )
        if self.method.packs_heads:
            return self.pack(keep)
        counts = keep.sum(-1)
        if bool((counts != counts[0, 0]).any()):  # (a method pins as many positions in every head)
            raise CacheMisuseError(
                f"kvcompress: kv_bytes planned {counts.tolist()} tokens per head of layer "
                f"{self.layer.layer_idx}, which keeps one count for every head"
            )
        slots = torch.arange(keep.shape[-1], device=keep.device).expand_as(keep)
        indices = slots[keep].view(1, keep.shape[1], -1)
        cast(DenseSlots, self.slots).keep(indices, torch.ones_like(indices[:, 0], dtype=torch.bool))

    def info(self) -> dict[str, Any]:
        return {"kv_layer_precisions": self.layer.kv_codec.name if self.layer.kv_codec else "16"}

    def stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The held tokens' bytes as the plan counts them (rows and positions, and a packing's own; the room for
        later tokens aside) and the 16-bit cache's (``kv_bytes_full`` counts the model's precision)."""
        packed, size = self.packed, cast(torch.dtype, self.layer.dtype).itemsize
        if packed is None:
            slots = cast(DenseSlots, self.slots)
            index = slots.keys.shape[0] * slots.keys.shape[1] * slots.used * POSITION_BYTES
        else:
            tokens = sum(map(sum, packed.lengths))
            index = tokens * (POSITION_BYTES + PACKED_BYTES) + packed.rows * packing_bytes(packed.heads)
        held = stats["kv_bytes_kept"] + index
        return {**stats, "kv_bytes_held": held, "kv_bytes_16bit": stats["kv_bytes_full"] * SIXTEEN_BIT // size}


def plan_bytes(method: KeepsPrompt, layers: list[KVLayer]) -> None:
    """``kv_bytes``: every layer's kept positions and codec for the prompt (``byte_budget.allocate``), handed to
    its ``ByteBudgetPolicy`` (one prompt: a layer's storage holds one codec for all its rows)."""
    valid = layers[0].slot_validity()
    if valid.shape[0] != 1:
        raise InvalidParameterError(
            "{owner}: {kv_bytes=} chooses each layer's precision for one prompt, got a batch of {rows}; valid: one "
            "prompt at a time",
            owner=type(method).__name__,
            kv_bytes=method.kv_bytes,
            rows=valid.shape[0],
        )
    real, first = valid[0], layers[0]
    heads, dim = first.keys.shape[1], first.keys.shape[-1]
    budget = float(method.kv_bytes or 0) * int(real.sum()) * heads * 2 * dim * SIXTEEN_BIT * len(layers)
    scored = []
    for layer in layers:
        record = cast(ObservationPass, layer.observation).record  # (compression is next)
        policy = cast(ByteBudgetPolicy, layer.policy)
        scores = policy.prompt_scores(record.query, record.scaling)[0][:, real]
        keys, values = layer.keys[0][:, real], layer.values[0][:, real]
        probe = keys[:, -PROBE_QUERIES:] if record.query is None else record.query[0][:, -PROBE_QUERIES:]
        scored.append(LayerScores(scores, keys, values, probe, record.scaling))
    plans = allocate(scored, budget, dim, first.keys.dtype, method.codes_turned, not method.packs_heads)
    for layer, plan in zip(layers, plans):
        cast(ByteBudgetPolicy, layer.policy).plan = plan
