"""``generate``, ``chat`` and ``compress``: a prompt answered, a document talked about, a document stored; each
command's parser beside its handler."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..cache.errors import flag_for
from . import library as lib
from .catalogue import catalogue, method_names
from .common import (
    Commands,
    check_output,
    command,
    prompt_flags,
    prompt_of,
    read_prompt,
    sampling_flags,
    unwritten,
    with_default,
)
from .method_flags import DEFAULT_METHODS, add_method_flags, given_settings, method_from_args, method_with_flags

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase

    from ..generation.conversation import Prompt
    from ..generation.result import Result
    from ..methods import Method


def _generate_command(sub: Commands, chosen: str | None) -> None:
    """``generate``: a prompt answered with a compressed cache (or a saved one continued)."""
    names = ", ".join(method_names())
    gen = command(sub, "generate", "answer a prompt with a compressed KV cache")
    gen.add_argument(
        "--method", help=f"one of: {names} (default {DEFAULT_METHODS['generate']}; `kvcompress methods` lists them)"
    )
    prompt_flags(gen, "prompt")
    gen.add_argument(
        "--question",
        help="compress the prompt without this question, then ask it (question-agnostic); "
        "with --past, the question asked of the saved context",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64, help=with_default("tokens to generate at most"))
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    gen.add_argument(
        "--compile",
        action="store_true",
        help="decode with one compiled graph per step (torch.compile; a CUDA graph on a GPU)",
    )
    gen.add_argument(
        "--past",
        help="continue a conversation saved by `kvcompress compress` or --save, with the method it was saved with "
        "(--prompt is the next question); with --method, a context stored with `compress --method full` is asked with "
        "that method instead: the question is prefilled over the stored context and compressed with it",
    )
    gen.add_argument("--save", help="write the conversation and its compressed cache to this file")
    gen.add_argument("--force", action="store_true", help="let --save replace an existing file")
    gen.add_argument("--stream", action="store_true", help="print the answer as its tokens come")
    sampling_flags(gen)
    add_method_flags(gen, "generate", chosen)
    gen.set_defaults(run=_cmd_generate, interrupted=lambda args: unwritten(args.save))


def _question_of(args: argparse.Namespace) -> str | None:
    if args.question is not None and not args.question.strip():
        raise lib.InvalidParameterError("--question is empty; give the question, or leave --question out")
    return args.question


def _past_question(args: argparse.Namespace) -> str:
    """With ``--past``: the question asked of the saved context (``--prompt``/``--prompt-file``, or ``--question``)."""
    if args.question is not None and (args.prompt is not None or args.prompt_file is not None):
        raise lib.InvalidParameterError(
            "with --past, give the question once: --prompt (or --prompt-file) or --question, not both"
        )
    question = _question_of(args)
    return question if question is not None else prompt_of(args)


def _past_method(args: argparse.Namespace) -> Method | None:
    """``--past FILE`` with ``--method``: that method (each question compressed over the stored context with it);
    without, None (settled once the file is loaded: ``_asked_with``). Method flags without ``--method`` that differ
    from the file's are refused before any work."""
    if args.method is not None:
        return method_from_args(args.method, args)
    saved = lib.saved_method(args.past)
    differ = {key: value for key, value in given_settings(args).items() if getattr(saved, key, None) != value}
    if differ:
        flags = " ".join(f"{flag_for(key)} {value}" for key, value in differ.items())
        raise lib.InvalidParameterError(
            f"{args.past} was compressed with {saved.describe()}, and --past keeps it: {flags} would not apply (leave "
            "them out, or name --method to compress each question over the context with its own method)"
        )
    return None


def _fed(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, text: str) -> Prompt:
    """The text as the model is fed it: raw with ``--raw`` or where the tokenizer has no chat template (a base model,
    e.g. gemma3-270m), else the user's message in the template."""
    return text if args.raw else lib.user_prompt(tokenizer, text)


def _check_raw(args: argparse.Namespace, past: Result) -> None:
    """``--raw`` over a ``--past`` file in the chat template is refused (a question takes the file's format)."""
    if args.raw and any(row.chat for row in past.rows):
        raise lib.InvalidParameterError(
            f"--raw asks in raw text, and {args.past} holds a document in the chat template: leave --raw out (a "
            "question over a file takes the file's format)"
        )


def _asked_with(args: argparse.Namespace, past: Result, method: Method | None) -> Method | None:
    """The method a question over a loaded ``--past`` file is asked with: a file that holds its document whole
    (a stored document, or a saved chat with its document) compresses every question over it, with ``--method`` or
    else the method the file was saved with; a file that keeps only its method's selection is continued (``--method``
    naming the file's own settings agrees with it)."""
    _check_raw(args, past)
    saved = past.method
    if past.question_store() is None:
        return None if method == saved else method
    return saved if method is None and past.store is not None else method


def _cmd_generate(args: argparse.Namespace, console: Console) -> int:
    if args.save:
        check_output("--save", args.save, args.force, {"--prompt-file": args.prompt_file, "--past": args.past})
    if args.stream and args.json:
        raise lib.InvalidParameterError("--stream prints the answer as it comes and --json prints it once: give one")
    options = {
        "max_new_tokens": args.max_new_tokens,
        "compile": args.compile,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
    }
    quiet = args.json or args.stream
    # a saved context: continued with its method, or each question compressed over it with --method
    question: str | None
    if args.past is not None:
        question = _past_question(args)
        method = _past_method(args)
        model, tokenizer = lib.load_model(args.model)
        past = lib.load(args.past, model, tokenizer)
        method = _asked_with(args, past, method)
        with contextlib.nullcontext() if quiet else console.status(f"answering over {args.past}"):
            result = lib.generate(
                model, tokenizer, question, past=past, method=method, streamer=_streamer(args, tokenizer), **options
            )
    else:
        prompt, question = prompt_of(args), _question_of(args)  # (a question: None, or asked after the prompt)
        method = method_from_args(args.method or DEFAULT_METHODS["generate"], args)
        model, tokenizer = lib.load_model(args.model)
        messages = _fed(args, tokenizer, prompt)
        with contextlib.nullcontext() if quiet else console.status(f"generating with {method.describe()}"):
            result = lib.generate(
                model,
                tokenizer,
                messages,
                method=method,
                question=question,
                streamer=_streamer(args, tokenizer),
                **options,
            )
    if args.save:
        result.save(args.save)
    if args.json:
        print(json.dumps({"text": result.text, **result.stats}))
    else:
        if not args.stream:
            console.print(result.text)
        console.print(lib.report.stats_table(result.stats))
    return 0


def _streamer(args: argparse.Namespace, tokenizer: Any) -> Any:
    from ..chat import Printer  # noqa: PLC0415 - the interactive front, loaded when asked for

    # (an interrupt ends its line)
    args.printer = Printer(tokenizer, sys.stdout, lib.Stops.of(args.stop, tokenizer)) if args.stream else None
    return args.printer


def _chat_command(sub: Commands, chosen: str | None) -> None:
    """``chat``: a conversation over a document, every turn compressed per question."""
    names = ", ".join(method_names())
    chat = command(sub, "chat", "talk about a document: every message compressed with the conversation so far")
    chat.epilog = (
        "In the session: /save FILE writes the conversation (with its document; --past FILE continues "
        "it), /reset forgets the conversation and keeps the document, /quit or Ctrl-D ends; Ctrl-C stops "
        'an answer, not the session. A line of """ alone opens a message of several lines, another closes '
        "it; lines are edited and recalled as in a shell (readline)."
    )
    chat.add_argument("--method", help=f"one of: {names} (default {DEFAULT_METHODS['generate']})")
    chat.add_argument("--model", help="model folder or name (default: the embedded SmolLM2-135M-Instruct)")
    chat.add_argument("--prompt-file", help="the document (UTF-8), stored once")
    chat.add_argument("--past", help="a stored document (`kvcompress compress --method full`) or a saved chat")
    chat.add_argument("--raw", action="store_true", help="store the document as raw text, without the chat template")
    chat.add_argument("--max-new-tokens", type=int, default=256, help=with_default("tokens per answer at most"))
    sampling_flags(chat)
    add_method_flags(chat, "generate", chosen)
    chat.set_defaults(run=_cmd_chat)


def _cmd_chat(args: argparse.Namespace, console: Console) -> int:
    from ..chat import chat, stored_document  # noqa: PLC0415 - the interactive front, loaded when asked for

    if (args.prompt_file is None) == (args.past is None):
        raise lib.InvalidParameterError("give the document as --prompt-file or a stored one as --past (one of them)")
    method = (
        None
        if args.method is None and args.past is not None
        else method_from_args(args.method or DEFAULT_METHODS["generate"], args)
    )
    if method is not None:
        lib.check_per_question(method)  # (before any work)
    model, tokenizer = lib.load_model(args.model)
    if args.past is not None:
        opened = lib.load(args.past, model, tokenizer)
        stored_document(opened)  # (a file that cannot be asked per question: refused before the first question)
        _check_raw(args, opened)
        if method is None:  # a saved chat goes on with its method, a stored document with the default
            saved = opened.method if opened.store is not None else lib.method_class(DEFAULT_METHODS["generate"])()
            method = method_with_flags(saved, args)
            lib.check_per_question(method)
    else:
        document = read_prompt(args.prompt_file)
        if not document.strip():
            raise lib.InvalidParameterError(
                f"--prompt-file {args.prompt_file} is empty; give the document to talk about"
            )
        with console.status("storing the document"):
            opened = lib.compress(model, tokenizer, _fed(args, tokenizer, document), method=lib.FullKV())
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "stop": args.stop}
    return chat(model, tokenizer, opened, cast("Method", method), args.max_new_tokens, sampling)  # (set either way)


def _compress_command(sub: Commands, chosen: str | None) -> None:
    """``compress``: a document compressed once and saved, to be asked later."""
    names = ", ".join(method_names())
    comp = command(
        sub, "compress", "compress a document once, with no question, and save it (ask later with generate --past)"
    )
    comp.add_argument(
        "--method",
        help=f"one of: {names} (default {DEFAULT_METHODS['compress']}, a question-agnostic scorer: "
        "docs/accuracy.md compares them)",
    )
    prompt_flags(comp, "document")
    comp.add_argument("--out", required=True, help="the file to write (safetensors; it holds the document's text too)")
    comp.add_argument("--force", action="store_true", help="let --out replace an existing file")
    comp.add_argument(
        "--query-window",
        type=query_window,
        default="auto",
        metavar="N|all",
        help=with_default(
            "the document's last prefill queries kept, for methods that later score a question with "
            f"queries before it (all: every one, as H2O needs; default: the last {catalogue()['query_window']} where "
            "the document keeps every token)"
        ),
    )
    add_method_flags(comp, "compress", chosen)
    comp.set_defaults(run=_cmd_compress, interrupted=lambda args: unwritten(args.out))


def query_window(text: str) -> int | str | None:
    """``--query-window``: a count of queries, ``all`` (None), or ``auto`` (the default)."""
    if text in ("all", "auto"):
        return None if text == "all" else text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; give a count of queries >= 0, or all")
    return int(text)


def _cmd_compress(args: argparse.Namespace, console: Console) -> int:
    check_output("--out", args.out, args.force, {"--prompt-file": args.prompt_file})
    prompt = prompt_of(args)
    method = method_from_args(args.method or DEFAULT_METHODS["compress"], args)
    model, tokenizer = lib.load_model(args.model)
    with console.status(f"compressing with {method.describe()}"):
        fed = _fed(args, tokenizer, prompt)
        result = lib.compress(model, tokenizer, fed, method=method, query_window=args.query_window)
        result.save(args.out)
    console.print(lib.report.compressed(args.out, Path(args.out).stat().st_size, result.stats), soft_wrap=True)
    return 0


def add_commands(sub: Commands, chosen: str | None) -> None:
    """``generate``, ``chat`` and ``compress`` (``chosen``: the method whose flags their help shows)."""
    _generate_command(sub, chosen)
    _chat_command(sub, chosen)
    _compress_command(sub, chosen)
