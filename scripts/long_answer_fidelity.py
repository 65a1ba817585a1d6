"""Fidelity on long answers under a decoding bound (issue 52, item 2): the full cache's own continuations, scored
under each bounded cache by teacher-forced log-likelihood per token and by greedy agreement up to the first
divergence.

    PYTHONPATH=src python scripts/long_answer_fidelity.py --tokens 2048 --bounds 256,1024,2048 \
        --out docs/img/long_answer_fidelity_2k

On the embedded model (float32, CPU), three prompts asked as one batch (each row exact against itself alone): a
detailed summary of a generated essay text, a chain of arithmetic steps whose values can be checked, and a
Python module to write. The full cache writes ``--tokens`` tokens greedily with the end token banned (so every
continuation is that long: its own text, past where it would stop); each method at each bound then reads the
same continuation token by token (decoding steps of one token: the bound re-selects as it would while
generating), and at every step records the log-probability of the full cache's next token and whether its own
greedy choice (end token banned) is that token. Reported per method, bound and prompt: the mean log-likelihood
per token against the full cache's (the gap, in nats), the tokens agreed before the first divergence, and for
the arithmetic whether the agreement reaches past the full cache's last checked step. Writes JSON and a PNG of
the gap against generated length.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.bench.haystack import fill
from kvcompress.bench.speed import machine
from kvcompress.generation.conversation import render

SPECS = ("snapkv:budget={b}:decode_budget={b}", "h2o:budget={b}:decode_budget={b}",
         "streamingllm:budget={b}:decode_budget={b}", "expected:budget={b}:decode_budget={b}",
         "h2o:budget={b}:evict_during_decoding=true")
CURVE = 256  # tokens per point of the gap curve


def arithmetic(steps: int, seed: int = 0) -> tuple[str, list[int]]:
    """A chain of operations on small numbers and the value after each."""
    rng = random.Random(seed)
    value, lines, values = rng.randint(2, 9), [], []
    start = value
    for _ in range(steps):
        op, n = rng.choice("+-*"), rng.randint(2, 9)
        value = value + n if op == "+" else value - n if op == "-" else value * n
        value = max(-999, min(999, value))
        lines.append(f"{op} {n}")
        values.append(value)
    text = (f"Start with {start}. Apply these operations in order, writing each step as 'Step k: value':\n"
            + "\n".join(lines) + "\nThen write 'Final answer:' and the last value.")
    return text, values


def prompts(tok) -> tuple[list[list[dict]], list[int]]:
    essay = fill(tok, 900, [], kind="essays")
    chain, values = arithmetic(40)
    code = ("Write a complete Python module for a small library management system: classes Book, Member, Loan "
            "and Library with methods to add books, register members, lend and return books, compute late fees "
            "and search by author or title, each with a docstring, then unit tests for every method.")
    asks = [f"{essay}\n\nSummarize this text in detail, paragraph by paragraph.", chain, code]
    return [[{"role": "user", "content": ask}] for ask in asks], values


@torch.inference_mode()
def read(model, tok, rows, method, forced: torch.Tensor | None, tokens: int) -> dict:
    """Prefill ``rows`` with ``method``, then ``tokens - 1`` steps of one token: ``forced [b, tokens]`` fed (None:
    greedy, the end token banned). Returns the tokens fed, each next token's log-probability and whether the
    greedy choice was it, and the decoding time."""
    first = kvc.generate(model, tok, rows, method=method, max_new_tokens=1)
    cache = first.cache
    batch = len(rows)
    position = cache.layers[0].prompt_tokens.clone()
    token = forced[:, 0] if forced is not None else torch.tensor([ids[0] for ids in first.token_ids])
    fed, logps, agree = [token], [], []
    real = torch.ones(batch, 1, 1, 1, dtype=torch.bool)
    start = time.perf_counter()
    for step in range(tokens - 1):
        logits = model(input_ids=token[:, None], position_ids=position[:, None], attention_mask=real,
                       **{cache.keyword: cache}, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        logits[:, tok.eos_token_id] = -float("inf")
        logp = logits.log_softmax(dim=-1)
        choice = logits.argmax(dim=-1)
        token = forced[:, step + 1] if forced is not None else choice
        logps.append(logp.gather(1, token[:, None])[:, 0])
        agree.append(choice == token)
        fed.append(token)
        position += 1
    return {"tokens": torch.stack(fed, 1), "logp": torch.stack(logps, 1), "agree": torch.stack(agree, 1),
            "decode_s": time.perf_counter() - start, "stats": {k: v for k, v in cache.stats().items()
                                                               if isinstance(v, (int, float, str))}}


def last_checked_step(text: str, values: list[int]) -> int | None:
    """Characters into ``text`` up to the end of the last 'Step k: value' line whose value is right, in a run from
    step 1 (None: step 1 is wrong)."""
    end = None
    for k, value in enumerate(values, start=1):
        found = re.search(rf"Step {k}: (-?\d+)", text)
        if found is None or int(found.group(1)) != value:
            break
        end = found.end()
    return end


def summarize(full: dict, ours: dict, tok, values: list[int], label: str, bound: int) -> list[dict]:
    rows = []
    for row in range(full["logp"].shape[0]):
        gap = (full["logp"][row] - ours["logp"][row]).double()
        disagree = (~ours["agree"][row]).nonzero()
        agreed = int(disagree[0, 0]) if len(disagree) else int(gap.shape[0])
        entry = {"method": label, "bound": bound, "prompt": ("summary", "arithmetic", "code")[row],
                 "ll_full": float(full["logp"][row].double().mean()), "ll": float(ours["logp"][row].double().mean()),
                 "gap": float(gap.mean()), "agreed_tokens": agreed,
                 "gap_curve": [float(gap[: n].mean()) for n in range(CURVE, gap.shape[0] + 1, CURVE)]}
        if row == 1:  # the arithmetic: is every checked step of the full cache's answer inside the agreement?
            ids = full["tokens"][row].tolist()
            end = last_checked_step(tok.decode(ids), values)
            if end is not None:
                checked = next(n for n in range(1, len(ids) + 1) if len(tok.decode(ids[:n])) >= end)
                entry.update(checked_tokens=checked, answer_kept=agreed >= checked - 1)
        rows.append(entry)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bounds = sorted({row["bound"] for row in rows})
    fig, axes = plt.subplots(1, len(bounds), figsize=(5 * len(bounds), 4), squeeze=False, sharey=True)
    for ax, bound in zip(axes[0], bounds):
        for label in dict.fromkeys(row["method"] for row in rows if row["bound"] == bound):
            curves = [row["gap_curve"] for row in rows if row["bound"] == bound and row["method"] == label]
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(min(map(len, curves)))]
            ax.plot([CURVE * (i + 1) for i in range(len(mean))], mean, label=label.split("(")[0] + (
                " evicting" if "evict_during_decoding=True" in label else ""))
        ax.axhline(0.05, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"bound {bound}")
        ax.set_xlabel("generated tokens")
    axes[0][0].set_ylabel("log-likelihood gap to the full cache (nats/token, mean so far)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens the full cache writes per prompt")
    parser.add_argument("--bounds", default="256,1024,2048")
    parser.add_argument("--specs", default=",".join(SPECS), help="method specs with {b} for the bound")
    parser.add_argument("--out", type=Path, required=True, help="path without extension: .json and .png")
    args = parser.parse_args()
    out = args.out.with_suffix(".json")
    if out.exists():
        raise SystemExit(f"--out {out} exists; give a new path")
    model, tok = kvc.load_model()
    rows, values = prompts(tok)
    full = read(model, tok, rows, kvc.FullKV(), None, args.tokens)
    print(f"full: {full['decode_s']:.0f} s", flush=True)
    results, texts = [], [tok.decode(ids) for ids in full["tokens"].tolist()]
    prompt_ids = [tok(render(tok, row), add_special_tokens=False)["input_ids"] for row in rows]  # as kvc feeds it
    for bound in (int(b) for b in args.bounds.split(",")):
        for spec in args.specs.split(","):
            method = kvc.method_from_spec(spec.format(b=bound))
            ours = read(model, tok, rows, method, full["tokens"], args.tokens)
            entries = summarize(full, ours, tok, values, method.describe(), bound)
            for entry in entries:
                entry.update(decode_s=ours["decode_s"], reselect_s=ours["stats"].get("reselect_s"),
                             device_bytes=ours["stats"]["device_bytes"])
            results += entries
            print(f"{method.describe()[:60]:60s} gap " + " ".join(f"{e['gap']:+.3f}" for e in entries) +
                  " agreed " + " ".join(str(e["agreed_tokens"]) for e in entries) +
                  f" kept {entries[1].get('answer_kept')} {ours['decode_s']:.0f} s", flush=True)
            out.write_text(json.dumps({"machine": machine(model.device), "tokens": args.tokens, "full": {
                "texts": texts, "ll": [float(x) for x in full["logp"].double().mean(1)], "prompt_ids": prompt_ids,
                "token_ids": full["tokens"].tolist()}, "rows": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
