"""ShadowKV's device memory, chunk hit rate and decode time on the embedded model (~4K-token prompt).

    python benchmarks/shadowkv_memory.py [--tokens 4000] [--depths 0.25 0.5 0.75] [--out FILE]

The demo document (a fact buried at each depth, then the question), greedy decoding; per setting
the device bytes kept between steps (``stats()["device_bytes"]``, measured from the tensors) as a
share of the full cache's KV bytes, the chunk hit rate, the values read from the offload store
per step, and the decode time. Settings: the defaults, ``sparse_budget=256`` and the paper's
1.56% (``sparse_ratio=0.0156``); the full cache for reference.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import transformers
from tqdm import tqdm

import kvcompress as kvc
from kvcompress import demo

SETTINGS = {
    "full": kvc.FullKV(),
    "default": kvc.ShadowKV(),
    "sparse_budget 256": kvc.ShadowKV(sparse_budget=256),
    "sparse_ratio 0.0156": kvc.ShadowKV(sparse_ratio=0.0156),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000, help="document length in tokens")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="shadowkv_memory.json")
    args = parser.parse_args()

    model, tok = kvc.load_model()
    records = []
    for depth in tqdm(args.depths, desc="depths"):
        messages = [{"role": "user", "content": f"Read this document.\n\n{demo.build_document(tok, args.tokens, depth)}\n\n{demo.QUESTION}"}]
        for name, method in SETTINGS.items():
            result = kvc.generate(model, tok, messages, method=method, max_new_tokens=args.max_new_tokens)
            stats = result.stats
            records.append({
                "setting": name, "depth": depth, "prompt_tokens": stats["prompt_tokens"], "correct": demo.ANSWER in result.text,
                "device_share": stats["kv_bytes_kept"] / stats["kv_bytes_full"], "kv_bytes_full": stats["kv_bytes_full"],
                "device_bytes": stats["kv_bytes_kept"], "offloaded_bytes": stats.get("offloaded_bytes"),
                "selected_tokens_per_step": stats.get("selected_tokens_per_step"), "chunk_hit_rate": stats.get("chunk_hit_rate"),
                "value_bytes_fetched_per_step": stats.get("value_bytes_fetched_per_step"), "decode_ms_per_token": stats["decode_ms_per_token"],
            })

    print(f"\n{'setting':22s}{'device/full KV':>16s}{'selected/step':>15s}{'hit rate':>12s}{'values read/step':>18s}{'decode ms':>16s}{'correct':>9s}")
    for name in SETTINGS:
        mine = [r for r in records if r["setting"] == name]
        share = sorted({f"{r['device_share']:.1%}" for r in mine})
        hits = [r["chunk_hit_rate"] for r in mine if r["chunk_hit_rate"] is not None]
        read = [r["value_bytes_fetched_per_step"] for r in mine if r["value_bytes_fetched_per_step"] is not None]
        ms = [r["decode_ms_per_token"] for r in mine]
        print(f"{name:22s}{'/'.join(share):>16s}{str(mine[0]['selected_tokens_per_step'] or '-'):>15s}"
              f"{(f'{min(hits):.2f}-{max(hits):.2f}' if hits else '-'):>12s}{(f'{max(read) / 2**20:.1f} MiB' if read else '-'):>18s}"
              f"{f'{min(ms):.0f}-{max(ms):.0f}':>16s}{sum(r['correct'] for r in mine):>5d}/{len(mine)}")
    info = {"machine": platform.platform(), "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": "SmolLM2-135M-Instruct float32",
            "settings": {k: m.describe() for k, m in SETTINGS.items()}, "args": vars(args)}
    with open(args.out, "w") as fh:
        json.dump({**info, "records": records}, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
