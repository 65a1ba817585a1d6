"""Prefill against the model's own forward: kvcompress's time to the first token over transformers' on the same tokens.

    python scripts/prefill_ab.py --lengths 2048,8192,16384 --methods full,snapkv --out docs/img/prefill_cpu.json

On a random-weight architecture preset (positions extended to fit), batch 1, the same token ids for
every way: transformers' ``model(ids)`` with its ``DynamicCache`` (a copy of the model that kvcompress
never touched: ``"sdpa"``, no wrapped modules), and for
each method spec a kvcompress cache's prefill (``model(ids, cache)``: the prompt fed, compressed,
the last position's logits). Rounds take the ways in turn (every other round reversed), so drift on a
shared machine hits all alike; each way's ratio to transformers is taken within a round and the
median reported, beside the median seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvcompress.bench.device import machine
from kvcompress.cache.kv_cache import cache_keyword
from kvcompress.cache.tokens import TokenSpans
from kvcompress.integrations.transformers.models import random_model
from kvcompress.methods import method_from_spec


@torch.inference_mode()
def prefill_seconds(model, plain, ids: torch.Tensor, spec: str | None, budget: int, vocab: int) -> float:
    """One prefill: transformers' own on ``plain`` (``spec`` None) or a kvcompress cache of ``spec`` on ``model``."""
    if spec is None:
        model, cache = plain, DynamicCache(config=plain.config)
    else:
        # switches to "kvcompress"
        cache = method_from_spec(spec, budget=budget).make_cache(model, TokenSpans.every(vocab))
    start = time.perf_counter()
    model(ids, **{cache_keyword(model): cache}, logits_to_keep=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an architecture preset (random weights)")
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--methods", default="full,snapkv", help="kvcompress method specs, comma-separated")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()
    model, plain = random_model(args.model), random_model(args.model)
    plain.load_state_dict(model.state_dict())  # the same weights (before kvcompress wraps anything)
    lengths = [int(n) for n in args.lengths.split(",")]
    for each in (model, plain):
        each.config.max_position_embeddings = max(each.config.max_position_embeddings, max(lengths) + 64)
    vocab = model.config.get_text_config().vocab_size
    ways = [None, *args.methods.split(",")]
    rows = []
    for length in lengths:
        ids = torch.randint(10, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        seconds: dict[str | None, list[float]] = {way: [] for way in ways}
        for round_ in range(args.rounds):
            for way in ways if round_ % 2 == 0 else ways[::-1]:
                seconds[way].append(prefill_seconds(model, plain, ids, way, args.budget, vocab))
        for way in ways[1:]:
            ratio = statistics.median(ours / theirs for ours, theirs in zip(seconds[way], seconds[None]))
            rows.append(
                {
                    "length": length,
                    "method": way,
                    "seconds": statistics.median(seconds[way]),
                    "transformers_seconds": statistics.median(seconds[None]),
                    "ratio": ratio,
                    "runs": seconds[way],
                    "transformers_runs": seconds[None],
                }
            )
            print(
                f"{length:>6} {way:<10} {rows[-1]['seconds']:.2f} s vs transformers "
                f"{rows[-1]['transformers_seconds']:.2f} s: {ratio:.3f}x",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"machine": machine(model.device), "settings": vars(args), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
