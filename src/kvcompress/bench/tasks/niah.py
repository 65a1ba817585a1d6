"""Needle tasks: the needle-in-a-haystack grid, passkey retrieval, RULER's four NIAH variants and
the multi-turn needles of ShadowKV Fig. 7. Needles sit in natural prose (passkey: repeated filler)."""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerBase

from .base import Sample, Turn, distinct_keys, fit_haystack, number


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _ask(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the provided text? Answer with the number only."


def niah(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose") -> Sample:
    """One needle at ``depth`` (the SnapKV Fig. 6 / ShadowKV needle grid)."""
    rng = random.Random(seed)
    key, value = distinct_keys(rng, 1)[0], number(rng, 7)
    question = _ask(key)
    context = fit_haystack(tokenizer, length, question, [(depth, _needle(key, value))], kind=haystack, seed=seed)
    return Sample(f"niah-{length}-{depth:.2f}-{seed}", "niah", length, context, [Turn(question, [value])], depth=depth)


ROOMS = (
    "archive room",
    "server room",
    "map room",
    "boiler room",
    "print room",
    "music room",
    "reading room",
    "store room",
)
WINGS = ("east wing", "west wing", "north tower", "south hall", "basement", "top floor")


def fact(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose") -> Sample:
    """One plain-English fact with a 4-digit code, asked at the end (the demo's buried fact)."""
    rng = random.Random(seed)
    room, wing, code = rng.choice(ROOMS), rng.choice(WINGS), number(rng, 4)
    question = f"What is the access code for the {room} in the {wing}? Answer with the number only."
    needle = f"The access code for the {room} in the {wing} is {code}."
    prefix = "Read this document.\n\n"
    context = fit_haystack(tokenizer, length, question, [(depth, needle)], kind=haystack, seed=seed, prefix=prefix)
    return Sample(
        f"fact-{length}-{depth:.2f}-{seed}",
        "fact",
        length,
        context,
        [Turn(question, [code])],
        depth=depth,
        info={"haystack_start": len(prefix)},
    )


def passkey(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "repeat"
) -> Sample:
    """A pass key in repeated filler, asked for at the end."""
    rng = random.Random(seed)
    key = number(rng, 5)
    question = "What is the pass key? Answer with the number only."
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    prefix = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    context = fit_haystack(tokenizer, length, question, [(depth, needle)], kind=haystack, seed=seed, prefix=prefix)
    return Sample(
        f"passkey-{length}-{depth:.2f}-{seed}",
        "passkey",
        length,
        context,
        [Turn(question, [key])],
        depth=depth,
        info={"haystack_start": len(prefix)},
    )


def niah_single(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose"
) -> Sample:
    sample = niah(tokenizer, length, depth, seed, haystack)
    sample.id, sample.task = sample.id.replace("niah", "niah_single", 1), "niah_single"
    return sample


def niah_multikey(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose"
) -> Sample:
    """Four needles with different keys; one is asked (the others distract; the question-agnostic
    track asks for each of them)."""
    rng = random.Random(seed)
    keys = distinct_keys(rng, 4)
    values = [number(rng, 7) for _ in keys]
    depths = [depth] + [rng.random() for _ in keys[1:]]
    question = _ask(keys[0])
    context = fit_haystack(
        tokenizer,
        length,
        question,
        [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values)],
        kind=haystack,
        seed=seed,
    )
    probes = [Turn(_ask(k), [v]) for k, v in zip(keys[1:], values[1:])]
    return Sample(
        f"niah_multikey-{length}-{depth:.2f}-{seed}",
        "niah_multikey",
        length,
        context,
        [Turn(question, [values[0]])],
        depth=depth,
        probes=probes,
    )


def niah_multivalue(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose"
) -> Sample:
    """Four values for one key, all asked for."""
    rng = random.Random(seed)
    key = distinct_keys(rng, 1)[0]
    values = [number(rng, 7) for _ in range(4)]
    depths = [depth] + [rng.random() for _ in values[1:]]
    question = (
        f"What are all the special magic numbers for {key} mentioned in the provided text? List the numbers only."
    )
    context = fit_haystack(
        tokenizer, length, question, [(d, _needle(key, v)) for d, v in zip(depths, values)], kind=haystack, seed=seed
    )
    return Sample(
        f"niah_multivalue-{length}-{depth:.2f}-{seed}",
        "niah_multivalue",
        length,
        context,
        [Turn(question, values)],
        depth=depth,
        max_new_tokens=48,
    )


def niah_multiquery(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose"
) -> Sample:
    """Four keys with one value each, all asked for in one question."""
    rng = random.Random(seed)
    keys = distinct_keys(rng, 4)
    values = [number(rng, 7) for _ in keys]
    depths = [depth] + [rng.random() for _ in keys[1:]]
    question = (
        f"What are the special magic numbers for {', '.join(keys[:-1])} and {keys[-1]} mentioned in the "
        "provided text? List the numbers only."
    )
    context = fit_haystack(
        tokenizer,
        length,
        question,
        [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values)],
        kind=haystack,
        seed=seed,
    )
    return Sample(
        f"niah_multiquery-{length}-{depth:.2f}-{seed}",
        "niah_multiquery",
        length,
        context,
        [Turn(question, values)],
        depth=depth,
        max_new_tokens=48,
    )


def multiturn(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose", turns: int = 3
) -> Sample:
    """``turns`` needles spread over the context; each turn asks for one of them over the same cache."""
    rng = random.Random(seed)
    keys = distinct_keys(rng, turns)
    values = [number(rng, 7) for _ in keys]
    depths = [(depth + i / turns) % 1.0 for i in range(turns)]
    questions = [_ask(k) for k in keys]
    context = fit_haystack(
        tokenizer,
        length,
        questions[0],
        [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values)],
        kind=haystack,
        seed=seed,
    )
    return Sample(
        f"multiturn-{length}-{depth:.2f}-{seed}",
        "multiturn",
        length,
        context,
        [Turn(q, [v]) for q, v in zip(questions, values)],
        depth=depth,
        info={"needle_depths": depths},
    )
