"""RULER variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in prose;
name every variable that ends up holding the value."""

from __future__ import annotations

import random
import string

from transformers import PreTrainedTokenizerBase

from .base import Sample, Turn, fit_haystack, number


def variable_tracking(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, haystack: str = "prose", hops: int = 4
) -> Sample:
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = number(rng, 5)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(min(0.95, depth + i * (1 - depth) / (hops + 1)) for i in range(hops + 1))
    question = (
        f"Find all variables that are assigned the value {value} in the text above. Answer with the variable "
        "names only."
    )
    prefix = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
    context = fit_haystack(
        tokenizer, length, question, list(zip(depths, statements)), kind=haystack, seed=seed, prefix=prefix
    )
    return Sample(
        f"vt-{length}-{depth:.2f}-{seed}",
        "vt",
        length,
        context,
        [Turn(question, names)],
        depth=depth,
        max_new_tokens=40,
        info={"haystack_start": len(prefix)},
    )
