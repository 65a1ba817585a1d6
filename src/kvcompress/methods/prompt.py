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
* ``layers="global"`` (KVzip's selection, for methods with an observation pass, after which every
  layer still holds its prompt): each row's budget over all layers and heads goes where the highest
  scores of all of them together fall; each layer's part is then shared by its heads as above.

The total kept per layer always equals the uniform budget's (with ``layers="global"``, the total
over the layers, up to rounding), so comparisons are at equal memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from ..cache.held import hold
from ..cache.layer import KVLayer, batch_prompt_tokens
from ..storage.attention import scoring_sinks
from ..storage.packed import PackedSlots
from ..storage.slots import DenseSlots
from .base import BudgetMethod, param, require

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def select_kept(scores: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor,
                width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick, per row and KV head, the ``counts[row]`` highest-scoring real positions.

    Returns ``(indices, slot_valid)``: ``indices [batch, kv_heads, n]`` with ``n = width`` (default
    ``counts.max()``; a group of a batch takes the batch's),
    ascending within each head, and ``slot_valid [batch, n]``. Rows that keep fewer than ``n``
    tokens get filler slots at the front (pointing at padding or dropped positions) that
    ``slot_valid`` marks False, so every head of a batch stores the same number of slots.
    Ties go to the earlier position.
    """
    batch, heads, seq = scores.shape
    n = int(counts.max()) if width is None else width
    masked = scores.float().masked_fill(~valid[:, None, :], -math.inf)
    order = masked.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(seq, device=scores.device).expand_as(order))
    chosen = rank < counts[:, None, None]
    positions = torch.arange(seq, device=scores.device)
    # Chosen positions sort after every filler candidate; among fillers the latest positions win.
    sort_key = torch.where(chosen, positions + seq, positions)
    picked = sort_key.topk(n, dim=-1).values.sort(dim=-1).values
    indices = torch.where(picked >= seq, picked - seq, picked)
    slot_valid = (picked >= seq)[:, 0, :]
    return indices, slot_valid


def global_shares(scores: list[torch.Tensor], valid: torch.Tensor, free: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's share of each row's budget when every layer's scores are ranked together: of the
    ``layers * heads * free[row]`` highest finite scores of a row over all layers ``scores [b, heads,
    seq]`` (real positions only; ``+inf``, pinned by the method, stays out), the fraction that falls
    in each layer, times the number of layers (1.0: the uniform share). Ties go to the lower layer,
    then the lower head and the earlier position. Returns a ``[b]`` float64 tensor per layer."""
    stacked = torch.stack([s.float() for s in scores])  # [layers, b, heads, seq]
    layers, batch, heads, seq = stacked.shape
    finite = stacked.masked_fill(~valid[None, :, None, :] | (stacked == math.inf), -math.inf)
    shares = torch.zeros(layers, batch, dtype=torch.float64, device=stacked.device)
    for row in range(batch):
        flat = finite[:, row].reshape(-1)
        room = min(layers * heads * int(free[row]), int((flat > -math.inf).sum()))
        if room == 0:
            shares[:, row] = 1.0
            continue
        winners = flat.argsort(descending=True, stable=True)[:room] // (heads * seq)
        shares[:, row] = torch.bincount(winners, minlength=layers).double() * layers / room
    return list(shares)


def pyramid_budgets(budget: int, layers: int, beta: float) -> list[int]:
    """PyramidKV's schedule: layer budgets falling linearly from ``2 * budget - budget / beta``
    (first layer) to ``budget / beta`` (last), summing to ``layers * budget`` exactly."""
    low = budget / beta
    high = 2 * budget - low
    raw = [high - (high - low) * i / max(1, layers - 1) for i in range(layers)]
    rounded = [max(1, int(x)) for x in raw]
    for i in sorted(range(layers), key=lambda i: rounded[i] - raw[i])[: layers * budget - sum(rounded)]:
        rounded[i] += 1  # hand the rounding remainder to the layers rounded down most
    return rounded


def allocate_heads(scores: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, floor: float) -> torch.Tensor:
    """Ada-KV's allocation over a layer's heads: ``[b, kv_heads, seq]`` bool, the positions kept.

    Positions scored ``+inf`` (SnapKV's window, sinks, recent tokens) are kept by every head and
    stay out of the sharing, as in Ada-KV, where the window is kept apart. The rest of a row's
    budget, ``free = counts[row] - pinned`` per head, is shared: the ``heads * free`` highest finite
    scores of all heads together give each head a count, which the safeguard mixes with the uniform
    share, ``floor * free + (1 - floor) * count`` (so every head keeps at least ``floor * free``),
    rounded by largest remainders (ties to the lower head) so the row's total stays the uniform
    budget's. Each head then keeps its own best. Ties go to the lower head, then the earlier position;
    padding is never kept."""
    batch, heads, seq = scores.shape
    masked = scores.float().masked_fill(~valid[:, None, :], -math.inf)
    pinned = masked == math.inf
    order = masked.argsort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(masked, dtype=torch.bool)
    for row in range(batch):
        always = int(pinned[row, 0].sum())
        free = max(0, int(counts[row]) - always)
        shared = masked[row].masked_fill(pinned[row], -math.inf).flatten()
        winners = shared.argsort(descending=True, stable=True)[: heads * free] // seq
        share = floor * free + (1 - floor) * torch.bincount(winners, minlength=heads).double()
        room = share.floor().long()
        fraction = (share - room).tolist()
        for head in sorted(range(heads), key=lambda h: -fraction[h])[: heads * free - int(room.sum())]:
            room[head] += 1
        for head in range(heads):
            keep[row, head, order[row, head, : always + int(room[head])]] = True
    return keep & valid[:, None, :]


@dataclass
class PromptMethod(BudgetMethod):
    """A method that keeps each KV head's best prompt positions: how many (``kept_tokens``) and which (``scores``)."""

    quiet_fields: ClassVar[tuple[str, ...]] = ("heads", "head_floor", "layers", "pyramid_beta")
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
        "layers' scores " "ranked together, per head: methods with an observation pass, e.g. KVzip)",
        choices=("uniform", "pyramid", "global")
    )
    pyramid_beta: float = param(20.0, "with layers=pyramid: the last layer keeps budget / pyramid_beta", above=1)

    def validate(self) -> None:
        super().validate()
        require(self.layers != "pyramid" or self.ratio is None,
                f"{type(self).__name__}: layers='pyramid' needs a fixed budget, not ratio")
        require(
            self.layers != "global" or self.observation() is not None,
            f"{type(self).__name__}: layers='global' ranks every layer's scores together, so every layer must hold its "
            "prompt until they are all scored, which only a method with an observation pass does (KVzip); valid here: "
            "uniform, pyramid"
        )

    def kept_tokens(self, lengths: torch.Tensor, share: float | torch.Tensor = 1.0) -> torch.Tensor:
        """The budget, in one place: prompt tokens each row of a layer keeps per KV head, for real prompt lengths
        ``lengths [b]``. From the fields: ``budget`` tokens, or ``ceil(ratio * length)`` (never fewer than the
        tokens the method always keeps, ``reserved_tokens``: a window, sinks, recent tokens). A layer's ``share``
        then scales what the method may choose beyond the reserved tokens: a float is its part of the budget
        (``layers="pyramid"``: ``pyramid_budgets``; 1.0 uniform), a tensor ``[b]`` its part of each row's count
        (``layers="global"``: ``global_shares``). Never more than a row has, never fewer than one. How a layer's
        count is then shared by its KV heads is by their scores (``heads="adaptive"``: ``allocate_heads``)."""
        reserved = self.reserved_tokens()
        if self.ratio is not None:
            counts = torch.clamp(torch.ceil(lengths.double() * self.ratio).long(), min=max(1, reserved))
        else:
            counts = torch.full_like(lengths, self.budget_tokens)
        counts = torch.minimum(counts, lengths)
        if isinstance(share, float) and share == 1.0:
            return counts
        # pyramid: a share of the budget itself, then capped by each prompt (a prompt under its layer's budget stays
        # whole); global: a share of what each row keeps
        shared = torch.full_like(counts, self.budget_tokens) if isinstance(share, float) else counts
        scaled = reserved + torch.ceil((shared - reserved).clamp(min=0).double() * share).long()
        return torch.minimum(scaled.clamp(min=1), lengths)

    def attends_slots(self) -> bool:
        return self.heads == "uniform" and self.layers != "global"  # otherwise the heads' tokens are packed per head

    def reserved_tokens(self) -> int:
        """Tokens every row keeps whatever the scores (a window, sinks, recent tokens): layer budgets
        share out only the rest, as PyramidKV does with SnapKV's window."""
        return 0

    def layer_scores(self, layer: EvictionLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Scores of one layer's prompt: ``scores`` of its keys by default. A method that needs more of
        the layer (its rotary module, what its observation pass saw) overrides this."""
        return self.scores(query, layer.keys, layer.slot_validity(), scaling, layer.spans)

    def observe(
        self, seen: torch.Tensor | None, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, prompt: int,
        scaling: float, lse: torch.Tensor, context: torch.Tensor
    ) -> torch.Tensor:
        """What a method with an ``observation`` pass keeps from one step of it, ``[b, kv_heads, prompt]``,
        merged with what earlier steps left (``seen``); see ``KVLayer.observe`` for the arguments."""
        raise NotImplementedError(f"{type(self).__name__} has no observation pass")

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> EvictionLayer:
        share = 1.0
        if self.layers == "pyramid":
            layers = model.config.get_text_config().num_hidden_layers
            free = self.budget_tokens - self.reserved_tokens()
            share = pyramid_budgets(free, layers, self.pyramid_beta)[layer_idx] / free
        packed = self.heads == "adaptive" or self.layers == "global"  # global budgets differ per head
        return (HeadAdaptiveLayer if packed else EvictionLayer)(self, layer_idx, share)

    def before_compress(self, layers: list[KVLayer]) -> None:
        """``layers="global"``: each layer's share of every row's budget (``global_shares``) from the
        scores it will compress with."""
        if self.layers != "global" or not layers:
            return
        own = cast(list[EvictionLayer], layers)  # a prompt method's layers
        counts = self.kept_tokens(own[0].prompt_tokens)
        records = [layer.observation.record for layer in own]
        scores = [layer.prompt_scores(record.query, record.scaling) for layer, record in zip(own, records)]
        for layer, share in zip(own, global_shares(scores, own[0].slot_validity(), counts - self.reserved_tokens())):
            layer.share = share


class EvictionLayer(KVLayer):
    """Each row keeps, per KV head, its ``kept_tokens`` highest-scoring prompt tokens (with the layer's ``share``
    of the budget); decoding then appends to that fixed-size cache."""

    share: float | torch.Tensor = hold(rows=False)  # of the budget; per row [b] with layers="global"

    def __init__(self, method: PromptMethod, layer_idx: int, share: float = 1.0) -> None:
        super().__init__(layer_idx)
        self.method = method
        self.share = share
        self.rotary: Any = None  # the model's rotary module for this layer, for methods that score with it

    def counts(self) -> tuple[torch.Tensor, int] | None:
        """Tokens each row keeps per KV head in this layer and the slots the batch needs for them (its
        largest count; a group of a batch prefilled in groups takes the whole batch's), or None when no
        row of the batch is over its count."""
        lengths = batch_prompt_tokens(self)
        everyone = self.method.kept_tokens(lengths, self.share)
        if bool((everyone >= lengths).all()):
            return None
        return self.method.kept_tokens(self.prompt_tokens, self.share), int(everyone.max())

    def queries_needed(self) -> int | None:
        return self.method.queries_needed()

    def prompt_scores(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        with scoring_sinks(self.sinks):  # a model's learned sinks take their share of the scorer's softmax
            return self.method.layer_scores(self, query, scaling)

    def observe(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, lse: torch.Tensor,
                context: torch.Tensor) -> None:
        seen = self.observation.seen
        self.observation.seen = self.method.observe(seen, query, keys, valid, self.prefill_len, scaling, lse, context)

    def compress(self, query: torch.Tensor, scaling: float) -> None:
        self.keep_top(lambda: self.prompt_scores(query, scaling))

    def keep_top(self, scores) -> torch.Tensor | None:
        """Keep each row's best positions by ``scores()`` (computed only when some row is over its
        count); returns the kept slots ``[b, kv_heads, n]``, or None if nothing was dropped."""
        kept = self.counts()
        if kept is None:
            return None
        indices, slot_valid = select_kept(scores(), self.slot_validity(), *kept)
        cast(DenseSlots, self.slots).keep(indices, slot_valid)
        return indices


class HeadAdaptiveLayer(EvictionLayer):
    """Ada-KV: the layer's budget shared by its KV heads by score; once compressed, its storage is a
    packing (``packed.PackedSlots``), each head's tokens in a segment of its own length."""

    LAYOUTS = (PackedSlots,)

    def counts(self) -> tuple[torch.Tensor, int] | None:
        if isinstance(self.share, float):
            return super().counts()
        counts = self.method.kept_tokens(self.prompt_tokens, self.share)  # this group's rows: every row packs
        return counts, int(counts.max())

    def compress(self, query: torch.Tensor, scaling: float) -> None:
        kept = self.counts()
        if kept is None:
            return
        valid = self.slot_validity()
        keep = allocate_heads(self.prompt_scores(query, scaling), valid, kept[0], self.method.head_floor)
        # [b, h, slots]: the slots' prompt positions (a thinned context's are not in order)
        positions = self.kept_positions()
        segments: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        for row in range(keep.shape[0]):
            segments.append([])
            for head in range(keep.shape[1]):
                slots = keep[row, head].nonzero()[:, 0]
                segments[row].append(
                    (self.keys[row, head, slots], self.values[row, head, slots], positions[row, head, slots]))
        self.slots = PackedSlots(segments, self.seen_tokens)  # the dense slots (the prompt's KV) are freed

    @property
    def packed(self) -> PackedSlots | None:
        """The packing, once the layer compressed (None: the dense slots hold the prompt, under budget)."""
        return self.slots if isinstance(self.slots, PackedSlots) else None
