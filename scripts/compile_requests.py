"""A session of requests of random lengths, eager against compiled decoding (issue 32).

    python scripts/compile_requests.py --methods snapkv:budget=256,full --requests 20 --out runs/compile_requests.json

Each request is a document of a random length (``--lengths``, in the model's tokens) with a question
and a random ``max_new_tokens`` (``--new``); it runs through ``kvc.generate`` eagerly and then with
``compile=True``, one right after the other, so a slow minute of a shared machine hits both. The
compiled run's tokens must equal the eager run's. Reported per method: the compilations (dynamo's
graph count) against the capacity buckets the requests touched, the total wall time of each, the
compiled total without its compilation time (``compile_s``), and decoding ms/token (every token of
every request over the decoding time, and the median of the per-request ratios).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

import kvcompress as kvc
from kvcompress.bench.device import machine
from kvcompress.bench.haystack import fill


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split("-"))
    return low, high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="snapkv:budget=256,full", help="comma-separated method specs")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--lengths", type=_pair, default=(500, 4000), help="prompt tokens, low-high")
    parser.add_argument("--new", type=_pair, default=(8, 64), help="max_new_tokens, low-high")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/compile_requests.json")
    args = parser.parse_args()

    model, tok = kvc.load_model()
    rng = random.Random(args.seed)
    requests = [(rng.randint(*args.lengths), rng.randint(*args.new)) for _ in range(args.requests)]
    report = {"machine": machine(model.device), "requests": requests, "methods": []}
    for spec in args.methods.split(","):
        method = kvc.method_from_spec(spec)
        torch._dynamo.reset()
        counters.clear()
        rows, buckets = [], set()
        for index, (length, new) in enumerate(requests):
            document = fill(tok, length, [(0.5, "The vault code for the east wing is 4817.")], seed=index)
            prompt = [{"role": "user", "content": document + "\n\nWhat is the vault code for the east wing?"}]
            row = {"prompt_tokens": None, "max_new_tokens": new}
            for mode, compiled in (("eager", False), ("compiled", True)):
                start = time.perf_counter()
                result = kvc.generate(model, tok, prompt, method=method, max_new_tokens=new, compile=compiled)
                row[mode] = {
                    "wall_s": time.perf_counter() - start,
                    "new_tokens": result.stats["new_tokens"],
                    "decode_ms_per_token": result.stats["decode_ms_per_token"],
                    "compile_s": result.stats["compile_s"],
                    "tokens": result.token_ids[0],
                }
            assert row["eager"]["tokens"] == row["compiled"]["tokens"], (
                f"{spec} request {index}: compiled tokens differ from eager"
            )
            row["prompt_tokens"] = result.stats["prompt_tokens"]
            buckets.add(result.cache.layers[0].keys.shape[-2])  # the compiled run's capacity: its bucket
            rows.append(row)
            print(
                f"{spec} {index + 1}/{len(requests)}: {row['prompt_tokens']} tokens, {new} new; eager "
                f"{row['eager']['wall_s']:.1f} s, compiled {row['compiled']['wall_s']:.1f} s (compile "
                f"{row['compiled']['compile_s']:.1f} s); decode {row['eager']['decode_ms_per_token'] or 0:.1f} vs "
                f"{row['compiled']['decode_ms_per_token'] or 0:.1f} ms/token",
                flush=True,
            )
        eager_wall = sum(r["eager"]["wall_s"] for r in rows)
        compiled_wall = sum(r["compiled"]["wall_s"] for r in rows)
        compile_s = sum(r["compiled"]["compile_s"] for r in rows)

        def decode_ms(mode: str) -> float:  # every decoded token over the decoding time (steps that compiled left out)
            timed = [r[mode] for r in rows if r[mode]["decode_ms_per_token"] is not None]
            return sum(t["decode_ms_per_token"] * (t["new_tokens"] - 1) for t in timed) / sum(
                t["new_tokens"] - 1 for t in timed
            )

        ratios = [
            r["compiled"]["decode_ms_per_token"] / r["eager"]["decode_ms_per_token"]
            for r in rows
            if r["compiled"]["decode_ms_per_token"] and r["eager"]["decode_ms_per_token"]
        ]
        summary = {
            "method": method.describe(),
            "compilations": counters["stats"]["unique_graphs"],
            "buckets_touched": sorted(buckets),
            "eager_wall_s": eager_wall,
            "compiled_wall_s": compiled_wall,
            "compile_s": compile_s,
            "compiled_wall_without_compile_s": compiled_wall - compile_s,
            "eager_decode_ms_per_token": decode_ms("eager"),
            "compiled_decode_ms_per_token": decode_ms("compiled"),
            "decode_ratio": decode_ms("compiled") / decode_ms("eager"),
            "median_request_decode_ratio": statistics.median(ratios),
        }
        report["methods"].append(
            {
                **summary,
                "rows": [
                    {
                        k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
                        for k, v in r.items()
                    }
                    for r in rows
                ],
            }
        )
        print(json.dumps(summary, indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
