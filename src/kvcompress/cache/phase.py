"""The phase a cache layer is in: one value, its transitions in one table, an illegal one a named error.

A layer's prompt comes in (``PROMPT``: one forward, blocks of a long prompt, or over a stored context), the method
compresses it, and each later step appends (``DECODING``). Two detours: a method that compresses after an
observation pass (KVzip) holds the whole prompt until the pass has run (``AWAITING_PASS``, then ``OBSERVING``), and
a sliding-window layer continuing a stored window takes the rest of its prompt as a later step (``CONTINUING``).
"""

from __future__ import annotations

import enum

from .errors import CacheMisuseError


class Phase(enum.Enum):
    """Where a layer is between its first token and its last step."""

    EMPTY = "empty (nothing held yet)"
    PROMPT = "prompt (coming in, in blocks)"
    AWAITING_PASS = "awaiting its observation pass (the prompt held, compression waits)"
    OBSERVING = "observing (the observation pass runs over the held prompt)"
    CONTINUING = "continuing a stored window (the next step ends its prompt)"
    DECODING = "decoding (compressed; each step appends)"

    @property
    def taking_prompt(self) -> bool:
        """The prompt is coming in (not compressed yet): ``EMPTY`` or ``PROMPT``."""
        return self in (Phase.EMPTY, Phase.PROMPT)


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.EMPTY: frozenset({Phase.PROMPT, Phase.AWAITING_PASS, Phase.CONTINUING, Phase.DECODING}),
    Phase.PROMPT: frozenset({Phase.AWAITING_PASS, Phase.DECODING}),
    Phase.AWAITING_PASS: frozenset({Phase.OBSERVING, Phase.DECODING}),  # a pass with no step: the method says so
    Phase.OBSERVING: frozenset({Phase.DECODING}),
    Phase.CONTINUING: frozenset({Phase.DECODING}),
    Phase.DECODING: frozenset(),
}


class PhaseError(CacheMisuseError):
    """A layer was asked for a step its phase does not allow (e.g. a second prompt on a used cache)."""


def moved(layer_idx: int, current: Phase, wanted: Phase, why: str) -> Phase:
    """``wanted``, if a layer in ``current`` may go there (``TRANSITIONS``); otherwise a ``PhaseError`` naming both
    phases and ``why`` the move was asked for."""
    if wanted not in TRANSITIONS[current]:
        raise PhaseError(f"kvcompress: layer {layer_idx} cannot go from {current.value} to {wanted.value} ({why})")
    return wanted
