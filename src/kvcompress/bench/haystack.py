"""Haystacks made offline: natural prose from the standard library's documentation (the default), or
one repeated filler passage (the classic passkey setting). Deterministic for a seed."""

from __future__ import annotations

import inspect
import random
import re
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from ..generation.stops import text_of
from .ruler import essay_sentences

# Modules whose documentation makes the prose: English that ships with every Python.
PROSE_MODULES = (
    "argparse",
    "calendar",
    "csv",
    "difflib",
    "email",
    "fractions",
    "heapq",
    "json",
    "logging",
    "sched",
    "shutil",
    "string",
    "textwrap",
    "threading",
    "zipfile",
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Sentences of the standard library's docstrings, cleaned of code and markup, in a fixed order."""
    import importlib  # noqa: PLC0415 - the standard library's modules, read only for this haystack

    sentences: list[str] = []
    for module_name in PROSE_MODULES:
        module = importlib.import_module(module_name)
        objects = [obj for _, obj in sorted(vars(module).items()) if inspect.isclass(obj) or inspect.isfunction(obj)]
        for doc in [inspect.getdoc(module)] + [inspect.getdoc(obj) for obj in objects]:
            if not doc:
                continue
            text = re.sub(r"\s+", " ", re.sub(r"[`*>|=_{}\[\]<]", " ", doc))
            for sentence in re.split(r"(?<=[.!?]) ", text):
                if (
                    40 <= len(sentence) <= 300
                    and sentence[0].isupper()
                    and sentence.endswith(".")
                    and "(" not in sentence
                ):
                    sentences.append(sentence)
    return tuple(dict.fromkeys(sentences))


HAYSTACKS = ("prose", "repeat", "essays")


def haystack_sentences(kind: str = "prose", seed: int | None = None) -> list[str]:
    """An endless-enough supply of sentences: ``prose`` (shuffled by ``seed``; None keeps the
    fixed order), ``repeat`` (the filler passage over and over) or ``essays`` (Paul Graham's essays,
    RULER's haystack, in order from a point chosen by ``seed``)."""
    if kind == "repeat":
        return FILLER.split(". ") * 400
    if kind == "essays":
        sentences = list(essay_sentences())
        start = random.Random(seed).randrange(len(sentences)) if seed is not None else 0
        return (sentences[start:] + sentences[:start]) * 2
    if kind != "prose":
        raise ValueError(f"haystack kind={kind!r} is unknown; valid: {', '.join(HAYSTACKS)}")
    sentences = [s for s in prose_sentences() if "::" not in s and ">>>" not in s]
    if seed is not None:
        random.Random(seed).shuffle(sentences)
    return sentences * 4


def token_len(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fill(
    tokenizer: PreTrainedTokenizerBase,
    n_tokens: int,
    inserts: list[tuple[float, str]],
    kind: str = "prose",
    seed: int | None = None,
) -> str:
    """About ``n_tokens`` tokens of haystack with each ``(depth, text)`` insert placed at that depth
    (0 = start, 1 = end): at the sentence boundary nearest to that fraction of the haystack's tokens
    (of the haystack alone, not of haystack + inserts). The last sentence is cut at a token boundary
    so the haystack lands on its target."""
    chosen: list[str] = []
    before = [0]  # tokens before each sentence boundary
    for sentence in haystack_sentences(kind, seed):
        size = token_len(tokenizer, " " + sentence.rstrip(".") + ".")
        if before[-1] + size > n_tokens:
            ids = tokenizer(" " + sentence, add_special_tokens=False)["input_ids"][: n_tokens - before[-1]]
            if ids:
                chosen.append(text_of(tokenizer, ids).strip())
                before.append(before[-1] + len(ids))
            break
        chosen.append(sentence.rstrip(".") + ".")
        before.append(before[-1] + size)
    for depth, text in sorted(inserts, key=lambda item: item[0], reverse=True):
        chosen.insert(min(range(len(before)), key=lambda i: abs(before[i] - depth * before[-1])), text)
    return " ".join(chosen)
