"""``kvcompress bench shared-context``: several questions over one context, SCBench's two modes.

SCBench (Li et al., 2025, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods") asks many
questions of one shared context, in two modes: *multi-request* (each question its own request over the
context's cache) and *multi-turn* (the questions are one conversation). It found that methods whose
memory is below O(n) fail there, and that a selection made for one query degrades the next ones. The
tasks here are generated (seeded, lengths in the model's own tokens), in the spirit of its retrieval
tasks: a context of essays with facts placed at spread depths (``The code of the red fox is 4817.``),
one question per fact, and in a conversation a last question that refers to an earlier answer ("the
code you gave for the first animal I asked about").

Methods are specs (``name[:field=value...]``) in three kinds, by how they meet a second question:

* *per question* (``snapkv``, ``h2o``, ``streamingllm``, the full cache): the context is stored whole
  once, each question (with the conversation so far, in a conversation) is prefilled over it and
  compressed with it (``generate(past=..., method=...)``);
* *compress once* (``kvzip``, ``expected``): the context compressed before any question, every question
  then appended to (a copy of) that cache;
* ``first:SPEC``: the context and the first question compressed together by SPEC, later questions
  appended to that selection: the reuse SCBench shows failing.

A method's budget, unless its spec sets one, is ``--fraction`` of each context's tokens (1/16 by
default). Beside right answers, a per-question method is measured against the full cache itself, token by token
(issue 67): at each turn the full cache's own answer is teacher-forced under the method (``forced_logprobs``), the
conversation so far being the full cache's (so a turn's figure is not moved by an earlier turn's divergence):
top-1 agreement and mean KL per turn, with 95% bootstrap intervals over contexts. Outputs: ``results.jsonl`` (one
line per method and mode; rerunning resumes), ``summary.json`` (score per method, mode and turn, against the full
cache's, and agreement, over all turns too, with the bytes each method's cache held as a share of the 16-bit
cache's), ``shared_context.png``, and ``agreement_vs_bytes.png`` (the frontier: agreement against bytes held, a
curve per setting over its budgets, e.g. ``snapkv:kv_bits=4`` at several ratios beside ``snapkv`` at several
``kv_bytes``).
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..generation.conversation import as_asked, user_prompt
from ..generation.generate import compress, generate
from ..generation.result import Result
from ..methods import BUDGET_FIELDS, FullKV, Method, method_from_spec, sets_budget
from .agreement import MODES, FullAnswers, agreement
from .haystack import fill
from .metrics import bootstrap_interval

COLORS = ("red", "blue", "green", "yellow", "white", "black", "grey", "brown")
ANIMALS = ("fox", "owl", "horse", "otter", "crane", "lynx", "heron", "badger")
COMPRESS_ONCE = ("kvzip", "expected")
DEFAULT_SPECS = "full,snapkv,h2o,snapkv:heads=adaptive,streamingllm,kvzip,expected,first:snapkv"


@dataclass
class Sample:
    """One shared context and its questions, each with the text its answer must contain."""

    length: int
    seed: int
    context: str
    questions: list[tuple[str, str]]


def make_sample(
    tokenizer: PreTrainedTokenizerBase, length: int, seed: int, facts: int, haystack: str = "essays"
) -> Sample:
    """``facts`` codes of distinct animals at spread depths of about ``length`` tokens of ``haystack`` text
    (``bench.haystack``); a question per fact (in a shuffled order), then one that refers to the first answer."""
    rng = random.Random(f"{length}-{seed}")  # each length's samples their own facts
    names = rng.sample([f"{c} {a}" for c in COLORS for a in ANIMALS], facts)
    codes = [str(rng.randrange(1000, 10000)) for _ in names]
    depths = [(i + 0.5) / facts for i in range(facts)]
    context = fill(
        tokenizer,
        length,
        [(d, f"The code of the {n} is {c}.") for d, n, c in zip(depths, names, codes)],
        kind=haystack,
        seed=seed,
    )
    order = rng.sample(range(facts), facts)
    questions = [(f"What is the code of the {names[i]}? Answer with the code.", codes[i]) for i in order]
    questions.append(("Repeat the code you gave in your first answer.", codes[order[0]]))
    return Sample(length, seed, context, questions)


def asked(tok: PreTrainedTokenizerBase, sample: Sample) -> list[str]:
    """``sample``'s questions as the model is asked them (``as_asked``: a base model's cued in plain text)."""
    return [as_asked(tok, question) for question, _ in sample.questions]


def said(tok: PreTrainedTokenizerBase, text: str) -> str:
    """What an answer says: a chat model's whole turn; a base model's first line (it has no end of turn, and runs
    on into questions of its own)."""
    return text if tok.chat_template else text.strip().split("\n")[0]


def answered(text: str, code: str) -> int:
    """1 when ``text`` gives ``code`` as a whole number ("98837" does not give 9883), else 0."""
    return int(re.search(rf"(?<!\d){code}(?!\d)", text) is not None)


def kind_of(spec: str) -> str:
    """``first`` (compressed with the first question, reused), ``once`` (compressed before any question) or
    ``per-question``."""
    if spec.startswith("first:"):
        return "first"
    return "once" if spec.split(":")[0] in COMPRESS_ONCE else "per-question"


def resolved(spec: str, tokens: int, fraction: float) -> Method:
    """The method a spec names, with ``fraction`` of the context's tokens as its budget unless it sets one."""
    method = method_from_spec(spec.removeprefix("first:"))
    if "budget" in vars(method) and not sets_budget(spec.removeprefix("first:")):
        method = method_from_spec(f"{spec.removeprefix('first:')}:budget={max(16, round(tokens * fraction))}")
    return method


def sixteen_bit_share(stats: dict) -> float:
    """The bytes of the rows a cache held (codes and scales, or the model's precision; an answer's tokens included)
    as a share of the same tokens' 16-bit rows in the full cache: ``kv_kept_fraction`` counts the model's own
    precision (float32 on a CPU)."""
    return stats["kv_kept_fraction"] * getattr(torch, stats["kv_dtype"]).itemsize / 2


def ask_all(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    sample: Sample,
    spec: str,
    mode: str,
    fraction: float,
    store: Result,
    max_new_tokens: int,
) -> tuple[list[str], list[float]]:
    """Every answer of ``sample``'s questions with ``spec`` in ``mode`` (the last question, which refers to an
    earlier answer, only in a conversation), and the bytes each answer's cache held (``sixteen_bit_share``)."""
    questions = asked(tok, sample)[: None if mode == "multi-turn" else -1]
    method = resolved(spec, int(store.attention_mask.sum()), fraction)
    kind, answers, held = kind_of(spec), [], []
    if kind == "once":
        base = compress(model, tok, user_prompt(tok, sample.context), method=method)
    elif kind == "first":
        first = generate(
            model,
            tok,
            user_prompt(tok, sample.context + "\n\n" + questions[0]),
            method=method,
            max_new_tokens=max_new_tokens,
        )
        answers.append(cast(str, first.text))
        held.append(sixteen_bit_share(first.stats))
        base, questions = first, questions[1:]
    turn = base if kind != "per-question" else store
    for question in questions:
        if kind == "per-question":
            past = store if mode == "multi-request" else turn
            turn = generate(model, tok, question, past=past, method=method, max_new_tokens=max_new_tokens)
        else:
            past = base.copy() if mode == "multi-request" else turn
            turn = generate(model, tok, question, past=past, max_new_tokens=max_new_tokens)
        answers.append(cast(str, turn.text))  # (one question: one answer)
        held.append(sixteen_bit_share(turn.stats))
    return answers, held


def run_shared_context(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    specs: list[str],
    lengths: list[int],
    samples: int,
    facts: int,
    fraction: float,
    out_dir: str,
    max_new_tokens: int = 16,
    haystack: str = "essays",
    progress: Any = None,
) -> dict:
    """The grid: per length and sample, the context stored once, then each method in each mode; rows appended to
    ``results.jsonl`` as they come (a rerun skips what is there)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "results.jsonl"
    done = {(r["length"], r["seed"], r["method"], r["mode"]) for r in journal_rows(journal)}
    for length in lengths:
        for seed in range(samples):
            sample = make_sample(tok, length, seed, facts, haystack)
            store, full = None, None
            for spec in specs:
                for mode in MODES:
                    if (length, seed, spec, mode) in done:
                        continue
                    if store is None:  # every prefill query kept: H2O and ExpectedAttention score with them all
                        store = compress(
                            model, tok, user_prompt(tok, sample.context), method=FullKV(), query_window=None
                        )
                    answers, held = ask_all(model, tok, sample, spec, mode, fraction, store, max_new_tokens)
                    row = {
                        "length": length,
                        "seed": seed,
                        "method": spec,
                        "mode": mode,
                        "kind": kind_of(spec),
                        "tokens": int(store.attention_mask.sum()),
                        "scores": [
                            answered(said(tok, text), code) for text, (_, code) in zip(answers, sample.questions)
                        ],
                        "answers": answers,
                        "kv16": sum(held) / len(held),
                    }
                    if kind_of(spec) == "per-question":
                        full = full or FullAnswers(
                            model, tok, store, asked(tok, sample), max_new_tokens, requests=len(sample.questions) - 1
                        )
                        fidelities = agreement(full, resolved(spec, cast(int, row["tokens"]), fraction), mode)
                        row.update(
                            agreement=[f["top1_agreement"] for f in fidelities], kl=[f["kl"] for f in fidelities]
                        )
                    with journal.open("a") as fh:
                        fh.write(json.dumps(row) + "\n")
                    if progress is not None:
                        progress(row)
    return write_summary(out, specs)


def write_summary(out: Path, specs: list[str] | None = None) -> dict:
    """``summary.json`` and the PNG of ``out``'s journal, for ``specs`` (every method in it when None: rows of
    kvpress's presses appended by ``scripts/peers/kvpress_agnostic.py score`` too)."""
    rows = journal_rows(out / "results.jsonl")
    summary = summarize(rows, specs if specs is not None else list(dict.fromkeys(r["method"] for r in rows)))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "shared_context.png")
    plot_frontier(summary, out / "agreement_vs_bytes.png")
    return summary


def journal_rows(journal: Path) -> list[dict]:
    """The rows of a ``results.jsonl`` journal (none when it does not exist yet)."""
    return [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []


def summarize(rows: list[dict], specs: list[str]) -> dict:
    """Per mode, method and turn: the share of answers right, and its ratio to the full cache's at that turn."""
    scores: dict[tuple[str, str], list[list[int]]] = defaultdict(list)
    for row in rows:
        scores[(row["mode"], row["method"])].append(row["scores"])
    summary: dict[str, Any] = {}
    for mode in MODES:
        table = {}
        for spec in specs:
            runs = scores.get((mode, spec), [])
            if not runs:  # e.g. kvpress's presses, run in the multi-request mode only
                continue
            turns = max((len(r) for r in runs), default=0)
            table[spec] = [
                sum(r[t] for r in runs if len(r) > t) / max(1, sum(len(r) > t for r in runs)) for t in range(turns)
            ]
        full = table.get("full", [])
        summary[mode] = {
            spec: {
                "score": by_turn,
                "of_full": [s / f if f else None for s, f in zip(by_turn, full)] if full else [None] * len(by_turn),
                **turn_agreement([r for r in rows if r["mode"] == mode and r["method"] == spec]),
            }
            for spec, by_turn in table.items()
        }
    return summary


def turn_agreement(rows: list[dict]) -> dict[str, list]:
    """Per turn over ``rows`` (one method and mode) that measured it: mean top-1 agreement with the full cache,
    its 95% bootstrap interval over contexts, and mean KL; nothing where no row did."""
    measured = [r for r in rows if "agreement" in r]
    if not measured:
        return {}
    turns = max(len(r["agreement"]) for r in measured)
    by_turn = [[r["agreement"][t] for r in measured if len(r["agreement"]) > t] for t in range(turns)]
    kls = [[r["kl"][t] for r in measured if len(r["kl"]) > t] for t in range(turns)]
    per_context = [sum(r["agreement"]) / len(r["agreement"]) for r in measured]
    held = [r["kv16"] for r in measured if "kv16" in r]
    return {
        "agreement": [sum(v) / len(v) for v in by_turn],
        "agreement_95": [bootstrap_interval(v) for v in by_turn],
        "kl": [sum(v) / len(v) for v in kls],
        "contexts": len(measured),
        "all_turns": sum(per_context) / len(per_context),
        "all_turns_95": bootstrap_interval(per_context),
        **({"kv16": sum(held) / len(held)} if held else {}),
    }


def setting_of(spec: str) -> str:
    """A spec without its working set's size (``BUDGET_FIELDS``; a token budget's left out, a byte budget's named
    without its value): the setting a frontier draws one curve for."""
    name, *fields = spec.split(":")
    kept = [f.split("=")[0] if f.split("=")[0] in BUDGET_FIELDS else f for f in fields]
    return ":".join([name, *(f for f in kept if f not in ("budget", "ratio"))])


def plot_frontier(summary: dict, path: Path) -> None:
    """Per mode, agreement over all turns (95% interval over contexts as bars) against the bytes held as a share of
    the 16-bit cache's (log scale), a curve per setting over its working sets; nothing where no row recorded both."""
    import matplotlib  # noqa: PLC0415 - only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    curves: dict[str, defaultdict[str, list]] = {mode: defaultdict(list) for mode in MODES}
    for mode in MODES:
        for spec, row in summary[mode].items():
            if "kv16" in row and spec != "full":
                curves[mode][setting_of(spec)].append((row["kv16"], row["all_turns"], *row["all_turns_95"]))
    if not any(curves.values()):
        return
    fig, axes = plt.subplots(1, len(MODES), figsize=(6 * len(MODES), 4), sharey=True, squeeze=False)
    for axis, mode in zip(axes[0], MODES):
        for setting, points in curves[mode].items():
            held, agreed, low, high = zip(*sorted(points))
            axis.errorbar(
                held,
                agreed,
                yerr=[[a - lo for a, lo in zip(agreed, low)], [hi - a for a, hi in zip(agreed, high)]],
                marker="o",
                capsize=2,
                label=setting,
            )
        axis.set_xscale("log")
        axis.set_title(mode)
        axis.set_xlabel("bytes held (share of the 16-bit cache's)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("top-1 agreement, all turns")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(summary: dict, path: Path) -> None:
    """Answers right by turn, per mode; below them, where it was measured, agreement with the full cache by turn
    (its 95% interval shaded)."""
    import matplotlib  # noqa: PLC0415 - only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    agreed = any("agreement" in row for mode in MODES for row in summary[mode].values())
    fig, axes = plt.subplots(
        2 if agreed else 1, len(MODES), figsize=(6 * len(MODES), 8 if agreed else 4), sharey="row", squeeze=False
    )
    for column, mode in enumerate(MODES):
        axis = axes[0][column]
        for spec, row in summary[mode].items():
            peer = spec.startswith("kvpress-")  # dashed: the colour cycle repeats after ten lines
            axis.plot(
                range(1, len(row["score"]) + 1),
                row["score"],
                marker="x" if peer else "o",
                linestyle="--" if peer else "-",
                label=spec,
            )
        axis.set_title(mode)
        axis.set_xticks(range(1, 1 + max((len(r["score"]) for r in summary[mode].values()), default=1)))
        axis.set_ylim(-0.05, 1.05)
        axis.legend(fontsize=7)  # each mode its own: kvpress's presses run in the multi-request mode only
        if agreed:
            below = axes[1][column]
            for spec, row in summary[mode].items():
                if "agreement" in row:
                    turns = range(1, len(row["agreement"]) + 1)
                    below.plot(turns, row["agreement"], marker="o", label=f"{spec} ({row['contexts']} contexts)")
                    below.fill_between(turns, *zip(*row["agreement_95"]), alpha=0.2)
            below.set_xticks(axis.get_xticks())
            below.legend(fontsize=7)
        axes[-1][column].set_xlabel("question (turn)")
    axes[0][0].set_ylabel("answers right")
    if agreed:
        axes[1][0].set_ylabel("top-1 agreement with the full cache")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
