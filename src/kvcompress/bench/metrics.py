"""Scores: per-sample answer matching (RULER's string-match-all, LongBench-style F1) and fidelity to
the full cache (top-1 agreement and KL divergence over a teacher-forced continuation)."""

from __future__ import annotations

import random
import re
import string
from collections import Counter

import torch


def string_match_all(prediction: str, answers: list[str]) -> float:
    """Fraction of ``answers`` that appear in ``prediction`` (case-insensitive); RULER's metric."""
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def string_match_any(prediction: str, answers: list[str]) -> float:
    """1.0 if any answer appears in ``prediction`` (case-insensitive)."""
    text = prediction.lower()
    return float(any(answer.lower() in text for answer in answers))


def _normalize(text: str) -> list[str]:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1(prediction: str, answers: list[str]) -> float:
    """Best token-level F1 between ``prediction`` and any answer (articles and punctuation ignored)."""
    best = 0.0
    predicted = _normalize(prediction)
    for answer in answers:
        truth = _normalize(answer)
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


METRICS = {"match_all": string_match_all, "match_part": string_match_any, "f1": f1}


def score(prediction: str, answers: list[str], metric: str) -> float:
    """The sample's score: RULER's string-match-all (needles), string-match-part (QA: any answer), or F1."""
    return METRICS[metric](prediction, answers)


def fidelity(reference_logprobs: torch.Tensor, logprobs: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || method) over steps; both ``[steps, vocab]`` log-probs."""
    top1 = (reference_logprobs.argmax(-1) == logprobs.argmax(-1)).float().mean()
    kl = (reference_logprobs.exp() * (reference_logprobs - logprobs)).sum(-1).clamp(min=0).mean()
    return {"top1_agreement": float(top1), "kl": float(kl)}


def bootstrap_interval(values: list[float], draws: int = 2000, seed: int = 0) -> list[float]:
    """The 2.5th and 97.5th percentiles of the mean of ``values`` resampled with replacement ``draws`` times."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(draws))
    return [means[int(0.025 * draws)], means[int(0.975 * draws) - 1]]
