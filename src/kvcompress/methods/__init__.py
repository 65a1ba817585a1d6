"""The methods, one module each, and the registry the CLI and the benchmarks read.

A new method is one file (a ``Method`` dataclass whose fields are declared with ``param``) plus one
entry in ``BUILT_IN`` below (or ``register_method(cls)`` from outside the package). Everything
else, from the command-line flags to the benchmarks' method specs, is derived from its fields; the command line
reads a built-in's from ``cli/catalogue.json`` (so ``--help`` needs no torch): rewrite it with
``python -m kvcompress.cli.catalogue`` (a test says when it differs).

The methods may import the transformers integration (``attach``, ``rope``), cache and storage.
"""

from __future__ import annotations

from typing import Any

from ..cache.errors import flag_for
from .base import BudgetMethod, Method
from .expected import ExpectedAttention
from .fields import FieldSpec, InvalidParameterError, field_specs
from .full import FullKV
from .h2o import H2O
from .kvzip import KVzip
from .loki import Loki
from .prompt import PromptMethod
from .quest import Quest
from .shadowkv import ShadowKV
from .snapkv import SnapKV
from .streaming import StreamingLLM

BUILT_IN: dict[str, type[Method]] = {  # (the command line's catalogue lists these)
    cls.name: cls for cls in (FullKV, SnapKV, StreamingLLM, H2O, KVzip, ExpectedAttention, ShadowKV, Quest, Loki)
}
METHODS: dict[str, type[Method]] = dict(BUILT_IN)  # and the ones registered later


def register_method(cls: type[Method]) -> type[Method]:
    """Make a ``Method`` subclass available by its ``name`` to ``method_from_name``, the CLI and the benchmarks."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or cls.name == Method.name:
        raise InvalidParameterError(f"register_method needs a Method subclass with its own name; got {cls!r}")
    METHODS[cls.name] = cls
    return cls


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise InvalidParameterError("{method=} is unknown; valid: {valid}", method=name, valid=", ".join(METHODS))
    return METHODS[name]


def method_from_name(name: str, **params: Any) -> Method:
    """Build a method from its name; ``params`` set to None are left at their defaults."""
    cls = method_class(name)
    specs = field_specs(cls)
    accepted = {spec.name for spec in specs}
    unknown = sorted(k for k, v in params.items() if v is not None and k not in accepted)
    if unknown:  # (the command line's words: its flags, in the order --help shows them)
        flags = ", ".join(flag_for(field) for field in unknown)
        raise InvalidParameterError(
            f"method {name!r} does not take {', '.join(unknown)}; "
            f"it takes: {', '.join(sorted(accepted)) or 'no parameters'}",
            cli=f"method {name!r} does not take {flags}; it takes: {', '.join(s.flag for s in specs) or 'no settings'}",
        )
    return cls(**{k: v for k, v in params.items() if v is not None})


def parse_value(spec: FieldSpec, text: str) -> Any:
    """A field's value from its text form (``none`` for None unless it is one of the field's
    choices, e.g. KVzip's ``clustering=none``; ``true``/``false`` for booleans)."""
    if spec.choices and text in spec.choices:
        return text
    if text.lower() == "none":
        return None
    try:
        if spec.kind is bool:
            return {"true": True, "false": False}[text.lower()]
        return spec.kind(text)
    except (KeyError, ValueError):
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[spec.kind]
        raise InvalidParameterError(f"{spec.name}={text!r} is not {kind}") from None


def method_from_spec(spec: str, **defaults: Any) -> Method:
    """A method from ``name[:field=value...]``, e.g. ``snapkv:window=16:kernel=5``; ``defaults``
    (e.g. a benchmark's budget) apply to the fields the method has and the spec does not set."""
    name, *settings = spec.strip().split(":")
    cls = method_class(name)
    fields = {f.name: f for f in field_specs(cls)}
    params = {k: v for k, v in defaults.items() if k in fields and v is not None}
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or key not in fields:
            raise InvalidParameterError(
                f"method spec {spec!r}: {setting!r} is not field=value for a field of {name} "
                f"({', '.join(fields) or 'none'})"
            )
        params[key] = parse_value(fields[key], text)
    if sets_budget(spec):  # the spec's own working set replaces the benchmark's budget
        for name in BUDGET_FIELDS:
            if name in defaults and not any(s.startswith(f"{name}=") for s in settings):
                params.pop(name, None)
    return cls(**params)


BUDGET_FIELDS = ("budget", "ratio", "kv_bytes")  # a working set in tokens, a share of the prompt, or bytes


def sets_budget(spec: str) -> bool:
    """Whether a method spec (``name[:field=value...]``) sets its own working set (``BUDGET_FIELDS``), which a
    benchmark's budget then leaves alone."""
    return any(part.split("=")[0] in BUDGET_FIELDS for part in spec.split(":")[1:])


__all__ = [
    "BUDGET_FIELDS",
    "BUILT_IN",
    "BudgetMethod",
    "ExpectedAttention",
    "FieldSpec",
    "FullKV",
    "H2O",
    "KVzip",
    "InvalidParameterError",
    "Loki",
    "METHODS",
    "Method",
    "PromptMethod",
    "Quest",
    "ShadowKV",
    "SnapKV",
    "StreamingLLM",
    "field_specs",
    "method_class",
    "method_from_name",
    "method_from_spec",
    "parse_value",
    "register_method",
    "sets_budget",
]
