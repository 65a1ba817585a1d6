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

import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..cache.errors import UnsupportedModelError
from ..cache.kv_cache import KVCompressCache
from ..cache.layer import KVLayer
from ..cache.tokens import TokenSpans
from ..integrations.transformers.attach import layer_windows, make_cache
from ..integrations.transformers.rope import check_rope
from ..storage.codec import KVCodec, make_kv_codec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class InvalidParameterError(ValueError):
    """A method was given a hyperparameter outside its valid range (or of the wrong type). ``cli``: the same refusal
    in the command line's words, where the library's names a Python remedy (the CLI otherwise says ``--budget 0``
    for ``budget=0`` itself)."""

    def __init__(self, message: str, cli: str | None = None) -> None:
        super().__init__(message)
        self.cli = cli


def require(ok: bool, message: str) -> None:
    """Raise ``InvalidParameterError(message)`` unless ``ok``."""
    if not ok:
        raise InvalidParameterError(message)


def param(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    choices: tuple[Any, ...] | None = None,
    above: float | None = None,
    at_most: float | None = None,
    kw_only: bool = False,
    none: str = "the default",
) -> Any:
    """A method field: its default, its help text (shown by the CLI) and its valid range:
    ``minimum`` (inclusive), ``above`` (exclusive), ``at_most`` (inclusive), or ``choices``; ``kw_only``: never
    given by position (the fields every method shares); ``none``: what None means, where the type allows it."""
    return field(
        default=default,
        kw_only=kw_only,
        metadata={
            "help": help,
            "minimum": minimum,
            "above": above,
            "at_most": at_most,
            "choices": choices,
            "none": none,
        },
    )


def require_with(method: Method, name: str, applies: bool, needs: str, needs_flag: str) -> None:
    """Refuse field ``name`` set off its default where it would do nothing (``applies`` False): the library's words
    name ``needs``, the command line's ``needs_flag``."""
    value, default = getattr(method, name), field_defaults(type(method))[name]
    if value != default and not applies:
        flag = "--" + name.replace("_", "-")
        raise InvalidParameterError(
            f"{type(method).__name__}: {name}={value!r} applies only with {needs}; give that, or leave {name} out",
            cli=f"{flag} {value} applies only with {needs_flag}; give that, or leave {flag} out",
        )


def default_of(cls: type, name: str, default: Any) -> Any:
    """Field ``name`` of the dataclass ``cls`` (its help, range and choices) with a subclass's own default."""
    declared = {each.name: each for each in fields(cls)}
    return field(default=default, metadata=declared[name].metadata)


# The keys' bits where ``key_bits`` is left unset, by ``kv_bits``: keys in 4 bits move the answers' next-token
# distributions ~15x as much as in 8, in 6 about twice as much (docs/quantization.md, "What kv_bits=4 means")
KEY_BITS_AT = {4: 6}
CODEC_FIELDS = ("kv_bits", "kv_format", "key_bits")  # every method's; describe() shows them only off their default


@dataclass(frozen=True)
class FieldSpec:
    """One hyperparameter as the CLI and the validation see it."""

    name: str
    kind: type  # int, float, bool or str
    optional: bool  # None is accepted (meaning: the method's default rule)
    default: Any
    help: str
    minimum: float | None
    above: float | None
    at_most: float | None
    choices: tuple[Any, ...] | None  # strings, or numbers (kv_bits)
    none: str = "the default"  # what None means (where ``optional``)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, owner: str, value: Any) -> None:
        """Raise ``InvalidParameterError`` unless ``value`` has this field's type and range."""
        if value is None:
            require(self.optional, f"{owner}: {self.name}=None is invalid; give {self._what()}")
            return
        valid_type = (
            isinstance(value, bool)
            if self.kind is bool
            else (isinstance(value, (int, float) if self.kind is float else self.kind) and not isinstance(value, bool))
        )
        ranged = self.above is not None or self.at_most is not None
        require(
            valid_type and (self.kind is not float or math.isfinite(value)),
            f"{owner}: {self.name}={value!r} is invalid; it must be {self.valid() if ranged else self._what()}",
        )
        if self.choices is not None:
            require(
                value in self.choices,
                f"{owner}: {self.name}={value!r} is unknown; valid: {', '.join(map(str, self.choices))}",
            )
        in_range = (
            (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.at_most is None or value <= self.at_most)
        )
        if ranged:
            require(in_range, f"{owner}: {self.name}={value!r} is outside the valid range {self._interval()}")
        require(in_range, f"{owner}: {self.name}={value!r} is invalid; it must be {self._what()}")

    def valid(self) -> str:
        """The valid values in words (help texts, ``kvcompress methods``)."""
        if self.above is not None or self.at_most is not None:
            return f"a number in {self._interval()}"
        return self._what(optional_note=False)

    def _interval(self) -> str:
        if self.above is not None:
            low = f"({self.above:g}"
        else:
            low = f"[{self.minimum:g}" if self.minimum is not None else "(-inf"
        high = f"{self.at_most:g}]" if self.at_most is not None else "inf)"
        return f"{low}, {high}"

    def _what(self, optional_note: bool = True) -> str:
        if self.choices:
            return f"one of {', '.join(map(str, self.choices))}"
        kind = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}[self.kind]
        text = f"{kind} >= {self.minimum:g}" if self.minimum is not None else kind
        return text + (f" (or None for {self.none})" if self.optional and optional_note else "")


def field_specs(cls: type) -> list[FieldSpec]:
    """The hyperparameters of a method class, from its dataclass fields and their annotations (the codec fields
    every method shares last)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in fields(cls):
        if f.name.startswith("_"):
            continue
        hint = hints[f.name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
        kinds = [a for a in args if a is not type(None)] or [hint]
        meta = f.metadata
        specs.append(
            FieldSpec(
                f.name,
                kinds[0],
                type(None) in args,
                None if f.default is MISSING else f.default,
                meta.get("help", ""),
                meta.get("minimum"),
                meta.get("above"),
                meta.get("at_most"),
                meta.get("choices"),
                meta.get("none", "the default"),
            )
        )
    return sorted(specs, key=lambda spec: spec.name in CODEC_FIELDS)  # the method's own first, storage's last


def field_defaults(cls: type) -> dict[str, Any]:
    """Each field of the method class ``cls`` by name, with its default."""
    return {spec.name: spec.default for spec in field_specs(cls)}


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
        require(
            self.kv_format == "int" or self.kv_bits == 8,
            f"{type(self).__name__}: kv_format={self.kv_format!r} stores 8 bits, got kv_bits={self.kv_bits}; "
            "valid: kv_bits=8 with kv_format='fp8', or kv_format='int'",
        )
        require(
            self.key_bits is None or self.kv_bits < 16,
            f"{type(self).__name__}: key_bits={self.key_bits} sets the keys' bits where kept tokens are stored in "
            f"codes, and kv_bits={self.kv_bits} keeps the model's precision; valid: kv_bits=8 or kv_bits=4 with "
            f"key_bits={self.key_bits}",
        )
        require(
            self.key_bits is None or (self.kv_format == "int" and self.kv_bits <= self.key_bits),
            f"{type(self).__name__}: key_bits={self.key_bits} with kv_bits={self.kv_bits}, "
            f"kv_format={self.kv_format!r}; valid: key_bits >= kv_bits (8, 6 or 4) with kv_format='int'",
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
            f"{type(self).__name__}: give budget or ratio, not both (got budget={self.budget}, ratio={self.ratio})",
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


def batch_prompt_tokens(layer: KVLayer) -> torch.Tensor:
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
        f"{owner}: budget={budget} must be greater than {reserved_name}={reserved} (budget counts the {what}; valid: "
        f"budget > {reserved})",
    )
