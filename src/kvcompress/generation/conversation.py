"""A conversation's tokens: how a prompt becomes token ids, as the model's chat template says, for every way a
generation starts or goes on, apart from the generation loop (generate.py).

A prompt is raw text or chat messages (``render``: the template); a batch is a list of them (``prompt_rows``). A
context whose question comes later is tokenized as every joined prompt starts (``context_ids``: the longest prefix
the context alone and its joined prompts with very different questions share), so asking it (``ask``) gives the
question-aware prompt's tokens; a finished turn goes on with a new user message (``follow_up``); a question over a
stored context gets its joined prompt's word spans (``joined_spans``). An observation pass addresses the rows through
a ``Lead`` (``ChatLeads``: as the context's question would be asked).
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from ..cache.tokens import TokenSpans
from ..methods import InvalidParameterError
from .result import Row
from .stops import text_of

Messages = list[dict[str, str]]


Prompt = str | Messages
Given = Prompt | list[Prompt] | None  # a prompt argument as a caller gives it (a batch: a list; None: none)


def as_rows(prompt: Prompt | list[Prompt]) -> tuple[list[Prompt], bool]:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
        return [prompt], False
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return cast(list[Prompt], list(prompt)), True
    raise TypeError(
        "prompt must be a string, a list of chat messages ({'role', 'content'} dicts), "
        f"or a non-empty list of those for a batch; got {type(prompt).__name__}"
    )


def prompt_rows(prompt: Prompt | list[Prompt]) -> tuple[list[Prompt], bool]:
    """Each row's prompt and whether a batch (``as_rows``); an empty prompt (no text of its own: a
    chat template alone is no prompt) is refused."""
    prompts, is_batch = as_rows(prompt)
    for i, row in enumerate(prompts):
        text = row if isinstance(row, str) else "".join(str(m.get("content") or "") for m in row)
        if not text.strip():
            raise InvalidParameterError(
                f"prompt {i} is empty: it has no tokens of its own (give some text; a chat template alone is not a "
                "prompt)"
            )
    return prompts, is_batch


def per_row(value: Given | list[str], n: int, name: str) -> list[Prompt | None]:
    if value is None or isinstance(value, str):
        return [value] * n
    if len(value) != n:
        raise InvalidParameterError(f"{name} has {len(value)} entries for a batch of {n} prompts")
    return cast(list[Prompt | None], list(value))


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> str:
    return cast(str, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def user_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> Prompt:
    """``text`` as a user's message where the tokenizer has a chat template; as plain text where it has none (a base
    model, e.g. Gemma 3 270M, whose questions ``as_asked`` cues)."""
    return [{"role": "user", "content": text}] if tokenizer.chat_template else text


def as_asked(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    """A question as a user asks it: itself in a chat; in plain text ``Question: ...`` and an ``Answer:`` cue on a
    line of its own (a base model continues text: the cue is what makes its next tokens the answer)."""
    return question if tokenizer.chat_template else f"\nQuestion: {question}\nAnswer:"


CHAT_SEPARATOR, RAW_SEPARATOR = "\n\n", "\n"  # what joins a context and its question (chat message / raw text)


# Questions that begin as differently as questions can: the context's tokens are those every joined
# prompt starts with (a byte-level BPE ends "doc.\n\n" with one "\n\n" token but splits it before a word).
PROBES = ("Q", "1", "?", " q", "\n", "\u00e9")


def first_turn(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, question: str | None
) -> tuple[Row, list[list[int]], Row]:
    """A new conversation, its token chunks (``[prompt]``, or ``[context, question]``: the context
    compressed without the question, which is then appended, see ``context_turn`` and ``ask``), and
    the row as its first chunk leaves it (what introduces an observation pass: ``ChatLeads``)."""
    if question is not None:
        row, context = context_turn(tokenizer, prompt)
        opened = copy.deepcopy(row)
        return row, [context, ask(tokenizer, row, question, context)], opened
    if isinstance(prompt, str):
        row = Row(chat=False, transcript=prompt)
        return row, [tokenizer(prompt, add_special_tokens=True)["input_ids"]], row
    messages = [dict(m) for m in prompt]
    text = render(tokenizer, messages)
    row = Row(chat=True, messages=messages, transcript=text)
    return row, [tokenizer(text, add_special_tokens=False)["input_ids"]], row


def joined_ids(tokenizer: PreTrainedTokenizerBase, row: Row, question: str | None) -> tuple[list[int], str]:
    """Tokens of the prompt an open turn becomes with ``question`` (as ``generate`` would tokenize
    that prompt whole; None: the context alone, no separator), and its text."""
    tail = "" if question is None else (CHAT_SEPARATOR if row.chat else RAW_SEPARATOR) + question
    if not row.chat:
        text = row.transcript + tail
        return tokenizer(text, add_special_tokens=True)["input_ids"], text
    messages = [*row.messages[:-1], {**row.messages[-1], "content": row.messages[-1]["content"] + tail}]
    text = render(tokenizer, messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"], text


def context_ids(tokenizer: PreTrainedTokenizerBase, row: Row) -> list[int]:
    """The tokens of an open turn's context: the longest prefix that the context alone and its joined
    prompts with very different questions (``PROBES``) share. So the separator goes with the question,
    whose tokens are what follows in the joined prompt: asking gives the question-aware prompt's tokens."""
    probes = [joined_ids(tokenizer, row, probe)[0] for probe in (None, *PROBES)]
    return probes[0][: shared_prefix(probes)]


def shared_prefix(token_lists: list[list[int]]) -> int:
    """The length of the longest prefix every list starts with."""
    shared = 0
    while all(len(ids) > shared and ids[shared] == token_lists[0][shared] for ids in token_lists):
        shared += 1
    return shared


def context_turn(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> tuple[Row, list[int]]:
    """A context whose question comes later: a raw text, or a chat whose last user message the
    question will be appended to (the turn stays open); its tokens (``context_ids``)."""
    row = (
        Row(chat=False, transcript=prompt, open_turn=True)
        if isinstance(prompt, str)
        else Row(chat=True, messages=[dict(m) for m in prompt], open_turn=True)
    )
    context = context_ids(tokenizer, row)
    if row.chat:
        row.transcript = text_of(tokenizer, context)
    return row, context


def ask(tokenizer: PreTrainedTokenizerBase, row: Row, question: str, context: list[int] | None = None) -> list[int]:
    """Tokens that close an open turn with its question (and, for a chat, the assistant's prompt):
    what follows the context's tokens (``context_ids``, unless given) in the joined prompt's own tokens."""
    context = context_ids(tokenizer, row) if context is None else context
    ids, text = joined_ids(tokenizer, row, question)
    if ids[: len(context)] != context:
        raise ValueError(
            f"question {question[:40]!r} changes how this tokenizer splits the end of its context; put text before it"
        )
    row.open_turn = False
    row.transcript = text
    if row.chat:
        row.messages[-1]["content"] += CHAT_SEPARATOR + question
    return ids[len(context) :]


def after_context(tokenizer: PreTrainedTokenizerBase, row: Row, context: list[int]) -> list[int]:
    """The tokens of the whole conversation ``row`` holds (its transcript, as a prompt of it would be tokenized)
    after its stored context's tokens ``context``: every question and answer since, and the newest message."""
    ids = tokenizer(row.transcript, add_special_tokens=not row.chat)["input_ids"]
    if ids[: len(context)] != context:
        raise ValueError(
            "this conversation changes how this tokenizer splits the end of its stored context; start "
            "the conversation with text after the context"
        )
    return ids[len(context) :]


def follow_up(tokenizer: PreTrainedTokenizerBase, row: Row, prompt: str) -> list[int]:
    """Tokens that continue a finished turn with a new user message (plus the unfed last token), or
    that ask an open turn's question."""
    if row.open_turn:
        return ask(tokenizer, row, prompt)
    answer = text_of(tokenizer, row.generated, skip_special_tokens=True)
    head = [row.pending] if row.pending is not None else []
    row.pending = None
    if not row.chat:
        row.transcript += answer + prompt
        return head + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    before = render(tokenizer, row.messages) + answer
    row.messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": prompt}]
    after = render(tokenizer, row.messages)
    if not after.startswith(before):
        raise ValueError(
            "this tokenizer's chat template re-renders earlier turns differently; follow-ups are unsupported"
        )
    row.transcript = after
    return head + tokenizer(after[len(before) :], add_special_tokens=False)["input_ids"]


class Lead:
    """How an observation pass addresses the rows of a batch: ``introduce`` gives the tokens that
    introduce a piece to a row (the instruction, then the tokens before the piece), ``opening`` how
    many tokens open a row's prompt before its text (a chat template's system prompt and first
    header, a BOS): the pass repeats only what follows them, the context, as the paper does."""

    def introduce(self, row: int, text: str, before: list[int]) -> list[int]:
        raise NotImplementedError

    def opening(self, row: int, ids: list[int]) -> int:
        return 0


class ChatLeads(Lead):
    """Observation pieces introduced as a user would: for a context waiting for its question, the
    instruction asked as that question would be (closing the turn; a chat's assistant then answers),
    otherwise the instruction as text after the prompt; the opening found as the context's tokens
    are, by probes (``shared_prefix``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rows: list[Row]) -> None:
        self.tokenizer, self.rows = tokenizer, rows

    def introduce(self, row: int, text: str, before: list[int]) -> list[int]:
        if self.rows[row].open_turn:
            return ask(self.tokenizer, copy.deepcopy(self.rows[row]), text) + before
        return self.tokenizer("\n\n" + text, add_special_tokens=False)["input_ids"] + before

    def opening(self, row: int, ids: list[int]) -> int:
        """The tokens ``ids`` shares with the same row whose first text is a probe instead."""
        kept = self.rows[row]
        if not kept.chat:
            return shared_prefix(
                [ids, *(self.tokenizer(probe, add_special_tokens=True)["input_ids"] for probe in PROBES[:2])]
            )
        renders = (
            render(self.tokenizer, [{**kept.messages[0], "content": probe}, *kept.messages[1:]]) for probe in PROBES[:2]
        )
        return shared_prefix([ids, *(self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in renders)])


def new_rows(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt | list[Prompt], question: str | list[str] | None
) -> tuple[list[Row], list[list[list[int]]], bool, list[Row]]:
    """Rows, token chunks, whether a batch, and each row as its first chunk leaves it (``first_turn``)."""
    prompts, is_batch = prompt_rows(prompt)
    questions = cast(list[str | None], per_row(question, len(prompts), "question"))  # (question's own type: text)
    turns = [first_turn(tokenizer, p, q) for p, q in zip(prompts, questions)]
    return [t[0] for t in turns], [t[1] for t in turns], is_batch, [t[2] for t in turns]


def joined_spans(spans: TokenSpans | None, prompts: list[list[int]], width: int) -> torch.Tensor | None:
    """Word spans ``[b, width]`` of each row's joined prompt (its context's tokens, then its question's), as
    that prompt alone has them, rows right-aligned (each padding slot its own span); None without a tokenizer."""
    if spans is None:
        return None
    rows = []
    for ids in prompts:
        lead = width - len(ids)
        rows.append(torch.cat([torch.arange(lead), spans.span_ids(torch.tensor([ids]))[0] + lead]))
    return torch.stack(rows)
