"""What flips when SnapKV at 1/16 disagrees with the full cache (issue 67, item 5): which tokens, and which layers lost
the answer's evidence.

    PYTHONPATH=src python scripts/what_flips.py --contexts 12 --out docs/img/what_flips.json

bench shared-context's contexts (~2,000 tokens of essays, five facts "The code of the grey horse is 9883."), each
question asked on its own over the stored context. The full cache's answer is teacher-forced under SnapKV (budget 1/16
of the context, the default settings) and every token where SnapKV's top token differs from the full cache's is a
flip, classed by the full cache's token: the answer's first token, a digit, a word, or punctuation and space. Beside
it, per layer, the share of the asked fact's code digits and of its name's tokens (the evidence) SnapKV kept, averaged
over KV heads, for the answers whose digits flipped and for those whose digits held."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.bench.agreement import FullAnswers
from kvcompress.bench.shared_context import asked, make_sample, resolved
from kvcompress.generation.conversation import context_ids, user_prompt


def token_class(tok, token: int, first: bool) -> str:
    text = tok.decode([token])
    if first:
        return "first"
    if text.strip().isdigit():
        return "digit"
    if any(c.isalpha() for c in text):
        return "word"
    return "punctuation/space"


def evidence(tok, ids: list[int], text: str, phrase: str) -> list[int]:
    """Token positions of ``ids`` (tokens of ``text``) that overlap ``phrase``'s characters in ``text``."""
    encoded = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    if encoded["input_ids"] != ids:
        raise RuntimeError("the context's tokens do not re-tokenize to themselves; cannot place the evidence")
    start = text.find(phrase)
    end = start + len(phrase)
    return [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < end and b > start and start >= 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=12)
    parser.add_argument("--model", default=None)
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--fraction", type=float, default=1 / 16)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="the full cache's answer (Gemma's runs: 8)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model, tok = kvc.load_model(args.model)
    layers = model.config.get_text_config().num_hidden_layers
    counts: dict[str, list[int]] = {}  # class -> [tokens, flips]
    kept = {"digits flipped": [], "digits held": []}  # per answer: [layers] share of the code's digits kept
    names = {"digits flipped": [], "digits held": []}
    for seed in range(args.contexts):
        sample = make_sample(tok, 2000, seed, 5)
        store = kvc.compress(model, tok, user_prompt(tok, sample.context), method=kvc.FullKV(), query_window=None)
        tokens = int(store.attention_mask.sum())
        method = resolved(args.method, tokens, args.fraction)
        ids = context_ids(tok, store.rows[0])
        text = tok.decode(ids)
        questions = asked(tok, sample)
        full = FullAnswers(model, tok, store, questions, args.max_new_tokens, requests=len(questions) - 1)
        for (past, answer, reference), question, (raw, code) in zip(
            full.of("multi-request"), questions, sample.questions
        ):
            forced = kvc.forced_logprobs(model, tok, answer, prompt=question, past=past, method=method)
            flipped = (reference.argmax(-1) != forced.argmax(-1)).tolist()
            digit_flip = False
            for i, (token, flip) in enumerate(zip(reference.argmax(-1).tolist(), flipped)):
                kind = token_class(tok, token, i == 0)
                counts.setdefault(kind, [0, 0])
                counts[kind][0] += 1
                counts[kind][1] += int(flip)
                digit_flip |= flip and kind in ("digit", "first") and tok.decode([token]).strip().isdigit()
            name = raw.split("code of the ")[1].split("?")[0]
            digits = evidence(tok, ids, text, f" is {code}.")
            digits = [p for p in digits if tok.decode([ids[p]]).strip().isdigit()]
            name_tokens = evidence(tok, ids, text, f"the {name} is")
            result = kvc.generate(model, tok, question, past=past, method=method, max_new_tokens=1)
            group = "digits flipped" if digit_flip else "digits held"
            per_layer, per_layer_name = [], []
            for layer in range(layers):
                positions = result.cache.kept_positions(layer)[0]  # [kv_heads, n]
                per_layer.append(
                    float(torch.isin(positions, torch.tensor(digits)).sum(-1).float().mean()) / max(1, len(digits))
                )
                per_layer_name.append(
                    float(torch.isin(positions, torch.tensor(name_tokens)).sum(-1).float().mean())
                    / max(1, len(name_tokens))
                )
            kept[group].append(per_layer)
            names[group].append(per_layer_name)
        print(f"context {seed + 1}/{args.contexts}: flips by class {counts}", flush=True)
    summary = {
        "settings": {
            "contexts": args.contexts,
            "method": args.method,
            "fraction": args.fraction,
            "model": args.model or "smollm2-135m-instruct",
            "max_new_tokens": args.max_new_tokens,
        },
        "flip_rate": {k: {"tokens": t, "flips": f, "rate": round(f / t, 3)} for k, (t, f) in counts.items()},
        "answers": {group: len(rows) for group, rows in kept.items()},
        "digits_kept_by_layer": {
            group: [round(sum(c) / len(rows), 3) for c in zip(*rows)] if rows else [] for group, rows in kept.items()
        },
        "name_kept_by_layer": {
            group: [round(sum(c) / len(rows), 3) for c in zip(*rows)] if rows else [] for group, rows in names.items()
        },
    }
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
