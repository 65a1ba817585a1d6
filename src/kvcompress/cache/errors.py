"""The library's refusals: ``Said``, a message that names the settings it refuses as data, and the cache's two errors.

A refusal's message is a template over its values (``string.Formatter``'s fields, read by its own parser, never a
regular expression over the text): ``{budget=}`` is the setting ``budget`` with the value given for it, ``{kv_bits=8}``
a setting with the value written there (a remedy), ``{budget!n}`` the setting's name alone, ``{unset}`` how a setting
is left to its default, and ``{owner}`` (any other field, with a conversion and format spec as ``str.format`` takes
them) a plain value; a refusal given no values is plain text, never parsed. ``str(error)`` says it in the library's
words (``budget=0``, ``kv_format='fp8'``, ``None``); the command line says it in its flags' (``--budget 0``,
``--kv-format fp8``, ``no --decode-budget``, ``leave it out``) through ``in_words``, from the same fields.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

Spell = Callable[[str], "str | None"]  # a setting's flag on the command line (None: it has none)
_NO_VALUE = object()


def _said(template: str, values: dict[str, Any], flag_of: Spell | None) -> str:
    """``template`` with its fields filled: settings in the library's words (``flag_of`` None) or the flags'; a
    template with no values is plain text."""
    if not values:
        return template
    words = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        words.append(literal)
        if field is None:
            continue
        name, setting, written = field.partition("=")
        if conversion == "n":
            words.append(_name(name, flag_of))
        elif setting:
            words.append(_setting(name, values[name] if not written else _NO_VALUE, written, flag_of))
        elif name == "unset" and name not in values:
            words.append("None" if flag_of is None else "leave it out")
        else:
            value = values[name]
            words.append(format(repr(value) if conversion == "r" else value, spec or ""))
    return "".join(words)


def _name(name: str, flag_of: Spell | None) -> str:
    flag = None if flag_of is None else flag_of(name)
    return flag or name


def _setting(name: str, value: Any, written: str, flag_of: Spell | None) -> str:
    """``name=value`` (``written``: the value as the template wrote it, a remedy), or its flag with the value."""
    shown = written if value is _NO_VALUE else repr(value)
    flag = None if flag_of is None else flag_of(name)
    if flag is None:
        return f"{name}={shown}"
    if value is None or written == "None":
        return f"no {flag}"
    if isinstance(value, bool) or written in ("True", "False"):
        return flag if value is True or written == "True" else f"--no-{flag.removeprefix('--')}"
    return f"{flag} {shown.strip(chr(39))}"


def flag_for(name: str) -> str:
    """A setting's command-line flag (``kv_bits`` -> ``--kv-bits``): how the CLI spells every setting it takes."""
    return "--" + name.replace("_", "-")


class Said(Exception):
    """An error whose message names the settings it refuses as data (module docstring): ``template``, ``values``;
    ``cli``: the whole refusal in the command line's words where its remedy is another one, not only other
    spellings (a flag for a Python call)."""

    def __init__(self, template: str, /, *, cli: str | None = None, **values: Any) -> None:
        self.template, self.values, self.cli = template, values, cli
        super().__init__(_said(template, values, None))

    def __reduce__(self) -> tuple[Any, ...]:  # across processes (vLLM's workers): remade from its fields
        return (_remade, (type(self), self.template, self.values, self.cli))

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the message names with a value, in order (the refused one first)."""
        if not self.values:
            return {}
        named = (field for _, field, _, _ in string.Formatter().parse(self.template) if field and "=" in field)
        return {name: self.values.get(name, written) for name, _, written in (f.partition("=") for f in named)}

    def in_words(self, flag_of: Spell) -> str:
        """The message with each setting spelled by ``flag_of`` (a setting without a flag as the library says it)."""
        return self.cli or _said(self.template, self.values, flag_of)


def _remade(kind: type[Said], template: str, values: dict[str, Any], cli: str | None) -> Said:
    return kind(template, cli=cli, **values)


class UnsupportedModelError(Said, ValueError):
    """The model (or one of its settings) cannot be used with kvcompress."""


class CacheMisuseError(Said, ValueError):
    """A cache was used for something it cannot hold (a second prompt, another model, ...)."""
