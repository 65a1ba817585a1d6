"""Decode latency vs prompt length for FullKV and SnapKV on the embedded model (SnapKV Fig. 7, CPU).

    python benchmarks/decode_latency.py [--lengths 1024 2048 4096] [--budgets 1024] [--steps 32] [--out FILE]

Each method x length: one prefill (timed), then ``--steps`` single-token decode steps; the figure
is the median step time after ``--warmup`` steps. The whole grid is repeated ``--repeats`` times in
interleaved order and the lowest figure kept, which damps noise from other work on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers

import kvcompress as kvc
from kvcompress import demo


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


@torch.inference_mode()
def measure(model, ids: torch.Tensor, method: kvc.Method, steps: int, warmup: int) -> tuple[float, float, dict]:
    """(prefill seconds, median decode ms/token, cache stats)."""
    cache = method.make_cache(model)
    start = time.perf_counter()
    logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
    prefill_s = time.perf_counter() - start
    token = logits[:, -1:].argmax(-1)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        token = model(token, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        times.append(1000 * (time.perf_counter() - start))
    return prefill_s, statistics.median(times[warmup:]), cache.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024], help="SnapKV budgets to compare with FullKV")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="decode_latency.json")
    args = parser.parse_args()

    model, tok = kvc.load_model()
    methods: dict[str, kvc.Method] = {"full": kvc.FullKV(), **{f"snapkv-{b}": kvc.SnapKV(budget=b) for b in args.budgets}}
    document = demo.build_document(tok, max(args.lengths) + 64)
    all_ids = tok(document, return_tensors="pt")["input_ids"]
    info = {"machine": machine(), "model": "SmolLM2-135M-Instruct (float32)", "settings": vars(args)}
    print(json.dumps(info, indent=2))
    best: dict[tuple[str, int], float] = {}
    prefill: dict[tuple[str, int], float] = {}
    kept: dict[tuple[str, int], dict] = {}
    for repeat in range(args.repeats):
        for length in args.lengths:
            for name, method in methods.items():
                prefill_s, ms, stats = measure(model, all_ids[:, :length], method, args.steps, args.warmup)
                best[name, length] = min(ms, best.get((name, length), float("inf")))
                prefill[name, length] = min(prefill_s, prefill.get((name, length), float("inf")))
                kept[name, length] = stats
                print(f"repeat {repeat} {name:12s} L={length:5d}: prefill {prefill_s:6.2f} s, decode {ms:7.2f} ms/token", flush=True)
    rows = [
        {"method": name, "prompt_tokens": length, "prefill_s": round(prefill[name, length], 3),
         "decode_ms_per_token": round(best[name, length], 2),
         "kv_tokens_per_head": max(kept[name, length]["kv_tokens_per_layer"]), "kv_bytes_kept": kept[name, length]["kv_bytes_kept"],
         "kv_bytes_full": kept[name, length]["kv_bytes_full"]}
        for name in methods for length in args.lengths
    ]
    print(f"\n{'method':12s} {'prompt':>7s} {'prefill s':>9s} {'ms/token':>9s} {'vs shortest':>11s} {'KV/head':>8s} {'KV MiB':>7s}")
    for row in rows:
        base = best[row["method"], args.lengths[0]]
        print(f"{row['method']:12s} {row['prompt_tokens']:7d} {row['prefill_s']:9.2f} {row['decode_ms_per_token']:9.2f} "
              f"{row['decode_ms_per_token'] / base:10.2f}x {row['kv_tokens_per_head']:8d} {row['kv_bytes_kept'] / 2**20:7.1f}")
    with open(args.out, "w") as fh:
        json.dump({**info, "rows": rows}, fh, indent=2)
    plot(rows, args.out.rsplit(".", 1)[0] + ".png")


def plot(rows: list[dict], path: str) -> None:
    """Decode latency vs prompt length per method (the shape of SnapKV's Fig. 7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        points = [(r["prompt_tokens"], r["decode_ms_per_token"]) for r in rows if r["method"] == name]
        ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode latency (ms/token)")
    ax.set_ylim(bottom=0)
    ax.set_title("SmolLM2-135M, CPU, batch 1")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
