"""Long answers under a decoding bound (issue 52, item 3): decode ms/token, device bytes and resident memory as a
generation grows to N tokens, for the full cache and prompt methods with ``decode_budget``, on random weights of the
embedded model's shape with positions extended (``smollm2-135m-long``; the real one reads 8K), its end token never
chosen (its output row zeroed) so every run decodes N tokens.

Every ``--every`` steps a row records the window's ms/token, the cache's device bytes (``stats()``), the process's
resident bytes, and the re-selection's seconds so far. One process, methods one after another, ratios within it.

    PYTHONPATH=src python scripts/long_answer_bench.py --tokens 4096 --out docs/img/long_answer_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.bench.device import machine
from kvcompress.cache.tokens import TokenSpans
from kvcompress.generation.decode import DecodeState, StepRunner
from kvcompress.generation.feed import prefill_groups
from kvcompress.integrations.transformers.models import random_model

DEFAULT_SPECS = (
    "full,snapkv:budget=1024:decode_budget=1024,h2o:budget=1024:decode_budget=1024,"
    "streamingllm:budget=1024:decode_budget=1024"
)


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@torch.inference_mode()
def run(model, spec: str, prompt: int, tokens: int, every: int, compile: kvc.Compile | None) -> dict:
    method = kvc.method_from_spec(spec)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(10, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    device = model.device
    spans = TokenSpans.every(vocab)
    feeder, logits = prefill_groups(model, lambda: method.make_cache(model, spans), ids, 0, None, None)
    cache = feeder.cache
    state = DecodeState.start(logits, torch.full((1,), prompt, device=device), tokens + 1, set(), compile is not None)
    cache.reserve(tokens, compile is not None)
    runner = StepRunner(model, cache, state, compile)
    points, start, compile_s = [], time.perf_counter(), 0.0
    for step in range(1, tokens):
        runner.step()
        if step % every == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            stats = cache.stats()
            points.append(
                {
                    "generated": step,
                    "ms_per_token": (now - start - (runner.compile_s - compile_s)) * 1000 / every,
                    "device_bytes": stats["device_bytes"],
                    "resident_bytes": resident_bytes(),
                    "reselect_s": stats.get("reselect_s", 0.0),
                    "reselections": stats.get("reselections", 0),
                }
            )
            compile_s, start = runner.compile_s, time.perf_counter()
            print(
                f"{spec} {step:6d} {points[-1]['ms_per_token']:7.1f} ms/token {stats['device_bytes'] / 2**20:8.1f} "
                f"MiB device {points[-1]['resident_bytes'] / 2**30:5.2f} GiB rss",
                flush=True,
            )
    total = sum(p["ms_per_token"] for p in points) * every / 1000
    return {
        "method": method.describe(),
        "spec": spec,
        "points": points,
        "decode_s": total,
        "reselect_share": points[-1]["reselect_s"] / total if total else None,
        "compile_s": runner.compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=DEFAULT_SPECS)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens (random ids)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens generated")
    parser.add_argument("--every", type=int, default=256, help="steps between records")
    parser.add_argument("--compile", action="store_true", help="decode with the compiled step")
    parser.add_argument("--model", default="smollm2-135m-long", help="a random-weight preset")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists; give a new file")
    torch.manual_seed(0)
    model = random_model(args.model, device=args.device)
    with torch.no_grad():
        model.get_output_embeddings().weight[model.config.eos_token_id or 0] = 0
    compile = kvc.Compile() if args.compile else None
    rows = [run(model, spec, args.prompt, args.tokens, args.every, compile) for spec in args.methods.split(",")]
    setting = {
        "model": f"{args.model} (random weights, {model.dtype})",
        "prompt_tokens": args.prompt,
        "generated": args.tokens,
        "compiled": args.compile,
    }
    args.out.write_text(json.dumps({"machine": machine(model.device), "setting": setting, "rows": rows}, indent=1))
    for row in rows:
        last = row["points"][-1]
        print(
            f"{row['spec']:45s} last {last['ms_per_token']:6.1f} ms/token, device {last['device_bytes'] / 2**20:7.1f}"
            f" MiB, re-selection {100 * (row['reselect_share'] or 0):4.1f}% of decoding"
        )


if __name__ == "__main__":
    main()
