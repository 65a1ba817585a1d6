"""A method's hyperparameters: each declared with ``param`` (its default, help, valid range or choices), read back as
a ``FieldSpec`` (the command line's flags, the benchmarks' specs and validation all come from these), and refused in
one line naming the parameter, the value and the valid range (``InvalidParameterError``)."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..cache.errors import Said, flag_for

CODEC_FIELDS = ("kv_bits", "kv_format", "key_bits")  # every method's; describe() shows them only off their default


class InvalidParameterError(Said, ValueError):
    """A method was given a hyperparameter outside its valid range (or of the wrong type): a refusal naming the
    setting, its value and the valid values as data (``cache.errors.Said``: ``settings``, ``values["valid"]``)."""


def setting(name: str) -> str:
    """The template field of setting ``name`` with its value (``{name=}``), for a name known only at run time."""
    return "{" + name + "=}"


def require(ok: bool, template: str, **values: Any) -> None:
    """Raise ``InvalidParameterError(template, **values)`` unless ``ok``."""
    if not ok:
        raise InvalidParameterError(template, **values)


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


def require_with(method: object, name: str, applies: bool, needs: str) -> None:
    """Refuse field ``name`` set off its default where it would do nothing (``applies`` False); ``needs``: what it
    applies with, a template of the settings it names (``{layers='pyramid'}``)."""
    value, default = getattr(method, name), field_defaults(type(method))[name]
    if value != default and not applies:
        raise InvalidParameterError(
            "{owner}: " + setting(name) + " applies only with " + needs + "; give that, or leave {" + name + "!n} out",
            owner=type(method).__name__,
            **{name: value},
        )


def default_of(cls: type, name: str, default: Any) -> Any:
    """Field ``name`` of the dataclass ``cls`` (its help, range and choices) with a subclass's own default."""
    declared = {each.name: each for each in fields(cls)}
    return field(default=default, metadata=declared[name].metadata)


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
        return flag_for(self.name)

    def check(self, owner: str, value: Any) -> None:
        """Raise ``InvalidParameterError`` unless ``value`` has this field's type and range."""
        given = "{owner}: " + setting(self.name)
        unset = " (or {unset} for {none})" if self.optional else ""
        said: dict[str, Any] = {"owner": owner, "none": self.none, self.name: value}
        if value is None:
            require(self.optional, given + " is invalid; give {valid}", valid=self._what(False), **said)
            return
        valid_type = (
            isinstance(value, bool)
            if self.kind is bool
            else (isinstance(value, (int, float) if self.kind is float else self.kind) and not isinstance(value, bool))
        )
        ranged = self.above is not None or self.at_most is not None
        require(
            valid_type and (self.kind is not float or math.isfinite(value)),
            given + " is invalid; it must be {valid}" + ("" if ranged else unset),
            valid=self.valid(),
            **said,
        )
        if self.choices is not None:
            choices = ", ".join(map(str, self.choices))
            require(value in self.choices, given + " is unknown; valid: {valid}", valid=choices, **said)
        in_range = (
            (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.at_most is None or value <= self.at_most)
        )
        if ranged:
            require(in_range, given + " is outside the valid range {valid}", valid=self._interval(), **said)
        require(in_range, given + " is invalid; it must be {valid}" + unset, valid=self._what(False), **said)

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
