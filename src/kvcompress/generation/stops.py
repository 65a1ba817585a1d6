"""Stop strings: an answer ends where its text first holds one of them (``generate(stop="\\n")``).

A base model (no chat template, e.g. the embedded Gemma 3 270M) answers and goes on with the next line of the
document it imagines; it rarely says its end token. A stop string ends the answer there, as OpenAI's ``stop`` and
transformers' ``stop_strings`` do. Each row's text is decoded whole on the host after every step (one read from the
device per step, only when stop strings are given), so a string that spans tokens is found. A stopped row ends as
an answer cut by ``max_new_tokens`` does: its tokens run to the one that completed the string, that token unfed
(``pending``: a follow-up feeds it first), and its text ends before the string. A stream shows an answer only as
far as no stop string could begin (``showable``), so it never shows a string's first tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from ..methods.fields import InvalidParameterError


def text_of(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of one sequence of token ids (transformers types ``decode`` as a batch's too)."""
    return cast(str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


@dataclass
class Stops:
    """The stop strings of one ``generate`` call and, per row, the step whose token completed one."""

    strings: tuple[str, ...]
    tokenizer: PreTrainedTokenizerBase
    hit: dict[int, int] = field(default_factory=dict)  # row -> the column of ``produced`` that completed a string

    @classmethod
    def of(cls, stop: str | list[str] | None, tokenizer: PreTrainedTokenizerBase) -> Stops | None:
        """The stop strings ``stop`` gives (None: none), each refused in one line unless a non-empty string."""
        if stop is None:
            return None
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(s, str) and s for s in strings):
            raise InvalidParameterError(
                "{stop=} is invalid; give a non-empty string, a list of them, or None",
                stop=stop,
                cli="--stop '' is invalid; give a non-empty string (repeat --stop for several)",
            )
        return cls(tuple(strings), tokenizer)

    def watch(self, finished: torch.Tensor, produced: torch.Tensor, column: int) -> None:
        """After the step that produced column ``column`` of ``produced [b, steps]``: each running row (``finished
        [b]`` False) whose text now holds a string is marked finished."""
        running = (~finished).nonzero().flatten().tolist()
        if not running:
            return
        for row, tokens in zip(running, produced[running, : column + 1].tolist()):
            if self.cut(text_of(self.tokenizer, tokens, skip_special_tokens=True)) is not None:
                self.hit[row] = column
                finished[row] = True

    def cut(self, text: str) -> str | None:
        """``text`` before the first stop string in it; None where it holds none."""
        found = [text.index(s) for s in self.strings if s in text]
        return text[: min(found)] if found else None

    def showable(self, text: str) -> str:
        """As much of an answer's ``text`` so far as a stream may show: before its first stop string, or, where it
        holds none yet, before its longest end that a stop string begins with (the next tokens may complete it)."""
        cut = self.cut(text)
        if cut is not None:
            return cut
        undecided = max((size for s in self.strings for size in range(1, len(s)) if text.endswith(s[:size])), default=0)
        return text[: len(text) - undecided]

    def ended(self, text: str) -> str:
        """An answer's text as returned: before its first stop string."""
        cut = self.cut(text)
        return text if cut is None else cut
