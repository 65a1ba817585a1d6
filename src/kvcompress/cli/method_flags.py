"""A method's flags, built and refused in one place: one flag per field of the chosen method (typed, ranged and
described by its ``param`` declaration), the others parsed out of sight so that a flag the method does not take is
refused by name."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from . import library as lib
from .catalogue import Field, method_defaults, method_fields, method_names

if TYPE_CHECKING:
    from ..methods import Method


def method_flag_owners() -> dict[str, list[tuple[str, Field]]]:
    """Every method's field (the built-in ones and any registered in this process), by field name: which methods
    take it and how they describe it."""
    owners: dict[str, list[tuple[str, Field]]] = defaultdict(list)
    for name in method_names():
        for spec in method_fields(name):
            owners[spec.name].append((name, spec))
    return owners


# compress: the context alone, so a question-agnostic scorer
DEFAULT_METHODS = {"generate": "snapkv", "compress": "kvzip", "serve": "snapkv"}


def given_method(argv: list[str]) -> str | None:
    """The ``--method`` named on a command line, if any (the parser's method flags follow it)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--method")
    return pre.parse_known_args(argv)[0].method


def add_method_flags(parser: argparse.ArgumentParser, command: str, chosen: str | None) -> None:
    """One flag per field of the chosen method (``--budget``, ``--window``, ...), typed, ranged and
    described by that method's field, its default shown. Other methods' fields are parsed too, out of
    sight, so that ``method_from_args`` refuses them by name."""
    shown = DEFAULT_METHODS[command] if chosen is None else chosen if chosen in method_names() else None
    specs = {spec.name: spec for spec in method_fields(shown)} if shown else {}
    defaults = method_defaults(shown) if shown else {}
    shows = f"`kvcompress {command} --method NAME --help` shows another's"
    note = f" (the default method; {shows})" if chosen is None else ""
    group = parser.add_argument_group(f"settings of --method {shown}{note}" if shown else "method settings")
    for field, owners in method_flag_owners().items():
        spec = specs.get(field)
        if spec is None:
            hidden: dict[str, Any] = {"default": None, "help": argparse.SUPPRESS}
            if owners[0][1].kind is bool:
                group.add_argument(owners[0][1].flag, action=argparse.BooleanOptionalAction, **hidden)
            else:
                group.add_argument(owners[0][1].flag, **hidden)
            continue
        default = defaults.get(field)
        text = f"{spec.help}; {spec.valid}" + (f" (default: {default})" if default is not None else "")
        options: dict[str, Any] = {"default": None, "help": text.replace("%", "%%")}
        if spec.kind is bool:
            group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **options)
        else:
            metavar = None if spec.choices else spec.kind.__name__.upper()
            kind = number if spec.kind is float else spec.kind
            group.add_argument(spec.flag, type=kind, choices=spec.choices, metavar=metavar, **options)


def number(text: str) -> float:
    """A float flag's value: a decimal, or a fraction (``--kv-bytes 1/64``, ``--ratio 1/16``)."""
    top, slash, bottom = text.partition("/")
    if not slash:
        return float(text)
    if float(bottom) == 0:
        raise ValueError(f"{text!r} divides by zero")
    return float(top) / float(bottom)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The method settings given on the command line, by field name."""
    return {field: getattr(args, field) for field in method_flag_owners() if getattr(args, field, None) is not None}


def flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The method settings the flags give (``given_settings``), ``--kv-format fp8`` alone meaning 8 bits, the only
    width it has."""
    given = given_settings(args)
    if given.get("kv_format") == "fp8" and "kv_bits" not in given:
        given["kv_bits"] = 8
    return given


def method_from_args(name: str, args: argparse.Namespace) -> Method:
    """The method ``name`` with the flags given on the command line (the library's ``method_from_name`` refuses a
    flag it does not take, in the flags' words)."""
    return lib.method_from_name(name, **flag_settings(args))


def method_with_flags(method: Method, args: argparse.Namespace) -> Method:
    """``method`` with the method flags given on the command line in place of its settings (one it does not take
    refused by name)."""
    method_from_args(method.name, args)
    return dataclasses.replace(method, **flag_settings(args))
