"""``bench accuracy``, ``bench speed``, ``bench headline`` and ``bench shared-context``: each benchmark's parser
beside its handler; a preset with the flags given put over it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import library as lib
from .catalogue import catalogue, method_names
from .common import Commands, Options, command, resumable, with_default

if TYPE_CHECKING:
    from rich.console import Console


def _int_list(text: str) -> list[int]:
    """``1k,2k,512`` -> ``[1000, 2000, 512]``."""
    values = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        try:
            values.append(int(float(part[:-1]) * 1000) if part.endswith("k") else int(part))
        except ValueError:
            raise lib.InvalidParameterError(f"{text!r} is not a comma-separated list of integers (1k = 1000)") from None
    return values


def _float_list(text: str) -> list[float]:
    """``0.1,0.5,0.9`` -> ``[0.1, 0.5, 0.9]``."""
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise lib.InvalidParameterError(f"{text!r} is not a comma-separated list of numbers") from None


def _names(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


_LIST_FLAGS = {
    "tasks": _names,
    "methods": _names,
    "budgets": _int_list,
    "lengths": _int_list,
    "batches": _int_list,
    "depths": _float_list,
}


def _with_flags(preset: dict, args: argparse.Namespace, flags: tuple[str, ...]) -> dict:
    """A benchmark's settings: ``preset``, with each of ``flags`` the user gave put over it (lists parsed)."""
    settings = dict(preset)
    for flag in flags:
        value = getattr(args, flag)
        if value:
            settings[flag] = _LIST_FLAGS[flag](value) if flag in _LIST_FLAGS else value
    return settings


def _accuracy_command(bench: Commands) -> None:
    """``bench accuracy``: the long-context accuracy matrix."""
    accuracy = command(bench, "accuracy", "long-context accuracy matrix: tasks x methods x budgets x lengths")
    accuracy.add_argument(
        "--preset",
        choices=catalogue()["accuracy_presets"],
        help="a named matrix (default quick); flags below override it",
    )
    accuracy.add_argument("--tasks", help=f"comma-separated: {', '.join(catalogue()['tasks'])}")
    accuracy.add_argument(
        "--methods",
        help="comma-separated method specs name[:field=value...], e.g. full,snapkv,snapkv:window=16 "
        f"({', '.join(method_names())})",
    )
    accuracy.add_argument(
        "--budgets",
        help="comma-separated budgets, applied to every method spec that has a budget and does not set it, "
        "e.g. 128,256",
    )
    accuracy.add_argument("--lengths", help="comma-separated prompt lengths in tokens, e.g. 1k,2k,4k")
    accuracy.add_argument(
        "--depths",
        help="comma-separated needle depths for the depth-grid tasks, 0 (start) to 1 (end), e.g. 0.1,0.5,0.9",
    )
    accuracy.add_argument("--samples", type=int, help="samples per task, length (and depth)")
    accuracy.add_argument("--seed", type=int, default=0)
    accuracy.add_argument(
        "--haystack",
        choices=catalogue()["haystacks"],
        help="haystack for needle tasks: standard-library prose (default), "
        "repeated filler (passkey's default) or Paul Graham's essays (RULER's; fetched on first use)",
    )
    accuracy.add_argument("--model", help="model path or name (default: the embedded model)")
    accuracy.add_argument(
        "--dataset", help="JSONL with context, input, answers (LongBench field names), scored with F1"
    )
    accuracy.add_argument(
        "--question-agnostic",
        action="store_true",
        help="compress each context without its question, then ask every question "
        "of the sample (its probes too) of its own copy (compress once, ask many)",
    )
    accuracy.add_argument(
        "--out", help="output folder (default runs/accuracy, or runs/accuracy-agnostic); rerunning with it resumes"
    )
    accuracy.set_defaults(run=_cmd_bench_accuracy, interrupted=resumable)


def _cmd_bench_accuracy(args: argparse.Namespace, console: Console) -> int:
    preset = _with_flags(
        lib.ACCURACY_PRESETS[args.preset or "quick"],
        args,
        ("tasks", "methods", "budgets", "lengths", "depths", "samples"),
    )
    if args.dataset and not args.tasks:
        preset["tasks"] = []
    model, tokenizer = lib.load_model(args.model)
    dataset = lib.load_dataset(args.dataset, tokenizer, limit=args.samples) if args.dataset else None
    # named if interrupted
    out = args.out = args.out or ("runs/accuracy-agnostic" if args.question_agnostic else "runs/accuracy")
    console.print(
        f"accuracy: tasks={preset['tasks']} methods={preset['methods']} budgets={preset['budgets']} "
        f"lengths={preset['lengths']} samples={preset['samples']} seed={args.seed}"
        f"{' question-agnostic' if args.question_agnostic else ''} -> {out}"
    )
    rows, written = lib.run_accuracy(
        model,
        tokenizer,
        preset["tasks"],
        preset["methods"],
        preset["budgets"],
        preset["lengths"],
        out,
        depths=preset["depths"],
        samples=preset["samples"],
        seed=args.seed,
        dataset=dataset,
        haystack=args.haystack,
        question_agnostic=args.question_agnostic,
    )
    console.print(lib.report.accuracy(rows))
    console.print(f"wrote {out}/{', '.join(written)}", soft_wrap=True)
    return 0


def _bench_model(name: str, dtype: str | None, console: Console) -> Any:
    """A speed benchmark's model: an architecture preset or config (random weights), 'embedded', or a model path."""
    import torch  # noqa: PLC0415 - the command line starts without torch

    dtype = getattr(torch, dtype) if dtype else None
    with console.status(f"building {name}"):
        if name == "embedded":
            return lib.load_model(dtype=dtype)[0]
        if name in lib.ARCHITECTURES or Path(name).exists():
            return lib.random_model(name, dtype=dtype)
        return lib.load_model(name, dtype=dtype)[0]


def _search_flags(searches: Options) -> None:
    """``bench speed``'s searches for the longest prompt and the largest batch that fit."""
    searches.add_argument(
        "--find-max-context",
        action="store_true",
        help="search each method's longest prompt that fits (first batch size)",
    )
    searches.add_argument(
        "--find-max-batch", action="store_true", help="search each method's largest batch that fits (first length)"
    )
    searches.add_argument(
        "--batch-limit",
        type=int,
        default=1024,
        help=with_default("largest batch --find-max-batch tries (each try is a whole prefill)"),
    )
    searches.add_argument(
        "--max-memory", type=float, help="GiB a run may peak at to count as fitting (required for searches on CPU)"
    )
    searches.add_argument(
        "--search-step",
        type=int,
        default=1024,
        help=with_default("the context search stops when the fitting and failing lengths are this close"),
    )


def _speed_command(bench: Commands) -> None:
    """``bench speed``: latency, throughput, memory, limits."""
    speed = command(bench, "speed", "decode latency, throughput, memory, max context / batch")
    speed.add_argument(
        "--preset",
        choices=catalogue()["speed_presets"],
        help="quick: embedded-model shape on CPU, 1K-8K; gpu: llama-3.1-8b, 16K-128K, batch 1-8",
    )
    speed.add_argument(
        "--model",
        help="architecture preset (smollm2-135m, llama-3.1-8b, mistral-7b), a config file, 'embedded', or a model path",
    )
    speed.add_argument(
        "--methods",
        help="comma-separated method specs name[:field=value...], e.g. full,snapkv,shadowkv:rank=64 "
        f"({', '.join(method_names())})",
    )
    speed.add_argument("--lengths", help="comma-separated prompt lengths, e.g. 1k,2k,4k")
    speed.add_argument("--batches", help="comma-separated batch sizes, e.g. 1,2,4,8")
    speed.add_argument(
        "--budget",
        type=int,
        help="budget for every method with one whose spec does not set it (default: each method's own)",
    )
    speed.add_argument("--steps", type=int, help="timed decoding steps per run")
    speed.add_argument("--warmup", type=int, help="untimed decoding steps before them")
    speed.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on GPU, float32 on CPU"
    )
    _search_flags(speed.add_argument_group("searches (the largest that fits)"))
    speed.add_argument(
        "--compile",
        action="store_true",
        help="decode with the compiled step (one graph per token; a CUDA graph on a GPU)",
    )
    speed.add_argument(
        "--prefill-tokens",
        type=int,
        default=catalogue()["prefill_tokens"],
        help=f"prefill a batch in groups of rows of at most this many tokens, "
        f"each compressed before the next (default {catalogue()['prefill_tokens']}; 0: all rows at once)",
    )
    speed.add_argument(
        "--replicate",
        action="store_true",
        help="prefill one prompt and copy its compressed cache to every row of a batch "
        "(the batch's decoding and memory at the cost of one prefill: batch searches at long prompts)",
    )
    speed.add_argument(
        "--repeats",
        type=int,
        default=1,
        help=with_default(
            "run the grid this many times, the methods' order reversed every other time, and report each run's "
            "median step and spread (CPU timings move between runs)"
        ),
    )
    speed.add_argument("--out", default="runs/speed")
    speed.set_defaults(run=_cmd_bench_speed, interrupted=resumable)


def _cmd_bench_speed(args: argparse.Namespace, console: Console) -> int:
    settings = _with_flags(
        lib.SPEED_PRESETS[args.preset or "quick"],
        args,
        ("model", "methods", "lengths", "batches", "budget", "steps", "warmup"),
    )
    model = _bench_model(settings["model"], args.dtype, console)
    grid = lib.SpeedGrid(
        settings["methods"],
        settings["lengths"],
        settings["batches"],
        budget=settings["budget"],
        steps=settings["steps"],
        warmup=settings["warmup"],
        find_max_context=args.find_max_context,
        find_max_batch=args.find_max_batch,
        max_memory=int(args.max_memory * 2**30) if args.max_memory else None,
        model_name=settings["model"],
        search_step=args.search_step,
        batch_limit=args.batch_limit,
        compile=args.compile,
        prefill_tokens=None if args.prefill_tokens == 0 else args.prefill_tokens,
        replicate=args.replicate,
        repeats=args.repeats,
    )
    results = lib.run_speed(model, grid, args.out)
    for shown in lib.report.speed(settings["model"], results, args.compile, args.out):
        console.print(shown, soft_wrap=isinstance(shown, str))
    return 0


def _headline_command(bench: Commands) -> None:
    """``bench headline``: the papers' speed headline against transformers' generate."""
    headline = command(
        bench,
        "headline",
        "the papers' speed headline: time to first token, decoding and memory against "
        "transformers' own generate on the same model and tokens",
    )
    headline.add_argument(
        "--preset",
        choices=catalogue()["headline_presets"],
        default="cpu",
        help=with_default(
            "cpu: the embedded model's shape (positions to 40K), 4K-32K, batch 1-2; gpu: llama-3.1-8b, the same grid"
        ),
    )
    headline.add_argument("--model", help="architecture preset, a config file, 'embedded', or a model path")
    headline.add_argument("--methods", help="comma-separated method specs name[:field=value...]")
    headline.add_argument("--lengths", help="comma-separated prompt lengths, e.g. 4k,16k")
    headline.add_argument("--batches", help="comma-separated batch sizes, e.g. 1,2")
    headline.add_argument("--steps", type=int, help="timed decoding steps per run")
    headline.add_argument("--warmup", type=int, help="untimed decoding steps before them")
    headline.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on GPU, float32 on CPU"
    )
    headline.add_argument("--compile", action="store_true", help="kvcompress decodes with the compiled step")
    headline.add_argument("--out", default="runs/headline")
    headline.set_defaults(run=_cmd_bench_headline, interrupted=resumable)


def _cmd_bench_headline(args: argparse.Namespace, console: Console) -> int:
    flags = ("model", "methods", "lengths", "batches", "steps", "warmup")
    settings = _with_flags(lib.HEADLINE_PRESETS[args.preset], args, flags)
    model = _bench_model(settings["model"], args.dtype, console)
    results = lib.run_headline(
        model,
        settings["methods"],
        settings["lengths"],
        settings["batches"],
        args.out,
        steps=settings["steps"],
        warmup=settings["warmup"],
        model_name=settings["model"],
        compile=args.compile,
    )
    for shown in lib.report.headline(settings["model"], results, args.compile, args.out):
        console.print(shown, soft_wrap=isinstance(shown, str))
    return 0


def _shared_context_command(bench: Commands) -> None:
    """``bench shared-context``: several questions over one context, as requests and as a conversation."""
    shared = command(
        bench,
        "shared-context",
        "several questions over one context (SCBench's multi-request and multi-turn modes): per-question "
        "compression against compress-once methods, scored by turn",
    )
    shared.add_argument("--model", help="model folder or name (default: the embedded model)")
    shared.add_argument(
        "--methods",
        default=catalogue()["shared_specs"],
        help=with_default("method specs; first:SPEC compresses the context with the first question and reuses it"),
    )
    shared.add_argument("--lengths", default="1k,2k,4k", help=with_default("context lengths in tokens"))
    shared.add_argument("--samples", type=int, default=2, help=with_default("contexts per length"))
    shared.add_argument("--facts", type=int, default=5, help=with_default("facts per context (a question each)"))
    shared.add_argument(
        "--fraction",
        type=float,
        default=1 / 16,
        help=with_default("each method's budget as a fraction of the context's tokens (unless its spec sets one)"),
    )
    shared.add_argument("--max-new-tokens", type=int, default=16, help=with_default("tokens per answer at most"))
    shared.add_argument(
        "--haystack", choices=catalogue()["haystacks"], default="essays", help=with_default("the text around the facts")
    )
    shared.add_argument("--out", default="runs/shared-context")
    shared.set_defaults(run=_cmd_bench_shared_context, interrupted=resumable)


def _cmd_bench_shared_context(args: argparse.Namespace, console: Console) -> int:
    if not 0 < args.fraction <= 1:
        raise lib.InvalidParameterError(f"--fraction {args.fraction} is invalid; give a number in (0, 1]")
    specs, lengths = _names(args.methods), _int_list(args.lengths)
    for spec in specs:
        lib.method_from_spec(spec.removeprefix("first:"))  # a bad spec is refused before any work
    model, tokenizer = lib.load_model(args.model)
    console.print(
        f"shared context: methods={specs} lengths={lengths} samples={args.samples} facts={args.facts} "
        f"budget={args.fraction:.4g} of each context -> {args.out}"
    )

    def progress(row: dict) -> None:
        agreed = "" if "agreement" not in row else f", agreement {[round(a, 3) for a in row['agreement']]}"
        console.print(
            f"{row['length']} tokens, sample {row['seed']}, {row['method']}, {row['mode']}: {row['scores']}{agreed}"
        )

    summary = lib.run_shared_context(
        model,
        tokenizer,
        specs,
        lengths,
        args.samples,
        args.facts,
        args.fraction,
        args.out,
        args.max_new_tokens,
        args.haystack,
        progress=progress,
    )
    for shown in lib.report.shared_context(summary, args.out):
        console.print(shown, soft_wrap=isinstance(shown, str))
    return 0


def add_commands(bench: Commands) -> None:
    """``bench accuracy``, ``bench speed``, ``bench headline`` and ``bench shared-context``."""
    _accuracy_command(bench)
    _speed_command(bench)
    _headline_command(bench)
    _shared_context_command(bench)
