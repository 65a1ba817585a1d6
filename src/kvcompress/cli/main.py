"""The parser of every command (each family's module adds its own) and ``main``: a library error shown in one line,
in the flags' words; an interrupt said truthfully."""

from __future__ import annotations

import argparse
import re
import sys

from rich.console import Console

from ..io.version import versions_line
from . import ask, bench, explore, library, serve
from .catalogue import method_names
from .common import Parser, command, starting
from .method_flags import given_method


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option's name in the library (its destination) and its flag, over the parser and its subcommands."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                flags.update(flag_names(child))
        elif action.option_strings and action.dest not in ("help", "version"):
            flags.setdefault(action.dest, max(action.option_strings, key=len))
    return flags


def in_flag_words(error: Exception, flags: dict[str, str]) -> str:
    """A library error in the command line's words: its own CLI wording where it has one, otherwise each
    ``name=value`` of a flag's name as ``--name value`` (``name=None``: ``no --name``); a method's description
    (``snapkv(budget=1024, ...)``, as files and stats name it) is left as it is."""
    if getattr(error, "cli", None):
        return error.cli

    def flag(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        if name not in flags:
            return match.group(0)
        return f"no {flags[name]}" if value == "None" else f"{flags[name]} {value.strip(chr(39))}"

    parts = re.split(r"(\b[a-z0-9_-]+\([^()]*=[^()]*\))", str(error).removeprefix("kvcompress: "))
    words = [
        part if index % 2 else re.sub(r"\b([a-z][a-z_]*)=('[^']*'|[^\s,;:()]+)", flag, part)
        for index, part in enumerate(parts)
    ]
    # a range: "valid: budget > 32", or against another setting: "valid: key_bits >= kv_bits"
    bound = re.compile(r"\bvalid: ([a-z][a-z_]*) ([<>]=?)(?: ([a-z][a-z_]*)\b)?")

    def in_range(match: re.Match) -> str:
        low, than, high = match.groups()
        return f"valid: {flags.get(low, low)} {than}" + (f" {flags.get(high, high)}" if high else "")

    words = [bound.sub(in_range, w) for w in words]
    return "".join(words).replace("(or None for the default)", "(or leave it out for the default)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line; ``generate`` and ``compress`` show the flags of the method ``argv`` names."""
    chosen = given_method(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog="kvcompress", description="KV-cache compression for transformers models", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=versions_line())
    sub = parser.add_subparsers(dest="command", required=True)
    ask.add_commands(sub, chosen)  # generate, chat, compress
    explore.add_commands(sub)  # methods, demo, observe
    bench.add_commands(command(sub, "bench", "benchmarks").add_subparsers(dest="bench", required=True))
    serve.add_command(sub, chosen)
    explore.add_fetch_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `serve MODEL ...`, as vllm serve takes it
    if argv[:1] == ["serve"] and len(argv) > 1 and not argv[1].startswith("-"):
        argv = ["serve", "--model", *argv[1:]]
    parser = build_parser(argv)
    chosen = given_method(argv)
    if chosen is not None and chosen not in method_names() and {"-h", "--help"} & set(argv):  # help for no method
        print(f"kvcompress: error: --method {chosen} is unknown; valid: {', '.join(method_names())}", file=sys.stderr)
        return 2
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.vllm_flags = rest  # serve: vLLM's own flags
    try:
        with starting():
            library.preload()  # (torch and transformers: seconds, only now that a command runs)
        console = Console() if sys.stdout.isatty() else Console(width=120)
        return args.run(args, console)
    except KeyboardInterrupt:
        if getattr(args, "printer", None) is not None and args.printer.shown:  # a streamed answer's line ended first
            print(flush=True)
        said = getattr(args, "interrupted", None)
        print(f"kvcompress: interrupted{said(args) if said else ''}", file=sys.stderr)
        return 130
    except Exception as err:
        if not isinstance(err, library.user_errors()):
            raise
        print(f"kvcompress: error: {in_flag_words(err, flag_names(parser))}", file=sys.stderr)
        return 2
