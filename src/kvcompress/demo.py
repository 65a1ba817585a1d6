"""The built-in demo: a long document with one fact buried in it and a question at the end, answered
with several methods at the same budget, shown side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .bench.haystack import prose_sentences
from .generation.generate import generate
from .methods import FullKV, Method, SnapKV, StreamingLLM

NEEDLE = "The access code for the archive room in the east wing is 4817."
QUESTION = "What is the access code for the archive room in the east wing? Answer with the number only."
ANSWER = "4817"


def build_document(tokenizer: PreTrainedTokenizerBase, target_tokens: int, depth: float = 0.4) -> str:
    """About ``target_tokens`` tokens of prose with ``NEEDLE`` inserted at ``depth`` (0 = start, 1 = end)."""
    chosen, total = [], 0
    for sentence in prose_sentences():
        if total >= target_tokens:
            break
        chosen.append(sentence)
        total += len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
    chosen.insert(round(depth * len(chosen)), NEEDLE)
    return " ".join(chosen)


@dataclass
class DemoRow:
    method: str
    label: str
    answer: str
    correct: bool
    stats: dict


def demo_methods(budget: int) -> list[Method]:
    """The methods the demo compares at one budget: the full cache, SnapKV as kvcompress runs it
    (words and numbers kept whole), SnapKV exactly as the paper's Listing 1 (LongBench setting), and
    StreamingLLM."""
    return [FullKV(), SnapKV(budget=budget), SnapKV(budget=budget, clustering="pool"), StreamingLLM(budget=budget)]


def run_demo(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    methods: list[Method],
    target_tokens: int = 2000,
    depth: float = 0.5,
    max_new_tokens: int = 32,
    on_start=None,
) -> list[DemoRow]:
    """Ask the buried-fact question with each method; ``on_start(method)`` is called before each."""
    document = build_document(tokenizer, target_tokens, depth)
    messages = [{"role": "user", "content": f"Read this document.\n\n{document}\n\n{QUESTION}"}]
    rows = []
    for method in methods:
        if on_start:
            on_start(method)
        result = generate(model, tokenizer, messages, method=method, max_new_tokens=max_new_tokens)
        answer = cast(str, result.text)  # (one prompt: one answer)
        rows.append(DemoRow(method.describe(), method.label(), answer.strip(), ANSWER in answer, result.stats))
    return rows
