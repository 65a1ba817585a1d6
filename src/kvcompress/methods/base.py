"""What every KV-cache method is: a dataclass of hyperparameters that validates itself and builds the
cache layers that apply it.

A field declared with ``param`` carries its help text, its valid range and its choices; validation,
the command line (``kvcompress generate --flag``) and the benchmarks' method specs
(``snapkv:window=16``) are all derived from those declarations, so a method is one file.

Two kinds of methods share this base:

* prompt compression (SnapKV, StreamingLLM, H2O; ``prompt.py``): ``kept_tokens`` says how many
  prompt tokens each row keeps and ``scores`` how important each position is per KV head; the
  layer keeps the top ones at the end of prefill;
* sparse decoding (ShadowKV, Quest, Loki): nothing is dropped; their layers (``sparse.py``) choose
  what each decoding step attends to.

Shapes: keys/values ``[batch, kv_heads, seq, head_dim]``, queries ``[batch, q_heads, seq, head_dim]``,
scores ``[batch, kv_heads, seq]``, per-token validity ``[batch, seq]`` (False = padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..cache.errors import UnsupportedModelError
from ..cache.kv_cache import KVCompressCache
from ..cache.layer import KVLayer
from ..cache.policy import PolicyLayer
from ..cache.tokens import TokenSpans
from ..integrations.transformers.attach import layer_windows, make_cache
from ..integrations.transformers.rope import check_rope
from ..storage.codec import KVCodec, make_kv_codec
from .fields import CODEC_FIELDS, field_defaults, field_specs, param, require, setting

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


# The keys' bits where ``key_bits`` is left unset, by ``kv_bits``: keys in 4 bits move the answers' next-token
# distributions ~15x as much as in 8, in 6 about twice as much (docs/quantization.md, "What kv_bits=4 means")
KEY_BITS_AT = {4: 6}


@dataclass(frozen=True)
class Observation:
    """A pass the model runs over its prompt before the prompt is compressed, for methods that score
    from it: in ``chunk``-token pieces, the first led by ``first`` (an instruction, asked as the
    question would be), each later one by ``later`` and the last ``overlap`` tokens before it. Its
    tokens are attended, never kept; the layers' ``observe`` sees each piece's queries."""

    first: str
    later: str
    chunk: int
    overlap: int


@dataclass
class Method:
    """Base of all methods. Subclasses set ``name`` and declare their fields with ``param``. Every method also
    says how its kept tokens are stored (``kv_bits``, ``kv_format``: storage/codec.py), whatever it keeps."""

    name: ClassVar[str] = "method"
    quiet_fields: ClassVar[tuple[str, ...]] = ()  # shown by describe() only when not at their default
    # why vLLM cannot serve it (serving/settings.py's refusal), None where it can: vLLM's plugin compresses a prompt
    # at the end of its prefill, by scores of each position and KV head computed from the prefill itself
    not_served: ClassVar[str | None] = "it is not one of the methods scored from the prefill"
    keys_apart: ClassVar[bool] = True  # its storage may code keys with another codec than values (key_bits)
    codes_turned: ClassVar[bool] = True  # its layers' steps write rows through the storage, which may turn them
    # a field whose default changed: the value it had in a saved file written before the field existed (which
    # does not record it), so the file decodes as it did when written (generation/result.py)
    unrecorded_meant: ClassVar[dict[str, Any]] = {}
    kv_bits: int = param(
        16,
        "bits per stored key and value element once the prompt is compressed: 16 (the model's own precision), "
        "8 or 4 (codes with scales; at 4 the keys take 6 unless key_bits says otherwise, docs/quantization.md)",
        choices=(16, 8, 4),
        kw_only=True,
    )
    kv_format: str = param(
        "int",
        "how 8 or 4 bits are written: int (per-token groups with scales) or fp8 (float8 e4m3, as vLLM's fp8 "
        "cache dtype; kv_bits=8 only)",
        choices=("int", "fp8"),
        kw_only=True,
    )
    key_bits: int | None = param(
        None,
        "bits per stored key element where keys take more than values (None: 6 with kv_bits=4 where the "
        "method stores keys apart from values, else kv_bits; key_bits=4 with kv_bits=4: keys in 4 bits too, "
        "docs/quantization.md)",
        choices=(8, 6, 4),
        kw_only=True,
    )

    def __post_init__(self) -> None:
        for spec in field_specs(type(self)):
            spec.check(type(self).__name__, getattr(self, spec.name))
        said = {"owner": type(self).__name__, "kv_format": self.kv_format, "kv_bits": self.kv_bits}
        require(
            self.kv_format == "int" or self.kv_bits == 8,
            "{owner}: {kv_format=} stores 8 bits, got {kv_bits=}; valid: {kv_bits=8} with {kv_format='fp8'}, or "
            "{kv_format='int'}",
            **said,
        )
        require(
            self.key_bits is None or self.kv_bits < 16,
            "{owner}: {key_bits=} sets the keys' bits where kept tokens are stored in codes, and {kv_bits=} keeps the "
            "model's precision; valid: {kv_bits=8} or {kv_bits=4} with {key_bits=}",
            key_bits=self.key_bits,
            **said,
        )
        require(
            self.key_bits is None or (self.kv_format == "int" and self.kv_bits <= self.key_bits),
            "{owner}: {key_bits=} with {kv_bits=}, {kv_format=}; valid: {key_bits!n} >= {kv_bits!n} (8, 6 or 4) with "
            "{kv_format='int'}",
            key_bits=self.key_bits,
            **said,
        )
        self.validate()

    def kv_codec(self) -> str | None:
        """The codec kept tokens are stored with (storage/codec.py's names, ``keys+values`` where they differ;
        None: the model's precision)."""
        if self.kv_bits == 16:
            return None
        if self.kv_format == "fp8":
            return "fp8"
        keys = self.key_bits or (KEY_BITS_AT.get(self.kv_bits, self.kv_bits) if self.keys_apart else self.kv_bits)
        return f"int{keys}" if keys == self.kv_bits else f"int{keys}+int{self.kv_bits}"

    def storage_codec(self, head_dim: int, dtype: torch.dtype, turned: bool | None = None) -> KVCodec | None:
        """The codec object a layer of ``head_dim`` stores its kept tokens with (None: the model's precision):
        ``kv_codec``'s, its keys coded in the Hadamard-turned basis unless the method's layers write rows in the
        model's own (``codes_turned``; ``turned``: a window layer's, which writes only through its storage)."""
        spec = self.kv_codec()
        turned = self.codes_turned if turned is None else turned
        return None if spec is None else make_kv_codec(spec, head_dim, dtype, turned)

    def validate(self) -> None:
        """Checks across fields; raise ``InvalidParameterError`` naming the values and the valid range."""

    def make_cache(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | TokenSpans | None = None
    ) -> KVCompressCache:
        """A transformers ``Cache`` applying this method to ``model`` (see ``integration.make_cache``);
        ``tokenizer`` (or its ``TokenSpans``) tells it where words and numbers start (needed by
        ``needs_tokens`` methods; without it they load the model's own tokenizer from disk)."""
        return make_cache(self, model, tokenizer)

    def needs_tokens(self) -> bool:
        """Whether ``scores`` uses the prompt's word and number spans (then the cache needs the tokenizer)."""
        return False

    def attends_slots(self) -> bool:
        """Whether every decoding step attends exactly the slots its layer returned (no chunks gathered, no
        per-head segments): what a learned attention sink's correction (gpt-oss) is computed over."""
        return True

    def needs_rotary(self) -> bool:
        """Whether scoring reads the model's rotary embedding (a layer's ``rotary``; RoPE models only)."""
        return False

    def check_model(self, model: PreTrainedModel) -> None:
        """Raise where a hyperparameter or the method itself does not fit ``model``."""

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        """The cache layer that stores and attends for full-attention layer ``layer_idx`` (default:
        one that keeps everything)."""
        return KVLayer(layer_idx)

    def queries_needed(self, asked: int | None = None) -> int | None:
        """How many of the last prefill queries the method reads at compression (None: all of them); ``asked``: the
        prompt's tokens after a stored context or the request's own question start, where known."""
        return 1

    def observation(self) -> Observation | None:
        """The pass over the prompt this method scores from before compressing (None: it scores from
        the prefill itself)."""
        return None

    def compresses_together(self) -> bool:
        """Whether every layer holds its whole prompt until all of them are scored (then ``before_compress`` sees
        them all): after an observation pass, or to rank every layer's scores together."""
        return self.observation() is not None

    def before_compress(self, layers: list[KVLayer]) -> None:
        """Once every layer holds its whole prompt (``compresses_together``), before any of ``layers`` compresses.
        Default: nothing."""

    def scores(
        self,
        query: torch.Tensor | None,
        keys: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        spans: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Importance of each prompt position per KV head ``[batch, kv_heads, seq]``; higher is kept.
        ``query``: the prefill's post-RoPE queries (None where ``queries_needed`` asked for none); ``spans [batch,
        seq]``: the word/number span of each token (``tokens.TokenSpans``; None when unknown); padding is excluded by
        the caller."""
        raise NotImplementedError

    def summarize(self, totals: dict[str, Any]) -> dict[str, Any]:
        """The method's own stats fields, from its layers' summed counters (``KVLayer.stats``)."""
        return {}

    def settings(self) -> dict[str, Any]:
        """Every hyperparameter, with defaults resolved where the method can resolve them alone."""
        return {spec.name: getattr(self, spec.name) for spec in field_specs(type(self))}

    def describe(self) -> str:
        """``snapkv(budget=256, window=32, ...)``: every setting (quiet ones only when changed)."""
        defaults = field_defaults(type(self))
        shown = ", ".join(
            f"{k}={v}"
            for k, v in self.settings().items()
            if v is not None and not (k in self.quiet_fields + CODEC_FIELDS and v == defaults[k])
        )
        return f"{self.name}({shown})"

    def label(self) -> str:
        """Short form for tables: the name and the settings that differ from the defaults."""
        changed = [
            f"{s.name}={getattr(self, s.name)}" for s in field_specs(type(self)) if getattr(self, s.name) != s.default
        ]
        return " ".join([self.name, *changed])


@dataclass
class BudgetMethod(Method):
    """A method with a working-set size: ``budget`` tokens per KV head (kept after prefill, or
    attended per decoding step), or ``ratio`` of each prompt instead."""

    default_budget: ClassVar[int] = 1024
    budget: int | None = param(
        None,
        "working-set size in tokens per KV head: prompt tokens kept (prompt compression) or attended per decoding step "
        "(sparse decoding)",
        minimum=1,
    )
    ratio: float | None = param(
        None, "fraction of each prompt used instead of a fixed budget, in (0, 1]", above=0, at_most=1
    )

    def validate(self) -> None:
        require(
            self.budget is None or self.ratio is None,
            "{owner}: give {budget!n} or {ratio!n}, not both (got {budget=}, {ratio=})",
            owner=type(self).__name__,
            budget=self.budget,
            ratio=self.ratio,
        )

    @property
    def budget_tokens(self) -> int:
        """The fixed budget in tokens (the default when neither budget nor ratio is given)."""
        return self.budget if self.budget is not None else self.default_budget

    def token_budgets(self, lengths: torch.Tensor, floor: int = 1) -> torch.Tensor:
        """Per-row budgets for real prompt lengths ``[batch]``: the budget, or ``ceil(ratio * length)``
        (at least ``floor``), never more than the row has."""
        if self.ratio is not None:
            wanted = torch.clamp(torch.ceil(lengths.double() * self.ratio).long(), min=floor)
        else:
            wanted = torch.full_like(lengths, self.budget_tokens)
        return torch.minimum(wanted, lengths)

    def settings(self) -> dict[str, Any]:
        values = super().settings()
        if self.ratio is None:
            values["budget"] = self.budget_tokens
        return values


def batch_prompt_tokens(layer: PolicyLayer) -> torch.Tensor:
    """Real prompt tokens of every row of the batch ``layer`` is compressed for: a cache prefilled for a group of a
    batch's rows (``KVCompressCache.note_batch``) compresses them into the shapes the whole batch would take, so
    the groups can be joined."""
    return layer.held_prompt()[0] if layer.batch_lengths is None else layer.batch_lengths


def model_head_dim(model: PreTrainedModel) -> int:
    """The size of one attention head of ``model`` (its config's, or the hidden size over the heads)."""
    config = model.config.get_text_config()
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def require_rope(model: PreTrainedModel, owner: str) -> None:
    """Raise ``UnsupportedModelError`` unless every full-attention layer of ``model`` uses a rotary
    embedding kvcompress can reproduce and invert (``rope.check_rope``)."""
    head_dim = model_head_dim(model)
    for index, window in enumerate(layer_windows(model)):
        problem = check_rope(model, index, head_dim) if window is None else None
        if problem:
            raise UnsupportedModelError(
                f"{owner} needs rotary position embeddings it can invert, and {type(model).__name__}: {problem}"
            )


def check_reserved(owner: str, budget: int, reserved_name: str, reserved: int, what: str) -> None:
    """``budget`` must exceed the ``reserved`` tokens it always includes (a window, sinks, ...)."""
    require(
        budget > reserved,
        "{owner}: {budget=} must be greater than " + setting(reserved_name) + " ({budget!n} counts the {what}; "
        "valid: {budget!n} > {reserved})",
        owner=owner,
        budget=budget,
        what=what,
        reserved=reserved,
        **{reserved_name: reserved},
    )
