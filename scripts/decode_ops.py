"""Ops one decoding step dispatches, per method, against plain transformers (its own cache).

    python scripts/decode_ops.py --model smollm2-135m --out docs/img/decode_ops_cpu.json

A fused kvcompress op (the chunk gather, ShadowKV's key rebuild) counts once, as it launches one
Triton kernel on a GPU; the ``unfused`` column counts the torch ops its CPU implementation runs
instead. ``host_reads`` are ops that hand a tensor's value to the host (none may occur in a step).
Counts do not depend on the prompt length, so a short prompt is used.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch._library.custom_ops import OPDEFS

from kvcompress.bench.audit import audit_step, transformers_step_ops
from kvcompress.bench.device import machine
from kvcompress.cache.tokens import TokenSpans
from kvcompress.generation.decode import DecodeState, greedy_step
from kvcompress.integrations.transformers.models import random_model
from kvcompress.methods import method_from_spec


def fused_inner_ops(audit) -> int:
    """Torch ops the fused calls of a step would run unfused (each replayed under a fresh audit)."""
    total = 0
    for name, (args, kwargs) in audit.fused_calls:
        implementation = OPDEFS[name.replace(".", "::", 1)]._init_fn
        total += audit_step(
            lambda: implementation(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        ).total
    return total


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--methods",
        default="full,snapkv,snapkv:heads=adaptive,snapkv:layers=pyramid,streamingllm,h2o,"
        "h2o:evict_during_decoding=True,shadowkv,quest,quest:offload=True,loki",
    )
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--out")
    args = parser.parse_args()
    model = random_model(args.model)
    vocab = model.config.get_text_config().vocab_size
    reference = transformers_step_ops(model)
    rows = []
    for spec in args.methods.split(","):
        cache = method_from_spec(spec, budget=args.budget).make_cache(model, TokenSpans.every(vocab))
        logits = model(
            torch.randint(10, vocab, (1, args.length), device=model.device), **{cache.keyword: cache}, logits_to_keep=1
        ).logits[:, -1]
        state = DecodeState.start(logits, torch.tensor([args.length], device=model.device), 4, set())
        cache.reserve(3)
        greedy_step(model, cache, state)
        audit = audit_step(lambda: greedy_step(model, cache, state), record_fused=True)
        fused = sum(count for name, count in audit.ops.items() if name.startswith("kvcompress."))
        unfused = audit.total - fused + fused_inner_ops(audit)
        rows.append(
            {
                "method": spec,
                "ops": audit.total,
                "vs_transformers": audit.total / reference,
                "fused_ops": fused,
                "unfused_ops": unfused,
                "unfused_vs_transformers": unfused / reference,
                "host_reads": sum(audit.host_reads.values()),
            }
        )
        print(
            f"{spec:44s} {audit.total:6d} ops ({audit.total / reference:.2f}x transformers' {reference}); fused ops "
            f"{fused}, unfused {unfused} ({unfused / reference:.2f}x); host reads {rows[-1]['host_reads']}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {"machine": machine(model.device), "settings": vars(args), "transformers_ops": reference, "rows": rows},
                fh,
                indent=2,
            )


if __name__ == "__main__":
    main()
