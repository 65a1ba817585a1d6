"""SnapKV's observation window from the question itself (issue 67, item 4), measured by agreement with the full cache.

    PYTHONPATH=src python scripts/question_window.py --wording shared --contexts 36 --out docs/img/question_window.jsonl
    PYTHONPATH=src python scripts/question_window.py --wording ruler --contexts 18 \
        --out docs/img/question_window_ruler.jsonl

Where a question is asked over a stored context (or is a conversation's next turn), the library knows where it begins:
its tokens are what follows the stored context (or the previous answer). This script asks each question with SnapKV
whose window is exactly that turn's tokens (the separator, the question, the chat template's end) against the paper's
last 32, both at 1/16 of the context's tokens, and reports the full cache's own answer teacher-forced under each (top-1
agreement, KL), per question and turn. Two wordings: ``shared`` (bench shared-context's questions, which end on their
key: "What is the code of the grey horse? Answer with the code.", as separate requests and as a 6-turn conversation)
and ``ruler`` (the question-agnostic track's RULER questions, "...for X mentioned in the provided text?", requests).
``--specs`` compares other settings the same way: ``{turn}`` in a spec stands for the turn's token count (so
``snapkv:layers=global:window={turn}`` is the global ranking voted by the question alone; a turn longer than the budget
allows votes with as many of its last tokens as the budget holds, budget - 1); a spec without a budget gets
``--fraction`` of the context's. Each context's rows are appended to ``--out`` as they come (a rerun skips the
contexts there)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import kvcompress as kvc
from kvcompress.bench.accuracy import build_samples
from kvcompress.bench.agreement import FullAnswers
from kvcompress.bench.metrics import bootstrap_interval, fidelity
from kvcompress.bench.shared_context import asked, make_sample, resolved
from kvcompress.generation.conversation import as_asked, follow_up, user_prompt

RULER_TASKS = ["niah", "niah_multikey", "niah_multivalue", "qa_1", "qa_2"]
DEFAULT_SPECS = "snapkv:question_window=false,snapkv:window={turn}"  # rows before --specs: last32, question
ROW_FIELDS = {"context", "mode", "tokens", "window"}


def contexts_of(tok, wording: str, count: int, samples: int) -> list[tuple[str, str, list[str], int | None]]:
    """(id, context, questions as asked, how many of them are asked as separate requests) per context."""
    if wording == "shared":
        samples = [make_sample(tok, 2000, seed, 5) for seed in range(count)]
        return [(f"shared-{s.seed}", s.context, asked(tok, s), len(s.questions) - 1) for s in samples]
    drawn = build_samples(tok, RULER_TASKS, [1000, 2000], [0.1, 0.5, 0.9], samples, 0, "essays")[:count]
    return [(s.id, s.context, [as_asked(tok, t.question) for t in s.questions()], None) for s in drawn]


def turn_tokens(tok, past: kvc.Result, question: str) -> int:
    """How many tokens a question adds after ``past`` (a stored context waiting for it, or a finished turn)."""
    return len(follow_up(tok, copy.deepcopy(past.rows[0]), question))


def setting(spec: str, turn: int, tokens: int, fraction: float) -> kvc.Method:
    """``spec``'s method at ``fraction`` of ``tokens``, its ``{turn}`` the turn's token count, or budget - 1 where the
    turn is longer (a window must leave the budget a position to choose)."""
    budget = getattr(resolved(spec.format(turn=1), tokens, fraction), "budget", turn + 1)
    return resolved(spec.format(turn=min(turn, budget - 1)), tokens, fraction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wording", choices=("shared", "ruler"), default="shared")
    parser.add_argument("--contexts", type=int, default=12)
    parser.add_argument("--samples", type=int, default=1, help="ruler: samples per task, length and depth")
    parser.add_argument("--model", default=None)
    parser.add_argument("--fraction", type=float, default=1 / 16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--specs",
        default=DEFAULT_SPECS,
        help="method specs to compare, comma-separated; {turn} is the turn's token count",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    specs = args.specs.split(",")
    model, tok = kvc.load_model(args.model)
    done = {json.loads(line)["context"] for line in args.out.read_text().splitlines()} if args.out.exists() else set()
    modes = ("multi-request", "multi-turn") if args.wording == "shared" else ("multi-request",)
    for name, context, questions, requests in contexts_of(tok, args.wording, args.contexts, args.samples):
        if name in done:
            continue
        store = kvc.compress(model, tok, user_prompt(tok, context), method=kvc.FullKV(), query_window=None)
        tokens = int(store.attention_mask.sum())
        full = FullAnswers(model, tok, store, questions, args.max_new_tokens, requests=requests)
        rows = []
        for mode in modes:
            row: dict = {"context": name, "mode": mode, "tokens": tokens, "window": []} | {key: [] for key in specs}
            for (past, answer, reference), question in zip(full.of(mode), questions):
                window = turn_tokens(tok, past, question)
                row["window"].append(window)
                for spec in specs:
                    forced = kvc.forced_logprobs(
                        model,
                        tok,
                        answer,
                        prompt=question,
                        past=past,
                        method=setting(spec, window, tokens, args.fraction),
                    )
                    row[spec].append(fidelity(reference, forced))
            rows.append(row)
            print(
                name,
                mode,
                "windows",
                row["window"],
                "agreement (" + " / ".join(specs) + "):",
                [
                    "/".join(f"{row[spec][t]['top1_agreement']:.2f}" for spec in specs)
                    for t in range(len(row["window"]))
                ],
                flush=True,
            )
        with args.out.open("a") as fh:
            fh.write("".join(json.dumps(row) + "\n" for row in rows))
    summarize(args.out)


def context_mean(rows: list[dict]) -> float:
    """One context's top-1 agreement over its turns."""
    return sum(r["top1_agreement"] for r in rows) / len(rows)


def summarize(path: Path) -> None:
    """Per mode and turn: each setting's mean agreement with its 95% bootstrap interval over contexts, and its gain
    over the first setting paired per context."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        turns = max(len(r["window"]) for r in mine)
        summary[mode] = {"contexts": len(mine)}
        keys = [k for k in mine[0] if k not in ROW_FIELDS]
        for key in keys:
            by_turn = [[r[key][t]["top1_agreement"] for r in mine if len(r[key]) > t] for t in range(turns)]
            summary[mode][key] = [round(sum(v) / len(v), 3) for v in by_turn]
            summary[mode][key + "_95"] = [[round(x, 3) for x in bootstrap_interval(v)] for v in by_turn]
            every = [x for v in by_turn for x in v]
            summary[mode][key + "_all"] = round(sum(every) / len(every), 3)
            if key != keys[0]:  # paired with the first setting on each context: its turns' mean, this one's less
                gains = [context_mean(r[key]) - context_mean(r[keys[0]]) for r in mine]
                summary[mode][key + "_gain"] = {
                    "mean": round(sum(gains) / len(gains), 3),
                    "95": [round(x, 3) for x in bootstrap_interval(gains)],
                    "better": sum(g > 0 for g in gains),
                    "worse": sum(g < 0 for g in gains),
                }
        summary[mode]["windows"] = sorted({w for r in mine for w in r["window"]})
    path.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
