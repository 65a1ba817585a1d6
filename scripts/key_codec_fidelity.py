"""How close can keys in about 4 bits come to keys in 8? Teacher-forced fidelity of ways to code a context's keys
(issue 51: the full cache in 4 bits keeps 0.83 of the uncoded cache's answers, keys in 8 bits 1.01).

    PYTHONPATH=src python scripts/key_codec_fidelity.py --out docs/img/key_codec_fidelity.json
    PYTHONPATH=src python scripts/key_codec_fidelity.py --per-layer --contexts 8 --out docs/img/key_layers_int4.json

The question-agnostic track's 45 questions (niah, multikey, multivalue, qa_1, qa_2 over essays at 1K-4K tokens, five
depths): each context with its question is one user turn; the uncoded cache writes its greedy answer; the context's
keys and values (every layer, as the model computed them) are then coded and decoded by each scheme, and the question
and that answer are fed over them in one block. Reported per scheme: the mean KL(uncoded || coded) of the next-token
distributions over the answer's tokens, the answer's mean log-likelihood lost per token (nats), and the share of its
tokens the coded cache would also choose greedily. The values are always the library's int4 (they lose nothing
measurable: keys uncoded with int4 values agree with the uncoded cache); what moves is the keys' scheme:

* the library's codecs (per token, Hadamard-turned groups of 64 channels, a float16 scale and minimum per group):
  int4, int8, and the same rounding at 5 and 6 bits for reference;
* groups of 32 channels; Lloyd-Max levels for a Gaussian (per-token mean and deviation) instead of uniform ones;
* KIVI's per-channel keys (a scale and minimum per channel over blocks of 64 or 32 tokens);
* keys centred per KV head (softmax ignores a shift every key shares);
* transform coding: each KV head's centred keys turned into their principal axes and the bits given greedily to the
  axis whose rounding error is largest (at most 8 each; a fixed range per axis, so no bytes per token besides the
  codes), at 256 and 288 bits a token (the bytes of int4's codes, and of its codes with their scales).

Bytes are per token and KV head of 64 channels (int4 with its scales: 36; a 16-bit key: 128).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import DynamicCache

import kvcompress as kvc
from kvcompress.bench.accuracy import build_samples
from kvcompress.bench.device import machine
from kvcompress.storage.codec import hadamard, make_codec

TASKS = ("niah", "niah_multikey", "niah_multivalue", "qa_1", "qa_2")
Scheme = Callable[[torch.Tensor], torch.Tensor]  # keys [batch, kv_heads, tokens, dim] -> the keys decoded


def library(name: str) -> Scheme:
    """The library's codec ``name`` (turned), encoded and restored."""

    def run(keys: torch.Tensor) -> torch.Tensor:
        codec = make_codec(name, keys.shape[-1], keys.dtype, rotated=True)
        return codec.restore(codec.encode(keys))

    return run


def turned(keys: torch.Tensor, group: int) -> torch.Tensor:
    """Each group of ``group`` channels times the orthonormal Hadamard matrix (its own inverse)."""
    return (keys.float().unflatten(-1, (-1, group)) @ hadamard(group, keys.device)).flatten(-2)


def per_token(bits: int, group: int = 64, gaussian: bool = False) -> Scheme:
    """Per token and turned group: uniform levels between the group's minimum and maximum (float16 scale and
    minimum), or (``gaussian``) Lloyd-Max levels for a normal variable scaled by the group's mean and deviation."""
    levels = lloyd_max(1 << bits) if gaussian else None

    def run(keys: torch.Tensor) -> torch.Tensor:
        groups = turned(keys, group).unflatten(-1, (-1, group))
        if levels is not None:
            mean = groups.mean(-1, keepdim=True).half().float()
            spread = groups.std(-1, keepdim=True).clamp_min(1e-8).half().float()
            nearest = ((groups - mean) / spread).unsqueeze(-1).sub(levels).abs().argmin(-1)
            return turned((levels[nearest] * spread + mean).flatten(-2), group)
        low, high = torch.aminmax(groups, dim=-1, keepdim=True)
        return turned(uniform(groups, low, high, bits).flatten(-2), group)

    return run


def uniform(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int | torch.Tensor) -> torch.Tensor:
    """``x`` rounded to ``2^bits`` even levels from ``low`` to ``high`` (float16 scale and minimum)."""
    top = (2 ** torch.as_tensor(bits) - 1).float()
    scale = ((high - low) / top.clamp_min(1)).clamp_min(1e-8).half().float()
    low = low.half().float()
    return ((x - low) / scale).round().clamp(torch.zeros_like(top), top) * scale + low


def lloyd_max(count: int, rounds: int = 60) -> torch.Tensor:
    """Levels minimising the squared error of a standard normal variable (Lloyd's iterations on 2M samples)."""
    sample = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0))
    levels = torch.linspace(-2.5, 2.5, count)
    for _ in range(rounds):
        nearest = (sample[:, None] - levels).abs().argmin(1)
        levels = torch.stack([sample[nearest == i].mean() for i in range(count)])
    return levels


def per_channel(bits: int, block: int) -> Scheme:
    """KIVI's keys: a scale and minimum per channel over blocks of ``block`` tokens (the last block padded)."""

    def run(keys: torch.Tensor) -> torch.Tensor:
        tokens = keys.shape[-2]
        pad = keys[..., -1:, :].expand(*keys.shape[:-2], (-tokens) % block, keys.shape[-1])
        blocks = torch.cat([keys, pad], -2).float().unflatten(-2, (-1, block))
        low, high = torch.aminmax(blocks, dim=-2, keepdim=True)
        return uniform(blocks, low, high, bits).flatten(-3, -2)[..., :tokens, :]

    return run


def centred(inner: Scheme) -> Scheme:
    """``inner`` on keys minus their mean per KV head (added back: attention is the same either way)."""

    def run(keys: torch.Tensor) -> torch.Tensor:
        mean = keys.float().mean(-2, keepdim=True)
        return inner(keys.float() - mean) + mean

    return run


def transform_coded(total_bits: int, most: int = 8) -> Scheme:
    """Each KV head's centred keys on their principal axes, ``total_bits`` a token given greedily to the axis with
    the largest rounding error (variance / 4^bits), each axis rounded evenly over its range in the context."""

    def run(keys: torch.Tensor) -> torch.Tensor:
        flat = keys.float().flatten(0, 1)
        out = torch.empty_like(flat)
        for head, x in enumerate(flat):
            mean = x.mean(0, keepdim=True)
            variance, axes = torch.linalg.eigh((x - mean).T @ (x - mean) / x.shape[0])
            coords = (x - mean) @ axes
            bits = torch.zeros(x.shape[-1], dtype=torch.long)
            error = variance.clamp_min(1e-12).clone()
            for _ in range(total_bits):
                axis = int(error.argmax())
                bits[axis] += 1
                error[axis] = -1.0 if bits[axis] == most else error[axis] / 4
            low, high = torch.aminmax(coords, dim=0)
            rounded = torch.where(bits > 0, uniform(coords, low, high, bits), coords.mean(0))
            out[head] = rounded @ axes.T + mean
        return out.view_as(keys)

    return run


SCHEMES: dict[str, tuple[str, int, Scheme]] = {  # name: (what it is, bytes per token and KV head of 64, scheme)
    "uncoded": ("uncoded keys (int4 values)", 128, lambda keys: keys),
    "int8": ("int8 (library)", 68, library("int8")),
    "int6": ("int6, per token", 52, per_token(6)),
    "int5": ("int5, per token", 44, per_token(5)),
    "int4": ("int4 (library)", 36, library("int4")),
    "int4-g32": ("int4, groups of 32 channels", 40, per_token(4, group=32)),
    "int4-lloyd": ("int4, Lloyd-Max levels", 36, per_token(4, gaussian=True)),
    "int4-centred": ("int4, centred per KV head", 36, centred(library("int4"))),
    "kivi64": ("int4 per channel, blocks of 64 tokens (KIVI)", 36, per_channel(4, 64)),
    "kivi32": ("int4 per channel, blocks of 32 tokens (KIVI)", 40, per_channel(4, 32)),
    "tc256": ("transform coded, 256 bits", 32, transform_coded(256)),
    "tc288": ("transform coded, 288 bits", 36, transform_coded(288)),
}


def answer_logprobs(
    model, ids: torch.Tensor, context: int, answer: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Log-probabilities before each answer token, with the first ``context`` tokens' keys and values ``layers``."""
    cache = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    rest = torch.cat([ids[0, context:], answer])[None]
    return model(rest, past_key_values=cache).logits[0, -(len(answer) + 1) : -1].float().log_softmax(-1)


def answered_questions(model, tokenizer, contexts: int) -> Iterator[tuple[torch.Tensor, int, torch.Tensor, list]]:
    """For each question of the track's first ``contexts`` contexts: its prompt's ids, the context's length in
    them, the uncoded cache's greedy answer, and the context's keys and values per layer as the model computed them."""
    samples = build_samples(tokenizer, list(TASKS), [1000, 2000, 4000], [0.1, 0.3, 0.5, 0.7, 0.9], 1, 0, "essays")
    for number, sample in enumerate(samples[:contexts], start=1):
        alone = tokenizer.apply_chat_template([{"role": "user", "content": sample.context}], return_dict=True)
        context = len(alone["input_ids"]) - 8  # the context's tokens, not the turn's closing ones
        for turn in sample.questions():
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{sample.context}\n\n{turn.question}"}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )
            ids = ids["input_ids"]
            answer = model.generate(ids, max_new_tokens=sample.max_new_tokens, do_sample=False)[0, ids.shape[1] :]
            cache = DynamicCache(config=model.config)
            model(ids[:, :context], past_key_values=cache)
            yield ids, context, answer, [(layer.keys, layer.values) for layer in cache.layers]
        print(f"context {number}/{min(contexts, len(samples))}", flush=True)


def measure(model, tokenizer, schemes: list[str], contexts: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per scheme, (KL, nats lost per token, greedy agreement) for every question of the track's first
    ``contexts`` contexts."""
    values = make_codec("int4", model.config.head_dim, model.dtype, rotated=True)
    found: dict[str, list[tuple[float, float, float]]] = {name: [] for name in schemes}
    for ids, context, answer, held in answered_questions(model, tokenizer, contexts):
        reference = answer_logprobs(model, ids, context, answer, held)
        for name in schemes:
            coded = [(SCHEMES[name][2](k).to(k.dtype), values.restore(values.encode(v))) for k, v in held]
            got = answer_logprobs(model, ids, context, answer, coded)
            kl = (reference.exp() * (reference - got)).sum(-1).clamp_min(0).mean()
            lost = (reference - got).gather(-1, answer[:, None]).mean()
            agreed = (got.argmax(-1) == answer).float().mean()
            found[name].append((float(kl), float(lost), float(agreed)))
    return found


def per_layer(model, tokenizer, contexts: int) -> dict[str, float | list[float]]:
    """Which layers' 4-bit keys cost the most: the mean KL over the answers when only one layer's keys are the
    library's int4 (the others uncoded; values int4 everywhere), per layer, and with every layer's in int4."""
    values = make_codec("int4", model.config.head_dim, model.dtype, rotated=True)
    int4, layers = library("int4"), model.config.num_hidden_layers
    totals, count = [0.0] * (layers + 1), 0
    for ids, context, answer, held in answered_questions(model, tokenizer, contexts):
        held = [(k, values.restore(values.encode(v))) for k, v in held]
        reference = answer_logprobs(model, ids, context, answer, held)
        for coded_layer in range(layers + 1):  # the last: every layer
            coded = [
                (int4(k).to(k.dtype) if i == coded_layer or coded_layer == layers else k, v)
                for i, (k, v) in enumerate(held)
            ]
            got = answer_logprobs(model, ids, context, answer, coded)
            totals[coded_layer] += float((reference.exp() * (reference - got)).sum(-1).clamp_min(0).mean())
        count += 1
    return {"per_layer_kl": [t / count for t in totals[:layers]], "every_layer_kl": totals[layers] / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/key_codec_fidelity.json")
    parser.add_argument("--contexts", type=int, default=27, help="the track's first N contexts (27: all)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated names from SCHEMES")
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="instead: the KL of each layer's keys alone in int4 (docs/quantization.md)",
    )
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        raise SystemExit(f"--schemes: unknown {unknown}; valid: {', '.join(SCHEMES)}")
    torch.set_grad_enabled(False)
    model, tokenizer = kvc.load_model()
    started = time.time()
    if args.per_layer:
        found = per_layer(model, tokenizer, args.contexts)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"machine": machine(model.device), "contexts": args.contexts, **found}, indent=1) + "\n"
        )
        ranked = sorted(range(len(found["per_layer_kl"])), key=lambda i: -found["per_layer_kl"][i])
        print(
            f"every layer in int4: KL {found['every_layer_kl']:.4f}; the costliest layers alone: "
            + ", ".join(f"{i} ({found['per_layer_kl'][i]:.5f})" for i in ranked[:5])
        )
        return
    found = measure(model, tokenizer, schemes, args.contexts)
    rows = [
        {
            "scheme": name,
            "keys": SCHEMES[name][0],
            "key_bytes": SCHEMES[name][1],
            "questions": len(found[name]),
            **{
                field: sum(r[i] for r in found[name]) / len(found[name])
                for i, field in enumerate(("kl", "nats_lost_per_token", "greedy_agreement"))
            },
        }
        for name in schemes
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"machine": machine(model.device), "seconds": round(time.time() - started), "rows": rows}, indent=1)
        + "\n"
    )
    print("| keys | bytes | KL | nats lost / token | greedy agreement |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['keys']} | {row['key_bytes']} | {row['kl']:.4f} | {row['nats_lost_per_token']:.4f} | "
            f"{row['greedy_agreement']:.3f} |"
        )
    print(f"wrote {args.out} ({math.ceil((time.time() - started) / 60)} min)")


if __name__ == "__main__":
    main()
