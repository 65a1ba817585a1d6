"""LongEval-Lines (the SnapKV pooling ablation, Fig. 8): many lines
``line <adjective-noun>: REGISTER_CONTENT is <5-digit>``; retrieve one line's value."""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerBase

from .base import Sample, Turn, distinct_keys, number, prompt_tokens

INTRO = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line name>' and ends with its "
    "REGISTER_CONTENT, a number. At the end of the record I will ask for the REGISTER_CONTENT of one line.\n"
)


def lines(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int) -> Sample:
    rng = random.Random(seed)
    names = distinct_keys(rng, 600)
    # Fit with the longest name in the question, so the real question never pushes past the target.
    longest = f"Tell me the REGISTER_CONTENT in line {max(names, key=len)}. Answer with the number only."
    records: list[str] = []
    for name in names:
        records.append(f"line {name}: REGISTER_CONTENT is <{number(rng, 5)}>")
        if len(records) % 8 == 0 and prompt_tokens(tokenizer, INTRO + "\n".join(records), longest) >= length:
            break
    while len(records) > 1 and prompt_tokens(tokenizer, INTRO + "\n".join(records), longest) > length:
        records.pop()
    target = round(depth * (len(records) - 1))
    name, value = records[target][len("line ") :].split(":")[0], records[target].split("<")[1].rstrip(">")
    question = f"Tell me the REGISTER_CONTENT in line {name}. Answer with the number only."
    return Sample(
        f"lines-{length}-{depth:.2f}-{seed}",
        "lines",
        length,
        INTRO + "\n".join(records),
        [Turn(question, [value])],
        depth=depth,
        info={"haystack_start": len(INTRO)},
    )
