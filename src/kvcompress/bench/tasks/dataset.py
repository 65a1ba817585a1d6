"""Bring your own data: a JSONL file with LongBench's field names ``context``, ``input`` (the question)
and ``answers`` (a list), scored with string match and F1."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .base import Sample, Turn, prompt_tokens


def load_dataset(path: str | Path, tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[Sample]:
    path = Path(path)
    samples = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        record = json.loads(line)
        missing = [k for k in ("context", "input", "answers") if k not in record]
        if missing:
            raise ValueError(
                f"{path}:{i + 1}: missing field(s) {', '.join(missing)}; each line needs context, input and answers"
            )
        answers = record["answers"] if isinstance(record["answers"], list) else [record["answers"]]
        length = prompt_tokens(tokenizer, record["context"], record["input"])
        samples.append(
            Sample(
                f"{path.stem}-{i}",
                path.stem,
                length,
                record["context"],
                [Turn(record["input"], [str(a) for a in answers])],
                metric="f1",
                max_new_tokens=64,
            )
        )
        if limit is not None and len(samples) >= limit:
            break
    return samples
