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

Its layers' policies: eviction.py (at the prompt's end: uniform, per head packed, by bytes), bounded.py (a bound while
decoding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from ..cache.intake import ObservationPass
from ..cache.layer import KVLayer
from ..cache.policy import ScoredLayer
from ..storage.capped import BoundedSlots
from ..storage.codec import KVCodec
from .base import BudgetMethod
from .bounded import BoundedPolicy, HeldTokens
from .eviction import ByteBudgetPolicy, EvictionPolicy, HeadAdaptivePolicy, plan_bytes
from .fields import field_defaults, param, require, require_with, setting
from .selection import global_shares, pyramid_budgets

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class PromptMethod(BudgetMethod):
    """A method that keeps each KV head's best prompt positions: how many (``kept_tokens``) and which (``scores``)."""

    quiet_fields: ClassVar[tuple[str, ...]] = (
        "heads",
        "head_floor",
        "layers",
        "layer_floor",
        "pyramid_beta",
        "every",
        "decode_window",
    )
    heads: str = param(
        "uniform",
        "how a layer's budget is shared by its KV heads: uniform, or adaptive (Ada-KV: by their scores)",
        choices=("uniform", "adaptive"),
    )
    head_floor: float = param(
        0.2,
        "with heads=adaptive: the weight of the uniform share in each head's budget, so every head keeps at least this "
        "share (Ada-KV's safeguard)",
        minimum=0,
        at_most=1,
    )
    layers: str = param(
        "uniform",
        "how the budget is shared by the layers: uniform; pyramid (PyramidKV: more in lower layers); global (all "
        "layers' scores ranked together, per head; every layer holds its prompt until all are scored)",
        choices=("uniform", "pyramid", "global"),
    )
    layer_floor: float = param(
        0.0,
        "with layers=global: the weight of the uniform share in each layer's budget, so every layer keeps at least "
        "this share (a model with few compressed layers starves the one whose scores are flattest without it)",
        minimum=0,
        at_most=1,
    )
    pyramid_beta: float = param(20.0, "with layers=pyramid: the last layer keeps budget / pyramid_beta", above=1)
    decode_budget: int | None = param(
        None,
        "a bound while decoding: tokens per KV head each layer keeps of prompt and answer together, re-selected "
        "by the method's scores once a row holds decode_budget + every (None: the answer's KV grows)",
        minimum=1,
        kw_only=True,
    )
    every: int = param(
        64, "with decode_budget: tokens a row may add beyond it before the next re-selection", minimum=1, kw_only=True
    )
    decode_window: int | None = param(
        None,
        "with decode_budget: the last steps whose queries vote and whose tokens are always kept (default: "
        "SnapKV's window, else 32)",
        minimum=1,
        kw_only=True,
    )
    kv_bytes: float | None = param(
        None,
        "a byte budget instead of a token budget: this share of the prompt's 16-bit cache's bytes, spent by "
        "the method's scores on which tokens each layer keeps (per head with heads=adaptive) and in which precision "
        "(16, 8, k6v4 or 4 bits), each layer's coding error measured on the prompt (e.g. 0.015625 for 1/64)",
        above=0,
        at_most=1,
        kw_only=True,
    )

    def validate(self) -> None:
        super().validate()
        self._check_byte_budget()
        owner = type(self).__name__
        require(
            self.layers != "pyramid" or self.ratio is None,
            "{owner}: {layers='pyramid'} needs a fixed budget, not {ratio!n}",
            owner=owner,
        )
        packs = self.heads == "adaptive" or self.layers == "global"  # (both pack per head)
        require_with(self, "head_floor", packs, "{heads='adaptive'} or {layers='global'}")
        require_with(self, "pyramid_beta", self.layers == "pyramid", "{layers='pyramid'}")
        require_with(self, "layer_floor", self.layers == "global", "{layers='global'}")
        for name in ("every", "decode_window"):
            require_with(self, name, self.decode_budget is not None, "{decode_budget!n}")
        if self.decode_budget is not None:
            self._check_decode_bound()

    def _check_byte_budget(self) -> None:
        if self.kv_bytes is None:
            return
        defaults = field_defaults(type(self))
        others = ("budget", "ratio", "kv_bits", "key_bits", "kv_format", "layers", "decode_budget")
        given = {name: getattr(self, name) for name in others if getattr(self, name) != defaults[name]}
        require(
            not given,
            "{owner}: {kv_bytes=} chooses the kept tokens, their precision and each layer's and head's share itself; "
            "it does not combine with " + ", ".join(map(setting, given)) + "; valid: {kv_bytes!n} alone, or a token "
            "budget without it",
            owner=type(self).__name__,
            kv_bytes=self.kv_bytes,
            **given,
        )

    def _check_decode_bound(self) -> None:
        said = {"owner": type(self).__name__, "decode_budget": self.decode_budget}
        require(
            type(self).decode_scores is not PromptMethod.decode_scores,
            "{owner}: {decode_budget=} needs scores of the answer's tokens, which {owner} does not define (it scores "
            "from its observation pass); valid: SnapKV, H2O, StreamingLLM, ExpectedAttention",
            **said,
        )
        require(
            self.heads == "uniform" and self.layers != "global",
            "{owner}: {decode_budget=} re-selects a uniform count per head; it does not combine with {heads=}, "
            "{layers=} (valid: {heads='uniform'}, {layers!n} 'uniform' or 'pyramid')",
            heads=self.heads,
            layers=self.layers,
            **said,
        )
        pinned, bound = self.decode_reserved(), cast(int, self.decode_budget)  # (validate's caller checked it)
        require(
            bound > pinned,
            "{owner}: {decode_budget=} must be greater than the {pinned} tokens every re-selection keeps whole (its "
            "{decode_window!n} and the method's reserved tokens); valid: {decode_budget!n} > {pinned}",
            pinned=pinned,
            **said,
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
        return {
            "reselections": int(per_layer) if per_layer.is_integer() else round(per_layer, 2),
            "reselect_s": totals.get("reselect_s", 0.0),
        }  # (reselections: per layer, the mean; seconds: summed)

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

    def decode_scores(
        self, policy: BoundedPolicy, held: HeldTokens, query: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Scores ``[b, kv_heads, n]`` of the ``held`` tokens (prompt kept and answer, in order) when a layer under
        ``decode_budget`` re-selects, from ``query [b, q_heads, decode_window, d]``, the last steps' queries (whose
        tokens are the last held ones, kept whatever the scores). A method that scores while decoding defines it."""
        raise NotImplementedError(f"{type(self).__name__} has no scores while decoding")

    def layer_scores(self, layer: ScoredLayer, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Scores of one layer's prompt: ``scores`` of its keys by default. A method that needs more of
        the layer (its rotary module, what its observation pass saw) overrides this."""
        return self.scores(query, layer.keys, layer.slot_validity(), scaling, layer.spans)

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
            return plan_bytes(self, layers)  # (the bytes choose each layer's share: a global ranking stays out)
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
