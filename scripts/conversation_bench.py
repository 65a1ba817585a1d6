"""What each turn of a conversation over a stored document costs, against prefilling the conversation afresh.

    python scripts/conversation_bench.py --lengths 2000,4000,8000 --budget 256 --out docs/img/conversation_cpu

Per length, on the embedded model (a needle in Paul Graham's essays): the document is stored once
(``kvc.compress(method=FullKV())``), then ten turns are asked over it, each compressed per question
(``past=last turn, method=SnapKV``: the conversation since the document and the new message prefilled over
the store and compressed with them). At turns 1, 5 and 10 the same conversation is also prefilled afresh
as one prompt (question-aware SnapKV on the whole conversation), the reference each turn must equal.
Reported per turn: time to the first token (``prefill_s``) and, where measured, its ratio to the afresh
prefill; the tokens re-read after the store; device bytes while decoding; the store's host bytes; and
whether the needle's code is in the first and last answers. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.bench.device import machine
from kvcompress.bench.haystack import fill

NEEDLE = "The vault code for the east wing is 4817."
TURNS = (
    "What is the vault code for the east wing? Answer with the code.",
    "Who wrote these essays?",
    "Name one topic the essays discuss.",
    "Summarize the first paragraph in one sentence.",
    "What did you say the code was?",
    "Is the text about startups? Answer yes or no.",
    "Give one word that appears often.",
    "How many wings are mentioned?",
    "Thank you. Anything else notable?",
    "Once more: what is the vault code for the east wing? Answer with the code.",
)
MEASURED = (1, 5, 10)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2000,4000,8000", help="document tokens, comma-separated")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=24, help="tokens decoded per answer")
    parser.add_argument("--out", default="docs/img/conversation_cpu", help="path without extension: .json is written")
    args = parser.parse_args()
    model, tok = kvc.load_model()
    method = kvc.SnapKV(budget=args.budget)
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        document = fill(tok, length, [(0.5, NEEDLE)], kind="essays")
        store = kvc.compress(model, tok, [{"role": "user", "content": document}], method=kvc.FullKV())
        store_tokens = int(store.attention_mask.sum())
        turn = store
        for number, text in enumerate(TURNS, start=1):
            turn = kvc.generate(model, tok, text, past=turn, method=method, max_new_tokens=args.tokens)
            prompt = turn.stats["prompt_tokens"]
            row = {
                "length": length,
                "turn": number,
                "ttft_s": turn.stats["prefill_s"],
                "prompt_tokens": prompt,
                "after_store": prompt - store_tokens,
                "device_bytes": turn.stats["device_bytes"],
                "store_bytes": turn.stats["context_bytes"],
                "decode_ms": turn.stats["decode_ms_per_token"],
                "answer": turn.text,
            }
            if number in MEASURED:
                afresh = kvc.generate(model, tok, turn.rows[0].messages, method=method, max_new_tokens=args.tokens)
                fresh = afresh.stats["prefill_s"]
                row.update(
                    afresh_ttft_s=fresh,
                    ttft_ratio=row["ttft_s"] / fresh,
                    same_tokens=afresh.token_ids == turn.token_ids,
                )
            rows.append(row)
            ratio = (
                f", afresh {row['afresh_ttft_s']:.2f} s ({row['ttft_ratio']:.3f}x), same tokens {row['same_tokens']}"
                if "ttft_ratio" in row
                else ""
            )
            print(
                f"{length} tokens, turn {number}: TTFT {row['ttft_s']:.2f} s{ratio}; {row['after_store']} tokens "
                f"after the store; device {row['device_bytes'] / 2**20:.2f} MiB, store "
                f"{row['store_bytes'] / 2**20:.1f} MiB; {row['answer']!r}",
                flush=True,
            )
    out = Path(args.out)
    out.with_suffix(".json").write_text(
        json.dumps({"machine": machine(model.device), "settings": vars(args), "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
