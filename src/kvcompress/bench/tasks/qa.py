"""RULER's ``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA): a question over documents, most of them
distractors, scored as RULER scores QA (any reference answer contained in the prediction).

As in RULER, the answering documents come first, then distractors (the related paragraphs, then
random ones from the pool) until the prompt reaches its length; the documents are shuffled, each
rendered as ``Document {i}:\\n{text}``, between RULER's instructions. Up to ``PROBES`` other
questions of the pool whose documents all made it into the context are kept as probes."""

from __future__ import annotations

import itertools
import random

from transformers import PreTrainedTokenizerBase

from ...generation.stops import text_of
from ..haystack import token_len
from ..ruler import questions
from .base import Sample, Turn, prompt_tokens

PROBES = 3  # other questions whose documents the context holds whole, asked by the question-agnostic track
INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)


def _context(documents: list[str]) -> str:
    body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(documents))
    return f"{INSTRUCTION}\n\nThe following are given documents.\n\n{body}"


def qa(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, dataset: str, task: str) -> Sample:
    pool, documents = questions(dataset)
    rng = random.Random(f"{task}-{seed}")
    chosen = pool[rng.randrange(len(pool))]
    question = f"{INSTRUCTION}\n\nQuestion: {chosen.question} Answer:"
    picked = list(chosen.documents)
    budget = length - prompt_tokens(tokenizer, _context([documents[i] for i in picked]), question)
    if budget < 0:
        raise ValueError(
            f"{task}: length={length} is too short for the documents that answer question {chosen.question!r}"
        )
    related = list(chosen.related)
    rng.shuffle(related)
    distractors = (rng.randrange(len(documents)) for _ in range(len(documents)))  # random ones, drawn lazily
    for index in itertools.chain(related, distractors):
        if index in picked:
            continue
        cost = token_len(tokenizer, f"Document {len(picked) + 1}:\n{documents[index]}\n\n")
        if cost > budget:  # the first distractor that does not fit is cut to what is left
            filler_ids = tokenizer(documents[index], add_special_tokens=False)["input_ids"]
            break
        picked.append(index)
        budget -= cost
    rng.shuffle(picked)
    texts = [documents[i] for i in picked]
    slot, keep = rng.randrange(len(texts) + 1), len(filler_ids)
    for _ in range(4):
        filler = text_of(tokenizer, filler_ids[:keep]).strip()
        context = _context(texts[:slot] + ([filler] if filler else []) + texts[slot:])
        over = prompt_tokens(tokenizer, context, question) - length
        if -8 <= over <= 0 or keep == 0:
            break
        keep = max(0, keep - over - 4)
    held = set(picked)
    others = [q for q in pool if q is not chosen and set(q.documents) <= held][:PROBES]
    probes = [Turn(f"{INSTRUCTION}\n\nQuestion: {q.question} Answer:", list(q.answers)) for q in others]
    return Sample(
        f"{task}-{length}-{seed}",
        task,
        length,
        context,
        [Turn(question, list(chosen.answers))],
        metric="match_part",
        max_new_tokens=32,
        probes=probes,
    )


def qa_squad(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int) -> Sample:
    return qa(tokenizer, length, depth, seed, "squad", "qa_1")


def qa_hotpot(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int) -> Sample:
    return qa(tokenizer, length, depth, seed, "hotpotqa", "qa_2")
