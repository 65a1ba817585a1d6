"""Agreement with the full cache over a stored context (issue 67): the full cache's own answers to questions asked
over a context stored whole, each with its teacher-forced log-probabilities (``FullAnswers``), and how closely a
method follows them when the same answer is teacher-forced under it (``agreement``: top-1 agreement and mean KL per
question, ``metrics.fidelity``). Both the shared-context track and the question-agnostic accuracy track use it."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..generation.generate import forced_logprobs, generate
from ..generation.result import Result
from ..methods import FullKV, Method
from .metrics import fidelity

MODES = ("multi-request", "multi-turn")


class FullAnswers:
    """The full cache's answers to questions over a stored context, in each mode (``multi-request``: each question
    on its own, the first ``requests`` of them; ``multi-turn``: one conversation, each turn asked over the full
    cache's conversation so far), with their teacher-forced log-probabilities. Computed on first need, once."""

    def __init__(
        self,
        model: PreTrainedModel,
        tok: PreTrainedTokenizerBase,
        store: Result,
        questions: list[str],
        max_new_tokens: int,
        requests: int | None = None,
    ) -> None:
        self.model, self.tok, self.store = model, tok, store
        self.questions, self.max_new_tokens = questions, max_new_tokens
        self.requests = len(questions) if requests is None else requests
        self.turns: dict[str, list[tuple[Result, list[int], Any]]] = {}

    def of(self, mode: str) -> list[tuple[Result, list[int], Any]]:
        """Per question: the context or conversation it is asked over, the full cache's answer's tokens and their
        log-probs."""
        if mode not in self.turns:
            turns, past = [], self.store
            for question in self.questions[: None if mode == "multi-turn" else self.requests]:
                answer = generate(
                    self.model, self.tok, question, past=past, method=FullKV(), max_new_tokens=self.max_new_tokens
                )
                tokens = answer.token_ids[0] or [self.tok.eos_token_id]
                reference = forced_logprobs(self.model, self.tok, tokens, prompt=question, past=past, method=FullKV())
                turns.append((past, tokens, reference))
                past = answer if mode == "multi-turn" else self.store
            self.turns[mode] = turns
        return self.turns[mode]


def agreement(
    full: FullAnswers, method: Method | None, mode: str = "multi-request", context: Result | None = None
) -> list[dict[str, float]]:
    """Per question, the full cache's answer teacher-forced under ``method``, each question compressed with it over
    the same context or conversation (or over ``context``, e.g. a thinned store), or, with ``method=None``, appended
    to a copy of ``context`` (compressed before any question): top-1 agreement and mean KL from the full cache's
    next-token distributions."""
    found = []
    for (past, tokens, reference), question in zip(full.of(mode), full.questions):
        over = past if context is None else context
        if method is None:  # appended: a follow-up writes to the cache it continues
            over = over.copy()
        forced = forced_logprobs(full.model, full.tok, tokens, prompt=question, method=method, past=over)
        found.append(fidelity(reference, forced))
    return found
