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
the arithmetic whether the agreement reaches past the full cache's final answer (this 135M model's arithmetic is
wrong, so the answer checked is the full cache's own). Writes JSON and a PNG of the gap against generated length;
``--table`` prints a run's markdown table.
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
from kvcompress.bench.device import machine
from kvcompress.bench.haystack import fill
from kvcompress.generation.conversation import render

PROMPTS = ("summary", "arithmetic", "code")
SPECS = (
    "snapkv:budget={b}:decode_budget={b}",
    "h2o:budget={b}:decode_budget={b}",
    "streamingllm:budget={b}:decode_budget={b}",
    "expected:budget={b}:decode_budget={b}",
    "h2o:budget={b}:evict_during_decoding=true",
)
CURVE = 256  # tokens per point of the gap curve


def arithmetic(steps: int, seed: int = 0) -> str:
    """A chain of operations on small numbers to work through step by step, ending in a final answer."""
    rng = random.Random(seed)
    start = rng.randint(2, 9)
    operations = [f"{rng.choice('+-*')} {rng.randint(2, 9)}" for _ in range(steps)]
    return (
        f"Start with {start}. Apply these operations in order, writing each step as 'Step k: value':\n"
        + "\n".join(operations)
        + "\nThen write 'Final answer:' and the last value."
    )


def prompts(tok) -> list[list[dict]]:
    essay = fill(tok, 900, [], kind="essays")
    chain = arithmetic(40)
    code = (
        "Write a complete Python module for a small library management system: classes Book, Member, Loan "
        "and Library with methods to add books, register members, lend and return books, compute late fees "
        "and search by author or title, each with a docstring, then unit tests for every method."
    )
    asks = [f"{essay}\n\nSummarize this text in detail, paragraph by paragraph.", chain, code]
    return [[{"role": "user", "content": ask}] for ask in asks]


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
        logits = (
            model(
                input_ids=token[:, None],
                position_ids=position[:, None],
                attention_mask=real,
                **{cache.keyword: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )
        logits[:, tok.eos_token_id] = -float("inf")
        logp = logits.log_softmax(dim=-1)
        choice = logits.argmax(dim=-1)
        token = forced[:, step + 1] if forced is not None else choice
        logps.append(logp.gather(1, token[:, None])[:, 0])
        agree.append(choice == token)
        fed.append(token)
        position += 1
    return {
        "tokens": torch.stack(fed, 1),
        "logp": torch.stack(logps, 1),
        "agree": torch.stack(agree, 1),
        "decode_s": time.perf_counter() - start,
        "stats": {k: v for k, v in cache.stats().items() if isinstance(v, (int, float, str))},
    }


def answer_end(text: str) -> int | None:
    """Characters into ``text`` up to the end of its first 'Final answer: N' (None: it has none)."""
    found = re.search(r"Final answer:\s*(-?\d+)", text)
    return None if found is None else found.end()


def answer_tokens(tok, ids: list[int]) -> int | None:
    """Tokens of ``ids`` up to the end of their first final answer (None: none)."""
    end = answer_end(tok.decode(ids))
    return None if end is None else next(n for n in range(1, len(ids) + 1) if len(tok.decode(ids[:n])) >= end)


def summarize(full: dict, ours: dict, label: str, bound: int, names: list[str]) -> list[dict]:
    rows = []
    for row in range(full["logp"].shape[0]):
        gap = (full["logp"][row] - ours["logp"][row]).double()
        disagree = (~ours["agree"][row]).nonzero()
        agreed = int(disagree[0, 0]) if len(disagree) else int(gap.shape[0])
        rows.append(
            {
                "method": label,
                "bound": bound,
                "prompt": names[row],
                "ll_full": float(full["logp"][row].double().mean()),
                "ll": float(ours["logp"][row].double().mean()),
                "gap": float(gap.mean()),
                "agreed_tokens": agreed,
                "gap_curve": [float(gap[:n].mean()) for n in range(CURVE, gap.shape[0] + 1, CURVE)],
            }
        )
    return rows


def table(data: dict, tok) -> str:
    """The markdown table of a run: per method and bound, the gap per prompt and its mean, the tokens agreed, and
    whether the arithmetic's final answer (the full cache's own: its first 'Final answer: N') lies inside the
    agreement (greedy decoding under the bound writes it exactly)."""
    names = data.get("prompts", list(PROMPTS))
    answer = answer_tokens(tok, data["full"]["token_ids"][names.index("arithmetic")]) if "arithmetic" in names else None
    lines = [
        f"| method | bound | gap {' / '.join(names)} (nats/token) | mean gap | tokens agreed | answer kept |",
        "|---|---:|---|---:|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in data["rows"]:
        groups.setdefault((row["method"], row["bound"]), []).append(row)
    for (method, bound), rows in groups.items():
        rows.sort(key=lambda r: names.index(r["prompt"]) if isinstance(r["prompt"], str) else r["prompt"])
        kept = "-"
        if answer is not None:
            arithmetic = rows[names.index("arithmetic")]["agreed_tokens"]
            kept = "yes" if arithmetic >= answer - 1 else f"no ({arithmetic} < {answer})"
        lines.append(
            f"| {short(method)} | {bound} | "
            + " / ".join(f"{r['gap']:+.3f}" for r in rows)
            + f" | {sum(r['gap'] for r in rows) / len(rows):+.3f} | "
            + " / ".join(str(r["agreed_tokens"]) for r in rows)
            + f" | {kept} |"
        )
    return "\n".join(lines)


def short(method: str) -> str:
    """A method's label for tables and plots: its name and what marks its variant."""
    name = method.split("(")[0]
    window = re.search(r"decode_window=(\d+)", method)
    return (
        name
        + (" evicting" if "evict_during_decoding=True" in method else "")
        + (f" decode_window={window[1]}" if window else "")
    )


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
            ax.plot([CURVE * (i + 1) for i in range(len(mean))], mean, label=short(label))
        ax.axhline(0.05, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"bound {bound}")
        ax.set_xlabel("generated tokens")
    axes[0][0].set_ylabel("gap to the full cache (nats/token, mean so far)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens the full cache writes per prompt")
    parser.add_argument("--bounds", default="256,1024,2048")
    parser.add_argument("--specs", default=",".join(SPECS), help="method specs with {b} for the bound")
    parser.add_argument("--out", type=Path, required=True, help="path without extension: .json and .png")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help=f"which of {', '.join(PROMPTS)}")
    parser.add_argument("--table", action="store_true", help="print --out's table and draw its PNG (no run)")
    args = parser.parse_args()
    if args.table:
        data = json.loads(args.out.with_suffix(".json").read_text())
        print(table(data, kvc.load_model()[1]))
        plot(data["rows"], args.out.with_suffix(".png"))
        return
    out = args.out.with_suffix(".json")
    if out.exists():
        raise SystemExit(f"--out {out} exists; give a new path")
    model, tok = kvc.load_model()
    asked = [name for name in PROMPTS if name in args.prompts.split(",")]
    if not asked or len(asked) != len(args.prompts.split(",")):
        raise SystemExit(f"--prompts {args.prompts}: valid are {', '.join(PROMPTS)}")
    rows = [row for name, row in zip(PROMPTS, prompts(tok)) if name in asked]
    full = read(model, tok, rows, kvc.FullKV(), None, args.tokens)
    print(f"full: {full['decode_s']:.0f} s", flush=True)
    results, texts = [], [tok.decode(ids) for ids in full["tokens"].tolist()]
    prompt_ids = [tok(render(tok, row), add_special_tokens=False)["input_ids"] for row in rows]  # as kvc feeds it
    for bound in (int(b) for b in args.bounds.split(",")):
        for spec in args.specs.split(","):
            method = kvc.method_from_spec(spec.format(b=bound))
            ours = read(model, tok, rows, method, full["tokens"], args.tokens)
            entries = summarize(full, ours, method.describe(), bound, asked)
            for entry in entries:
                entry.update(
                    decode_s=ours["decode_s"],
                    reselect_s=ours["stats"].get("reselect_s"),
                    device_bytes=ours["stats"]["device_bytes"],
                )
            results += entries
            print(
                f"{method.describe()[:60]:60s} gap "
                + " ".join(f"{e['gap']:+.3f}" for e in entries)
                + " agreed "
                + " ".join(str(e["agreed_tokens"]) for e in entries)
                + f" {ours['decode_s']:.0f} s",
                flush=True,
            )
            record = {"machine": machine(model.device), "tokens": args.tokens, "prompts": asked}
            out.write_text(
                json.dumps(
                    {
                        **record,
                        "full": {
                            "texts": texts,
                            "ll": [float(x) for x in full["logp"].double().mean(1)],
                            "prompt_ids": prompt_ids,
                            "token_ids": full["tokens"].tolist(),
                        },
                        "rows": results,
                    },
                    indent=1,
                )
            )
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
