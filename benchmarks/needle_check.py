"""Needle, passkey and two-turn retrieval on the embedded model for a few methods.

    python benchmarks/needle_check.py [--lengths 2000 4000] [--depths 0.1 0.3 0.5 0.7 0.9] [--out FILE]

A quick check of answers (not the full accuracy suite): for each length and depth, a needle in
standard-library prose and a passkey in repeated filler, each asked once per method; then a
two-turn case where the second question (asked over the same cache, after the first answer) needs a
fact the first question did not touch (ShadowKV Fig. 7's multi-turn setting).
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

PASSKEY = "71432"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
SECOND_NEEDLE = "The locker number of the night guard is 2958."
SECOND_QUESTION = "What is the locker number of the night guard? Answer with the number only."


def passkey_prompt(tokenizer, target_tokens: int, depth: float) -> str:
    repeats = max(1, target_tokens // len(tokenizer(FILLER, add_special_tokens=False)["input_ids"]))
    cut = round(depth * repeats)
    needle = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. "
    return FILLER * cut + needle + FILLER * (repeats - cut) + "\n\nWhat is the pass key? Answer with the number only."


def needle_prompt(tokenizer, target_tokens: int, depth: float) -> str:
    return f"Read this document.\n\n{demo.build_document(tokenizer, target_tokens, depth)}\n\n{demo.QUESTION}"


def two_turn_document(tokenizer, target_tokens: int) -> str:
    """The demo document with a second fact near its start (far from the first)."""
    document = demo.build_document(tokenizer, target_tokens, depth=0.7)
    head, _, tail = document.partition(". ")
    return f"{head}. {SECOND_NEEDLE} {tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="needle_check.json")
    args = parser.parse_args()

    model, tok = kvc.load_model()
    methods = {
        "full": kvc.FullKV(),
        "snapkv-256": kvc.SnapKV(budget=256, window=16, kernel=5),
        "shadowkv": kvc.ShadowKV(),
        "shadowkv-1.56%": kvc.ShadowKV(sparse_ratio=0.0156),
        "shadowkv-rank64": kvc.ShadowKV(rank=64),
    }
    cases = [
        (task, length, depth, builder(tok, length, depth), answer)
        for task, builder, answer in (("needle", needle_prompt, demo.ANSWER), ("passkey", passkey_prompt, PASSKEY))
        for length in args.lengths
        for depth in args.depths
    ]
    records = []
    for task, length, depth, prompt, answer in tqdm(cases, desc="single-turn cases"):
        for name, method in methods.items():
            result = kvc.generate(model, tok, [{"role": "user", "content": prompt}], method=method, max_new_tokens=args.max_new_tokens)
            records.append({"task": task, "length": length, "depth": depth, "method": name, "correct": answer in result.text,
                            "answer": result.text[-40:], "prompt_tokens": result.stats["prompt_tokens"]})
    for length in tqdm(args.lengths, desc="two-turn cases"):
        document = two_turn_document(tok, length)
        for name, method in methods.items():
            first = kvc.generate(model, tok, [{"role": "user", "content": f"Read this document.\n\n{document}\n\n{demo.QUESTION}"}],
                                 method=method, max_new_tokens=args.max_new_tokens)
            second = kvc.generate(model, tok, SECOND_QUESTION, past=first, max_new_tokens=args.max_new_tokens)
            for turn, result, answer in ((1, first, demo.ANSWER), (2, second, "2958")):
                records.append({"task": f"two-turn t{turn}", "length": length, "depth": None, "method": name,
                                "correct": answer in result.text, "answer": result.text[-40:]})

    print("\nmethod            " + "".join(f"{task:>16s}" for task in dict.fromkeys(r["task"] for r in records)))
    full_right = {(r["task"], r["length"], r["depth"]) for r in records if r["method"] == "full" and r["correct"]}
    for name in methods:
        cells = []
        for task in dict.fromkeys(r["task"] for r in records):
            mine = [r for r in records if r["method"] == name and r["task"] == task]
            where_full_right = [r for r in mine if (r["task"], r["length"], r["depth"]) in full_right]
            cells.append(f"{sum(r['correct'] for r in mine)}/{len(mine)} ({sum(r['correct'] for r in where_full_right)}/{len(where_full_right)})")
        print(f"{name:18s}" + "".join(f"{c:>16s}" for c in cells))
    print("cells: correct/all (correct/cases where full is correct)")
    info = {"machine": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "model": "SmolLM2-135M-Instruct float32", "methods": {k: m.describe() for k, m in methods.items()}, "settings": vars(args)}
    with open(args.out, "w") as fh:
        json.dump({**info, "records": records}, fh, indent=2)


if __name__ == "__main__":
    main()
