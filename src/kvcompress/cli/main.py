"""The parser of every command (each family's module adds its own) and ``main``: a library error shown in one line,
in the flags' words; an interrupt said truthfully."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from rich.console import Console

from ..cache.errors import flag_for
from ..io.version import versions_line
from . import ask, bench, explore, library, serve
from .catalogue import method_names
from .common import Parser, command, starting
from .method_flags import given_method


def in_flag_words(error: Exception, options: Iterable[str]) -> str:
    """A library error in the command line's words: a refusal (``cache.errors.Said``) with each setting it names
    spelled as the flag of the command that ran (``options``: its parsed options' names; a setting it has no flag for
    as the library says it), from the refusal's own fields; any other error as it says itself."""
    if isinstance(error, library.Said):
        flags = set(options)
        text = error.in_words(lambda name: flag_for(name) if name in flags else None)
    else:
        text = str(error)
    return text.removeprefix("kvcompress: ")


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
        print(f"kvcompress: error: {in_flag_words(err, vars(args))}", file=sys.stderr)
        return 2
