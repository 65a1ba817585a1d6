"""Prompt compression (SnapKV, StreamingLLM, H2O): at the end of prefill each layer keeps, per KV
head, the prompt positions its method scores highest; decoding then appends to that cache.

``PromptMethod`` adds how a budget is spread, the same way for every scorer:

* ``layers="pyramid"`` (PyramidKV, Cai et al., 2024): layer budgets fall linearly from the first
  layer to the last (``budget / pyramid_beta``), averaging the uniform budget;
* ``heads="adaptive"`` (Ada-KV, Feng et al., 2024): the part of a layer's total budget not pinned
  by the method (window, sinks, recent tokens) goes to its heads by where the highest scores over
  all its heads together fall, mixed with the uniform share by ``head_floor`` (Ada-KV's safeguard).
  Heads then hold different numbers of tokens, stored packed (``packed.PackedSlots``), so the short
  heads really free their memory.
* ``layers="global"`` (KVzip's selection): each row's budget over all layers and heads goes where the
  highest scores of all of them together fall; each layer's part is then shared by its heads as above.
  Every layer then holds its whole prompt until the last is scored (after KVzip's observation pass; for a
  method scoring from the prefill, to the end of the model's call that fed the prompt), so the prefill's
  peak is the full cache's.

* ``kv_bytes`` (a byte budget): a share of the prompt's 16-bit cache's bytes, spent by importance: which tokens
  each layer keeps and in which precision, every layer's scores at hand (``byte_budget.allocate``).

The total kept per layer always equals the uniform budget's (with ``layers="global"``, the total
over the layers, up to rounding), so comparisons are at equal memory; with ``kv_bytes``, the bytes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, cast

import torch

from ..cache.errors import CacheMisuseError
from ..cache.held import hold
from ..cache.intake import ObservationPass
from ..cache.layer import KVLayer
from ..cache.policy import LayerPolicy, present
from ..storage.attention import scoring_sinks
from ..storage.codec import KVCodec, make_kv_codec, restored_pair
from ..storage.packed import PackedSlots
from ..storage.slots import BoundedSlots, DenseSlots
from .base import (
    BudgetMethod,
    InvalidParameterError,
    batch_prompt_tokens,
    field_defaults,
    param,
    require,
    require_with,
)
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
from .selection import allocate_heads, global_shares, pyramid_budgets, select_kept

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class PromptMethod(BudgetMethod):
    """A method that keeps each KV head's best prompt positions: how many (``kept_tokens``) and which (``scores``)."""

    quiet_fields: ClassVar[tuple[str, ...]] = ("heads", "head_floor", "layers", "layer_floor", "pyramid_beta", "every",
                                               "decode_window")
    heads: str = param(
        "uniform", "how a layer's budget is shared by its KV heads: uniform, or adaptive (Ada-KV: by their scores)",
        choices=("uniform", "adaptive"))
    head_floor: float = param(
        0.2,
        "with heads=adaptive: the weight of the uniform share in each head's budget, so every head keeps at least this "
        "share (Ada-KV's safeguard)",
        minimum=0, at_most=1)
    layers: str = param(
        "uniform",
        "how the budget is shared by the layers: uniform; pyramid (PyramidKV: more in lower layers); global (all "
        "layers' scores ranked together, per head; every layer holds its prompt until all are scored)",
        choices=("uniform", "pyramid", "global")
    )
    layer_floor: float = param(
        0.0,
        "with layers=global: the weight of the uniform share in each layer's budget, so every layer keeps at least "
        "this share (a model with few compressed layers starves the one whose scores are flattest without it)",
        minimum=0, at_most=1)
    pyramid_beta: float = param(20.0, "with layers=pyramid: the last layer keeps budget / pyramid_beta", above=1)
    decode_budget: int | None = param(
        None, "a bound while decoding: tokens per KV head each layer keeps of prompt and answer together, re-selected "
        "by the method's scores once a row holds decode_budget + every (None: the answer's KV grows)", minimum=1,
        kw_only=True)
    every: int = param(64, "with decode_budget: tokens a row may add beyond it before the next re-selection",
                       minimum=1, kw_only=True)
    decode_window: int | None = param(
        None, "with decode_budget: the last steps whose queries vote and whose tokens are always kept (default: "
        "SnapKV's window, else 32)", minimum=1, kw_only=True)
    kv_bytes: float | None = param(
        None, "a byte budget instead of a token budget: this share of the prompt's 16-bit cache's bytes, spent by "
        "the method's scores on which tokens each layer keeps (per head with heads=adaptive) and in which precision "
        "(16, 8, k6v4 or 4 bits), each layer's coding error measured on the prompt (e.g. 0.015625 for 1/64)",
        above=0, at_most=1, kw_only=True)

    def validate(self) -> None:
        super().validate()
        self._check_byte_budget()
        require(self.layers != "pyramid" or self.ratio is None,
                f"{type(self).__name__}: layers='pyramid' needs a fixed budget, not ratio")
        require_with(self, "head_floor", self.heads == "adaptive" or self.layers == "global",  # (both pack per head)
                     "heads='adaptive' or layers='global'", "--heads adaptive or --layers global")
        require_with(self, "pyramid_beta", self.layers == "pyramid", "layers='pyramid'", "--layers pyramid")
        require_with(self, "layer_floor", self.layers == "global", "layers='global'", "--layers global")
        for name in ("every", "decode_window"):
            require_with(self, name, self.decode_budget is not None, "decode_budget", "--decode-budget")
        if self.decode_budget is not None:
            self._check_decode_bound()

    def _check_byte_budget(self) -> None:
        if self.kv_bytes is None:
            return
        defaults = field_defaults(type(self))
        others = ("budget", "ratio", "kv_bits", "key_bits", "kv_format", "layers", "decode_budget")
        given = [f"{name}={getattr(self, name)!r}" for name in others if getattr(self, name) != defaults[name]]
        require(not given,
                f"{type(self).__name__}: kv_bytes={self.kv_bytes} chooses the kept tokens, their precision and each "
                f"layer's and head's share itself; it does not combine with {', '.join(given)}; valid: kv_bytes "
                "alone, or a token budget without it")

    def _check_decode_bound(self) -> None:
        owner = type(self).__name__
        require(type(self).decode_scores is not PromptMethod.decode_scores,
                f"{owner}: decode_budget={self.decode_budget} needs scores of the answer's tokens, which {owner} does "
                "not define (it scores from its observation pass); valid: SnapKV, H2O, StreamingLLM, "
                "ExpectedAttention")
        require(self.heads == "uniform" and self.layers != "global",
                f"{owner}: decode_budget={self.decode_budget} re-selects a uniform count per head; it does not combine "
                f"with heads={self.heads!r}, layers={self.layers!r} (valid: heads='uniform', layers 'uniform' or "
                "'pyramid')")
        pinned, bound = self.decode_reserved(), cast(int, self.decode_budget)  # (validate's caller checked it)
        require(bound > pinned,
                f"{owner}: decode_budget={self.decode_budget} must be greater than the {pinned} tokens every "
                f"re-selection keeps whole (its decode_window and the method's reserved tokens); valid: decode_budget "
                f"> {pinned}")

    def kept_tokens(self, lengths: torch.Tensor, share: float | torch.Tensor = 1.0) -> torch.Tensor:
        """The budget, in one place: prompt tokens each row of a layer keeps per KV head, for real prompt lengths
        ``lengths [b]``. From the fields: ``budget`` tokens, or ``ceil(ratio * length)`` (never fewer than the
        tokens the method always keeps, ``reserved_tokens``: a window, sinks, recent tokens). A layer's ``share``
        then scales what the method may choose beyond the reserved tokens: a float is its part of the budget
        (``layers="pyramid"``: ``pyramid_budgets``; 1.0 uniform), a tensor ``[b]`` its part of each row's count
        (``layers="global"``: ``global_shares``). Never more than a row has, never fewer than one. How a layer's
        count is then shared by its KV heads is by their scores (``heads="adaptive"``: ``allocate_heads``)."""
        reserved = self.reserved_tokens()
        counts = self.token_budgets(lengths, floor=max(1, reserved))  # (the one budget rule every method shares)
        if isinstance(share, float) and share == 1.0:
            return counts
        # pyramid: a share of the budget itself, then capped by each prompt (a prompt under its layer's budget stays
        # whole); global: a share of what each row keeps
        shared = torch.full_like(counts, self.budget_tokens) if isinstance(share, float) else counts
        scaled = reserved + torch.ceil((shared - reserved).clamp(min=0).double() * share).long()
        return torch.minimum(scaled.clamp(min=1), lengths)

    def settings(self) -> dict[str, Any]:
        values = super().settings()
        if self.kv_bytes is not None:
            values.pop("budget", None)  # (no token budget: the bytes choose the tokens)
        return values

    def kv_codec(self) -> str | None:
        return "mixed" if self.kv_bytes is not None else super().kv_codec()  # (each layer's: its plan's)

    def storage_codec(self, head_dim: int, dtype: torch.dtype, turned: bool | None = None) -> KVCodec | None:
        return None if self.kv_bytes is not None else super().storage_codec(head_dim, dtype, turned)

    @property
    def packs_heads(self) -> bool:
        """Whether the heads of a layer keep different counts, stored packed (``packed.PackedSlots``)."""
        return self.heads == "adaptive" or (self.layers == "global" and self.kv_bytes is None)

    def attends_slots(self) -> bool:
        return not self.packs_heads

    def summarize(self, totals: dict[str, Any]) -> dict[str, Any]:
        if self.kv_bytes is not None:  # the held tokens' device bytes (ByteBudgetPolicy.stats) per 16-bit byte
            held = totals.get("kv_bytes_held")  # (None: every layer a sliding window's, none the budget's)
            return {} if held is None else {"kv_bytes_share": held / totals["kv_bytes_16bit"]}
        if self.decode_budget is None:
            return {}
        layers = totals.get("bounded_layers", 0)
        per_layer = totals.get("reselections", 0) / max(1, layers)  # (pyramid budgets: layers re-select apart)
        return {"reselections": int(per_layer) if per_layer.is_integer() else round(per_layer, 2),
                "reselect_s": totals.get("reselect_s", 0.0)}  # (reselections: per layer, the mean; seconds: summed)

    def reserved_tokens(self) -> int:
        """Tokens every row keeps whatever the scores (a window, sinks, recent tokens): layer budgets
        share out only the rest, as PyramidKV does with SnapKV's window."""
        return 0

    @property
    def decode_window_tokens(self) -> int:
        """The last steps whose queries score a re-selection under ``decode_budget``, their tokens kept whole."""
        return self.decode_window if self.decode_window is not None else 32

    def decode_reserved(self) -> int:
        """Tokens every re-selection under ``decode_budget`` keeps whatever the scores."""
        return max(self.decode_window_tokens, self.reserved_tokens())

    def decode_scores(self, policy: BoundedPolicy, held: HeldTokens, query: torch.Tensor,
                      scaling: float) -> torch.Tensor:
        """Scores ``[b, kv_heads, n]`` of the ``held`` tokens (prompt kept and answer, in order) when a layer under
        ``decode_budget`` re-selects, from ``query [b, q_heads, decode_window, d]``, the last steps' queries (whose
        tokens are the last held ones, kept whatever the scores). A method that scores while decoding defines it."""
        raise NotImplementedError(f"{type(self).__name__} has no scores while decoding")

    def layer_scores(self, layer: KVLayer, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Scores of one layer's prompt: ``scores`` of its keys by default. A method that needs more of
        the layer (its rotary module, what its observation pass saw) overrides this."""
        return self.scores(query, layer.keys, layer.slot_validity(), scaling, layer.spans)

    def observe(
        self, seen: torch.Tensor | None, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, prompt: int,
        scaling: float, lse: torch.Tensor, context: torch.Tensor
    ) -> torch.Tensor:
        """What a method with an ``observation`` pass keeps from one step of it, ``[b, kv_heads, prompt]``,
        merged with what earlier steps left (``seen``); see ``LayerPolicy.observe`` for the arguments."""
        raise NotImplementedError(f"{type(self).__name__} has no observation pass")

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        share = 1.0
        if self.layers == "pyramid":
            layers = model.config.get_text_config().num_hidden_layers
            free = self.budget_tokens - self.reserved_tokens()
            share = pyramid_budgets(free, layers, self.pyramid_beta)[layer_idx] / free
        if self.decode_budget is not None:
            bounded = BoundedPolicy(self, share)
            return KVLayer(layer_idx, bounded, BoundedSlots(bounded.bound + self.every))
        if self.kv_bytes is not None:
            return KVLayer(layer_idx, ByteBudgetPolicy(self))
        return KVLayer(layer_idx, (HeadAdaptivePolicy if self.packs_heads else EvictionPolicy)(self, share))

    def compresses_together(self) -> bool:
        return super().compresses_together() or self.layers == "global" or self.kv_bytes is not None

    def before_compress(self, layers: list[KVLayer]) -> None:
        """``layers="global"``: each layer's share of every row's budget (``global_shares``) from the
        scores it will compress with; ``kv_bytes``: each layer's plan (``plan_bytes``)."""
        if self.kv_bytes is not None and layers:
            return self.plan_bytes(layers)  # (the bytes choose each layer's share: a global ranking stays out)
        if self.layers != "global" or not layers:
            return
        own = [cast(EvictionPolicy, layer.policy) for layer in layers]  # a prompt method's policies
        prompt_tokens = layers[0].held_prompt()[0]
        counts = self.kept_tokens(prompt_tokens)
        if not bool((prompt_tokens.to(counts.device) > counts).any()):
            return  # every row is kept whole: nothing to rank (a prompt shorter than SnapKV's window is not scored)
        records = [cast(ObservationPass, layer.observation).record for layer in layers]  # (compression is next)
        scores = [policy.prompt_scores(record.query, record.scaling) for policy, record in zip(own, records)]
        free = counts - self.reserved_tokens()
        for policy, share in zip(own, global_shares(scores, layers[0].slot_validity(), free)):
            policy.share = self.layer_floor + (1 - self.layer_floor) * share  # the shares still sum to the layers


    def plan_bytes(self, layers: list[KVLayer]) -> None:
        """``kv_bytes``: every layer's kept positions and codec for the prompt (``byte_budget.allocate``), handed to
        its policy (one prompt: a layer's storage holds one codec for all its rows)."""
        valid = layers[0].slot_validity()
        if valid.shape[0] != 1:
            raise InvalidParameterError(
                f"{type(self).__name__}: kv_bytes={self.kv_bytes} chooses each layer's precision for one prompt, got "
                f"a batch of {valid.shape[0]}; valid: one prompt at a time")
        real, first = valid[0], layers[0]
        heads, dim = first.keys.shape[1], first.keys.shape[-1]
        budget = float(self.kv_bytes or 0) * int(real.sum()) * heads * 2 * dim * SIXTEEN_BIT * len(layers)
        scored = []
        for layer in layers:
            record = cast(ObservationPass, layer.observation).record  # (compression is next)
            policy = cast(ByteBudgetPolicy, layer.policy)
            scores = policy.prompt_scores(record.query, record.scaling)[0][:, real]
            keys, values = layer.keys[0][:, real], layer.values[0][:, real]
            probe = keys[:, -PROBE_QUERIES:] if record.query is None else record.query[0][:, -PROBE_QUERIES:]
            scored.append(LayerScores(scores, keys, values, probe, record.scaling))
        plans = allocate(scored, budget, dim, first.keys.dtype, self.codes_turned, not self.packs_heads)
        for layer, plan in zip(layers, plans):
            cast(ByteBudgetPolicy, layer.policy).plan = plan


class EvictionPolicy(LayerPolicy):
    """Each row keeps, per KV head, its ``kept_tokens`` highest-scoring prompt tokens (with the layer's ``share``
    of the budget); decoding then appends to that fixed-size cache."""

    SAVED_AS = "EvictionLayer"  # the layer kind files record (docs/file-format.md)

    share: float | torch.Tensor = hold(rows=False)  # of the budget; per row [b] with layers="global"

    def __init__(self, method: PromptMethod, share: float = 1.0) -> None:
        super().__init__()
        self.method = method
        self.share = share

    def counts(self) -> tuple[torch.Tensor, int] | None:
        """Tokens each row keeps per KV head in this layer and the slots the batch needs for them (its
        largest count; a group of a batch prefilled in groups takes the whole batch's), or None when no
        row of the batch is over its count."""
        lengths = batch_prompt_tokens(self.layer)  # (a float share here: a layer of per-row shares packs, below)
        kept = self.method.kept_tokens(torch.cat([lengths, self.layer.prompt_tokens.to(lengths.device)]), self.share)
        everyone, own = kept[: len(lengths)], kept[len(lengths) :]
        if bool((everyone >= lengths).all()):
            return None
        return own, int(everyone.max())

    def queries_needed(self) -> int | None:
        return self.method.queries_needed()

    def prompt_scores(self, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        with scoring_sinks(self.layer.sinks):  # a model's learned sinks take their share of the scorer's softmax
            return self.method.layer_scores(self.layer, query, scaling)

    def observe(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, lse: torch.Tensor,
                context: torch.Tensor) -> None:
        observation = self.layer.observation
        observation.seen = self.method.observe(observation.seen, query, keys, valid, self.layer.prefill_len, scaling,
                                               lse, context)

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
        counts = self.method.kept_tokens(self.layer.prompt_tokens, self.share)  # this group's rows: every row packs
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
    """``kv_bytes``: the layer keeps the positions the method's ``plan_bytes`` chose for it (the same count per head,
    dense; ``heads="adaptive"``: each head its own, packed), stored with the codec it chose (the layer's, from
    compression on)."""

    def __init__(self, method: PromptMethod, share: float = 1.0) -> None:
        super().__init__(method, share)
        self.plan: LayerPlan | None = None  # set by the method once every layer is scored, read by compress

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        if self.plan is None:
            raise CacheMisuseError("kvcompress: a kv_bytes layer compressed before its method planned the bytes")
        plan, self.plan = self.plan, None
        real, keys = self.layer.slot_validity()[0], self.layer.keys
        keep = torch.zeros_like(real)[None, None].expand(1, plan.keep.shape[0], -1).clone()
        keep[0][:, real] = plan.keep
        self.layer.kv_codec = None if plan.codec is None else make_kv_codec(
            plan.codec, keys.shape[-1], keys.dtype, self.method.codes_turned)
        if self.method.packs_heads:
            return self.pack(keep)
        counts = keep.sum(-1)
        if bool((counts != counts[0, 0]).any()):  # (a method pins as many positions in every head)
            raise CacheMisuseError(f"kvcompress: kv_bytes planned {counts.tolist()} tokens per head of layer "
                                   f"{self.layer.layer_idx}, which keeps one count for every head")
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


class BoundedPolicy(EvictionPolicy):
    """A prompt method's policy under a decoding bound (``decode_budget``, ``every``): the prompt is compressed as
    ``EvictionPolicy`` does; then, before a step would make a row hold more than ``decode_budget + every`` tokens,
    that row keeps ``decode_budget`` of its prompt and answer tokens by the method's ``decode_scores`` (the last
    ``decode_window`` steps' queries vote, as SnapKV's observation window does at the prompt's end, and their own
    tokens stay), compacted to the front of the same buffers (``BoundedSlots``), so the device never holds more than
    the bound and a compiled step keeps its graph (the re-selection runs between steps, never inside one). Each row
    re-selects on its own count, so a row of a batch does exactly as it would alone."""

    SAVED_AS = "BoundedLayer"  # the layer kind files record (docs/file-format.md)

    window_queries: torch.Tensor | None = hold(rows=True, counted=True)  # [b, q_heads, W, d]: the last W queries
    next_position: torch.Tensor | None = hold(rows=True)  # [b]: the position of each row's next token
    held_real: torch.Tensor | None = hold(rows=True)  # [b], host: real tokens each row holds (a finished row: fewer)
    scaling: float | None = hold()
    reselections: int = hold(join=max, default=0)
    reselect_s: float = hold(join=max, default=0.0)

    def __init__(self, method: PromptMethod, share: float = 1.0) -> None:
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
        next_position, positions, window_queries = present(self.next_position, self.slots.positions,
                                                           self.window_queries)
        note_step_positions(self.slots, next_position, positions, new)
        window = window_queries.shape[-2]
        latest = query[..., -window:, :] if new >= window else torch.cat([window_queries[..., new:, :], query], dim=2)
        window_queries.copy_(latest)

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions still held per head, ascending; -1 for slots of answer tokens and filler."""
        if self.slots.cursor is None:
            return super().kept_positions()
        return prompt_positions_held(self.slots.held_positions(), self.layer.prompt_tokens)

    def stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {**stats, "reselections": self.reselections, "reselect_s": self.reselect_s,
                "bounded_layers": 1}

    def info(self) -> dict[str, Any]:
        return {"decode_bound": self.slots.limit}
