"""What a task sample is, and fitting a prompt to a token length."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ...generation.conversation import Prompt, as_asked, render, user_prompt
from ..haystack import fill, token_len

ADJECTIVES = (
    "amber",
    "ancient",
    "bitter",
    "brave",
    "calm",
    "clever",
    "crimson",
    "curious",
    "damp",
    "eager",
    "faint",
    "fierce",
    "gentle",
    "golden",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "keen",
    "lively",
    "lucky",
    "misty",
    "noble",
    "olive",
    "proud",
    "quiet",
    "rapid",
    "rusty",
    "silent",
    "silver",
    "sleepy",
    "sturdy",
    "tidy",
    "vivid",
    "wild",
    "witty",
)
NOUNS = (
    "anchor",
    "badger",
    "beacon",
    "canyon",
    "castle",
    "cedar",
    "comet",
    "copper",
    "dragon",
    "falcon",
    "garden",
    "glacier",
    "harbor",
    "island",
    "lantern",
    "meadow",
    "mirror",
    "nebula",
    "orchard",
    "otter",
    "pebble",
    "piano",
    "quarry",
    "raven",
    "river",
    "saddle",
    "shadow",
    "spruce",
    "thunder",
    "tower",
    "valley",
    "violin",
    "walnut",
    "willow",
)


@dataclass
class Turn:
    question: str
    answers: list[str]


@dataclass
class Sample:
    """One prompt: ``context`` then ``turns[0].question`` in one user message; later turns are
    follow-up questions over the same cache. Scored per turn with ``metric``. ``probes`` are
    questions on the same context that only the question-agnostic track asks."""

    id: str
    task: str
    length: int  # target prompt length in the model's tokens
    context: str
    turns: list[Turn]
    depth: float | None = None
    metric: str = "match_all"  # RULER's string-match-all; "f1" for bring-your-own datasets
    max_new_tokens: int = 24
    info: dict = field(default_factory=dict)  # haystack_start: characters of instructions before the haystack
    probes: list[Turn] = field(default_factory=list)  # more questions on the context, for the question-agnostic track

    def questions(self) -> list[Turn]:
        """Every question the context answers, each asked on its own by the question-agnostic track
        (RULER's multi-query: one compressed context, several questions)."""
        return self.turns + self.probes

    def prompt(self, tokenizer: PreTrainedTokenizerBase) -> Prompt:
        """The context and first question as one prompt: the user's message, or plain text for a base model."""
        return asked_prompt(tokenizer, self.context, self.turns[0].question)


def asked_prompt(tokenizer: PreTrainedTokenizerBase, context: str, question: str) -> Prompt:
    """``context`` then ``question`` as one prompt: one user message (chat), or plain text with the question cued
    (``conversation.as_asked``: a base model)."""
    return user_prompt(tokenizer, f"{context}\n\n{as_asked(tokenizer, question)}")


def prompt_tokens(tokenizer: PreTrainedTokenizerBase, context: str, question: str) -> int:
    """Tokens of the whole prompt (chat template included, where the tokenizer has one)."""
    prompt = asked_prompt(tokenizer, context, question)
    if isinstance(prompt, str):
        return token_len(tokenizer, prompt)
    return token_len(tokenizer, render(tokenizer, prompt))


def fit_haystack(
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    question: str,
    inserts: list[tuple[float, str]],
    kind: str = "prose",
    seed: int | None = None,
    prefix: str = "",
) -> str:
    """A context (``prefix`` + haystack with ``inserts``) whose rendered prompt has about ``length`` tokens."""
    fixed = prompt_tokens(tokenizer, prefix + " ".join(text for _, text in inserts), question)
    context = prefix + fill(tokenizer, max(0, length - fixed), inserts, kind, seed)
    overshoot = prompt_tokens(tokenizer, context, question) - length
    if overshoot > 0:  # sentence joins can add a few tokens; trim the haystack once more
        context = prefix + fill(tokenizer, max(0, length - fixed - overshoot), inserts, kind, seed)
    return context


def key_name(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def distinct_keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = key_name(rng)
        if key not in keys:
            keys.append(key)
    return keys


def number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))
