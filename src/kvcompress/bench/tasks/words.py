"""RULER aggregation tasks: common-words extraction (cwe) over a numbered word list, and
frequent-words extraction (fwe) over Zipf-distributed coded words."""

from __future__ import annotations

import random
import string

from transformers import PreTrainedTokenizerBase

from .base import ADJECTIVES, NOUNS, Sample, Turn, prompt_tokens


def _grow(tokenizer: PreTrainedTokenizerBase, length: int, question: str, render, add_one) -> list[str]:
    """Add items (``add_one``) until the rendered prompt reaches ``length`` tokens, then drop the overshoot."""
    items: list[str] = []
    step = 16
    while prompt_tokens(tokenizer, render(items), question) < length:
        for _ in range(step):
            add_one(items)
    while items and prompt_tokens(tokenizer, render(items), question) > length:
        items.pop()
    return items


def common_words(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, n_common: int = 10, repeats: int = 6
) -> Sample:
    rng = random.Random(seed)
    pool = [f"{a}{n}" for a in ADJECTIVES for n in NOUNS]
    rng.shuffle(pool)
    common, rare = pool[:n_common], iter(pool[n_common:])
    question = f"What are the {n_common} most common words in the above list? Answer with the words only."
    intro = "Below is a numbered list of words. Some of them appear more often than the others.\n"
    body = [w for w in common for _ in range(repeats)]

    def add_rare(items: list[str]) -> None:
        word = next(rare)
        items.extend([word, word])

    def render(rares: list[str]) -> str:
        words = body + rares
        random.Random(seed).shuffle(words)
        return intro + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    floor = prompt_tokens(tokenizer, render([]), question)
    if floor > length:
        raise ValueError(
            f"cwe: length={length} is too short for {n_common} common words x {repeats}; it needs at least {floor} "
            "tokens"
        )
    rares = _grow(tokenizer, length, question, render, add_rare)
    return Sample(f"cwe-{length}-{seed}", "cwe", length, render(rares), [Turn(question, common)], max_new_tokens=80)


def frequent_words(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, alpha: float = 2.0
) -> Sample:
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice(string.ascii_lowercase) for _ in range(5)) for _ in range(400)]
    weights = [1 / (rank + 1) ** alpha for rank in range(len(vocabulary))]
    question = (
        "What are the three most frequently appearing coded words in the above text? Answer with the three words only."
    )
    intro = "Read the following coded text and track how often each coded word appears.\n"
    items = _grow(
        tokenizer,
        length,
        question,
        lambda ws: intro + " ".join(ws),
        lambda ws: ws.append(rng.choices(vocabulary, weights)[0]),
    )
    counts = {w: items.count(w) for w in set(items)}
    top = sorted(counts, key=lambda w: -counts[w])[:3]
    return Sample(
        f"fwe-{length}-{seed}", "fwe", length, intro + " ".join(items), [Turn(question, top)], max_new_tokens=24
    )
