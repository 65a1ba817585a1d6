"""Interleaved decode timing: method specs compared on one prompt, step blocks taken in turn.

    python scripts/decode_ab.py --model smollm2-135m --methods snapkv,snapkv:heads=adaptive --budget 256 --length 4096
    python scripts/decode_ab.py --methods snapkv,snapkv@compile --length 4096     # eager vs the compiled step

`kvcompress bench speed` times each method in its own stretch, so on a shared machine a slow
minute lands on one method only (two settings with identical decode work differed by 15-40% there).
Here every method is prefilled once, then blocks of decoding steps run method after method, round
after round (every other round in reverse order, so no method always follows the same one): drift
hits all of them alike. Each method's ratio to the first is taken within each round, where the
blocks ran seconds apart, and the median over rounds is reported beside the median ms per step.
Prints and writes (``--out``) both. A spec ending in ``@compile`` decodes with the compiled step
(``kvc.generate(compile=True)``); its compilation happens in the warm-up round. ``--profile N`` then runs N more
steps of each method under ``torch.profiler`` and prints (and writes) the kernels that took the step's device time,
with the decoding attention's chosen kernels: where a step's time goes, beside its bandwidth bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from kvcompress.bench.device import machine
from kvcompress.cache.tokens import TokenSpans
from kvcompress.generation.decode import Compile, DecodeState, StepRunner
from kvcompress.integrations.transformers.models import random_model
from kvcompress.methods import method_from_spec
from kvcompress.storage import kernel_choice


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="smollm2-135m", help="an architecture preset or a config.json (random weights)"
    )
    parser.add_argument("--methods", required=True, help="comma-separated specs; the first is the reference")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="decoding steps per block")
    parser.add_argument("--profile", type=int, default=0, help="steps per method to profile after the timing")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = random_model(args.model)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(10, vocab, (args.batch, args.length), device=model.device)
    specs = list(dict.fromkeys(args.methods.split(",")))
    total = (args.rounds + 1) * args.steps + args.profile + 2
    runners, kept = {}, {}
    for spec in specs:
        method_spec, _, mode = spec.partition("@")
        # random ids: every token a span, as bench speed
        cache = method_from_spec(method_spec, budget=args.budget).make_cache(model, TokenSpans.every(vocab))
        logits = model(prompt, **{cache.keyword: cache}, logits_to_keep=1).logits[:, -1]
        state = DecodeState.start(logits, torch.full((args.batch,), args.length, device=model.device), total, set())
        kept[spec] = statistics.mean(cache.stats()["kv_tokens_per_layer"])
        cache.reserve(total)
        runners[spec] = StepRunner(model, cache, state, Compile() if mode == "compile" else None)
    blocks: dict[str, list[float]] = {spec: [] for spec in specs}
    for round_ in range(args.rounds + 1):  # the first round warms up (and compiles) and is not counted
        for spec in specs if round_ % 2 == 0 else specs[::-1]:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                runners[spec].step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            blocks[spec].append((time.perf_counter() - start) * 1000 / args.steps)
    medians = {spec: statistics.median(times[1:]) for spec, times in blocks.items()}
    reference = blocks[specs[0]]
    ratios = {
        spec: statistics.median(t / r for t, r in zip(times[1:], reference[1:])) for spec, times in blocks.items()
    }
    for spec in blocks:
        times = ", ".join(f"{t:.1f}" for t in blocks[spec][1:])
        print(
            f"{spec:36s} {medians[spec]:8.2f} ms/step  x{ratios[spec]:.3f} (median of per-round ratios)  "
            f"{kept[spec]:.0f} tokens kept per layer  (blocks: {times})"
        )
    profiles = {spec: profile(runner, args.profile) for spec, runner in runners.items()} if args.profile else {}
    clock = "device" if torch.cuda.is_available() else "host"
    for spec, kernels in profiles.items():
        print(f"\n{spec}: {clock} time per step by kernel (ms; {args.profile} profiled steps)")
        for row in kernels[:PROFILE_ROWS]:
            print(f"  {row['ms_per_step']:8.3f}  {row['calls_per_step']:6.1f}x  {row['name'][:100]}")
    print("attention's kernels by phase/device/dtype/head_dim/masked/bucket, eager:", kernel_choice.sdpa_choices())
    print("... and compiled (by device time):", kernel_choice.sdpa_choices(graphed=True))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {
                    "machine": machine(model.device),
                    "settings": vars(args),
                    "ms_per_step": medians,
                    "ratio_to_first": ratios,
                    "kept_per_layer": kept,
                    "blocks": blocks,
                    "profiles": profiles,
                    "attention_choices": kernel_choice.sdpa_choices(),
                    "attention_choices_compiled": kernel_choice.sdpa_choices(graphed=True),
                },
                fh,
                indent=2,
            )


PROFILE_ROWS = 12


def profile(runner: StepRunner, steps: int) -> list[dict]:
    """Device (or, without one, host) time per step of each kernel over ``steps`` steps, largest first."""
    cuda = torch.cuda.is_available()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(steps):
            runner.step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and (not cuda or event.device_type == DeviceType.CUDA):
            rows.append({"name": event.key, "ms_per_step": us / 1000 / steps, "calls_per_step": event.count / steps})
    return sorted(rows, key=lambda row: -row["ms_per_step"])


if __name__ == "__main__":
    main()
