"""Decode latency vs prompt length for FullKV and SnapKV on the embedded model (SnapKV Fig. 7, CPU).

    python benchmarks/decode_latency.py [--lengths 1024 2048 4096] [--budget 1024] [--steps 32] [--out FILE]

Each method x length: one prefill, then ``--steps`` single-token decode steps; the figure is the
median step time after ``--warmup`` steps. The whole grid is repeated ``--repeats`` times in
interleaved order and the lowest median kept, which damps noise from other work on the machine.
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
def decode_ms(model, ids: torch.Tensor, method: kvc.Method, steps: int, warmup: int) -> tuple[float, dict]:
    cache = method.make_cache(model)
    logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
    token = logits[:, -1:].argmax(-1)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        token = model(token, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times[warmup:]), cache.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="decode_latency.json")
    args = parser.parse_args()

    model, tok = kvc.load_model()
    methods = {"full": kvc.FullKV(), "snapkv": kvc.SnapKV(budget=args.budget)}
    document = demo.build_document(tok, max(args.lengths) + 64)
    all_ids = tok(document, return_tensors="pt")["input_ids"]
    info = {"machine": machine(), "model": "SmolLM2-135M-Instruct (float32)", "settings": vars(args)}
    print(json.dumps(info, indent=2))
    best: dict[tuple[str, int], float] = {}
    kept: dict[tuple[str, int], dict] = {}
    for repeat in range(args.repeats):
        for length in args.lengths:
            for name, method in methods.items():
                ms, stats = decode_ms(model, all_ids[:, :length], method, args.steps, args.warmup)
                best[name, length] = min(ms, best.get((name, length), float("inf")))
                kept[name, length] = stats
                print(f"repeat {repeat} {name:7s} L={length:5d}: {ms:7.2f} ms/token", flush=True)
    rows = [
        {"method": name, "prompt_tokens": length, "decode_ms_per_token": round(best[name, length], 2),
         "kv_tokens_per_head": max(kept[name, length]["kv_tokens_per_layer"]), "kv_bytes_kept": kept[name, length]["kv_bytes_kept"]}
        for name in methods for length in args.lengths
    ]
    print(f"\n{'method':8s} {'prompt':>7s} {'ms/token':>9s} {'vs shortest':>11s} {'KV/head':>8s}")
    for row in rows:
        base = best[row["method"], args.lengths[0]]
        print(f"{row['method']:8s} {row['prompt_tokens']:7d} {row['decode_ms_per_token']:9.2f} {row['decode_ms_per_token'] / base:10.2f}x {row['kv_tokens_per_head']:8d}")
    with open(args.out, "w") as fh:
        json.dump({**info, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
