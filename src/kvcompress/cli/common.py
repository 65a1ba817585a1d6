"""What every command shares: the one-line-error parser, help with defaults, outputs checked before any work,
prompts read from flags or files, the sampling flags."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn, Protocol

from . import library as lib


def _stop_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write("kvcompress: interrupted while starting; nothing was done\n")
    sys.stderr.flush()
    os._exit(130)  # nothing has run yet: no state to unwind, and no import left half done to trip over


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Ctrl-C within: one line and exit (the heavy imports, torch and transformers, take seconds, and some libraries
    turn an interrupted import into other errors)."""
    previous = signal.signal(signal.SIGINT, _stop_while_starting)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Parser(argparse.ArgumentParser):
    """A parser whose errors are one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Options(Protocol):
    """Where options are added: a parser, or one of its argument groups."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...


class Commands(Protocol):
    """A command's subcommands, as ``add_subparsers`` returns them and the command families add theirs."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def with_default(text: str) -> str:
    """An option's help with its default said (argparse fills ``%(default)s``), for an option whose default is worth
    reading (not None or False)."""
    return f"{text} (default: %(default)s)".strip()


def command(sub: Commands, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, allow_abbrev=False)


def resumable(args: argparse.Namespace) -> str:
    return f"; results so far are in {args.out} and rerunning the same command resumes"


def check_output(flag: str, path: str, force: bool, inputs: dict[str, str | None]) -> None:
    """Before any work: ``path`` can be written, is none of the ``inputs`` (flag -> file) and, unless
    ``force``, does not exist yet."""
    target = Path(path)
    for name, given in inputs.items():
        if given is not None and Path(given).resolve() == target.resolve():
            raise lib.InvalidParameterError(f"{flag} {path} is the input file ({name}); write to another file")
    if target.is_dir():
        raise lib.InvalidParameterError(f"{flag} {path} is a folder; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise lib.InvalidParameterError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise lib.InvalidParameterError(f"{flag} {path}: the folder {folder} is not writable")
    if target.exists() and not force:
        raise lib.InvalidParameterError(f"{flag} {path} exists; add --force to replace it")


def unwritten(path: str | None) -> str:
    """What an interrupted command left of the file it was to write (``Result.save`` replaces a file whole)."""
    if path is None:
        return ""
    return f"; {path} is unchanged" if Path(path).exists() else f"; nothing was written to {path}"


def read_prompt(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise lib.InvalidParameterError(
            f"--prompt-file {path}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    except OSError as error:
        raise lib.InvalidParameterError(f"--prompt-file {path}: {error.strerror or error}") from None


def prompt_of(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise lib.InvalidParameterError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if args.prompt is not None:
        text, source = args.prompt, "--prompt"
    else:
        text, source = read_prompt(args.prompt_file), f"--prompt-file {args.prompt_file}"
    if not text.strip():
        raise lib.InvalidParameterError(
            f"{source} is empty; give the text to {'compress' if args.command == 'compress' else 'answer'}"
        )
    return text


def prompt_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--model", help="model folder or name (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", help=f"the {what} text (sent as a user chat message)")
    parser.add_argument("--prompt-file", help=f"read the {what} from this file (UTF-8)")
    parser.add_argument("--raw", action="store_true", help=f"feed the {what} as raw text, without the chat template")


def sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature instead of the greedy choice (0: greedy)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help=with_default("sample from the most probable tokens until their probability reaches this"),
    )
    parser.add_argument("--seed", type=int, help="the sampling seed (the same seed repeats an answer)")
    parser.add_argument(
        "--stop",
        action="append",
        type=stop_string,
        help="end the answer before this string (repeat for several), its escapes read as Python "
        "reads them: --stop '\\n' is a newline (for a base model), '\\\\n' a backslash and an n",
    )


def stop_string(text: str) -> str:
    """``--stop``: the string with its backslash escapes read as in a Python string (``\\n``, ``\\t``, ``\\x41``,
    ``\\u00e9``), since a shell passes ``'\\n'`` as a backslash and an n; other characters as they are."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} has an unfinished escape ({error.reason}); write a backslash as \\\\"
        ) from None
