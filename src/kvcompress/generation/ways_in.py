"""Generation's ways in, one object each, as the cache's intakes are one floor down: a new prompt (``NewPrompt``), a
follow-up over a result whose cache it continues (``FollowUp``), a question over a stored context, or a conversation's
next turn over its store, compressed per question (``StoredQuestion``), and a recorded prefill (``RecordedPrefill``).
``way_in`` checks what the arguments say and picks one; its ``start`` says where the generation starts (``Start``):
the cache, the rows, what is left to feed."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.errors import CacheMisuseError
from ..cache.kv_cache import KVCompressCache
from ..methods import FullKV, InvalidParameterError, Method, method_from_name
from .conversation import (
    ChatLeads,
    Given,
    Lead,
    Prompt,
    after_context,
    ask,
    context_ids,
    follow_up,
    joined_spans,
    new_rows,
    per_row,
)
from .feed import Feeder, Prefill, empty_state, observe_prompts, pad_id
from .result import Result, Row


@dataclass
class Start:
    """Where a generation starts: its cache (None for a new prompt: ``make_cache`` makes it, per group
    of rows), conversations, what is left to feed, and the state."""

    cache: KVCompressCache | None
    rows: list[Row]
    is_batch: bool
    chunk_lists: list[list[list[int]]]
    mask: torch.Tensor
    position: torch.Tensor
    logits: torch.Tensor | None = None  # known already (a prefill record)
    prefill_s: float = 0.0  # spent before (a shared prefill)
    make_cache: Callable[[], KVCompressCache] | None = None
    lead: Lead | None = None  # addresses the rows in the method's observation pass over a new prompt (ChatLeads)
    context: KVCompressCache | None = None  # a stored context the prompt continues (read, never written)
    store: Result | None = None  # the conversation's stored context (``Result.store``), passed on to its result


def resolve_method(method: Method | str | None) -> Method:
    if method is None:
        return FullKV()
    if isinstance(method, str):
        return method_from_name(method)
    if not isinstance(method, Method):
        raise InvalidParameterError(
            "{method=} is invalid; give a kvcompress method (e.g. kvcompress.SnapKV()) or its name", method=method
        )
    return method


def check_per_question(method: Method) -> None:
    """Refuse, in one line, a method that cannot compress a question over a stored context (it scores a prompt by
    an observation pass of its own before any question)."""
    if method.observation() is not None:
        raise InvalidParameterError(
            f"{method.describe()} scores a prompt by an observation pass before its question, which a question over a "
            "stored context does not need: compress per question with a question-aware method (snapkv, h2o, "
            "streamingllm, expected)"
        )


def _over_context(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: Given, method: Method, past: Result
) -> Start:
    """Questions over a stored context, each prefilled over the context's tokens (read, never written)
    and compressed with them by ``method``: one question per row of ``past``, or a list of questions over
    its one row (a batch, each row its own selection)."""
    check_per_question(method)
    if not all(row.open_turn for row in past.rows):
        raise InvalidParameterError(
            "method= compresses a question over a stored context (kvc.compress(...)), and this conversation is not one "
            "waiting for its question; continue it with method=None (its cache keeps its method)",
            cli="--method compresses a question over a stored context (a file `kvcompress compress` wrote), and this "
            "file holds a conversation that is not waiting for its question; leave --method out to continue it (its "
            "cache keeps its method)",
        )
    if not past.cache.storable():
        kept = (
            f"this context was compressed with {past.cache.method.describe()}, which does not keep its prompt's "
            "tokens in a form a question can be prefilled over"
        )
        raise InvalidParameterError(
            f"{kept}; store it with kvc.compress(..., method=kvc.FullKV()) (or a prompt method with heads='uniform' "
            "and layers='uniform', which thins it) to compress per question, or continue it with method=None",
            cli=f"{kept}; to compress each question with --method, store the document with `kvcompress compress "
            "--method full` (or a prompt method with --heads uniform --layers uniform, which thins it); or leave "
            "--method out to ask this file with the method it was compressed with",
        )
    stored = len(past.rows)
    given: Sequence[object]
    if isinstance(prompt, list) and stored == 1:  # a list of questions over the context's one row
        given, index = prompt, [0] * len(prompt)
    else:
        given, index = per_row(prompt, stored, "prompt"), list(range(stored))
    questions = [q for q in given if isinstance(q, str) and q.strip()]
    if not given or len(questions) != len(given):
        raise InvalidParameterError(
            "give each question over a stored context as a non-empty string (a list of them for a batch)"
        )
    contexts = {i: context_ids(tokenizer, past.rows[i]) for i in set(index)}
    rows = [copy.deepcopy(past.rows[i]) for i in index]
    asked = [ask(tokenizer, row, question, contexts[i]) for row, question, i in zip(rows, questions, index)]
    for row, i in zip(rows, index):
        row.store_row = i
    return _asked_over(model, tokenizer, method, past, rows, asked, contexts, len(rows) > 1 or isinstance(prompt, list))


def _over_conversation(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: Given, method: Method, past: Result
) -> Start:
    """A follow-up compressed per question: everything said after the stored context (each earlier question
    and answer, as the whole conversation's prompt would tokenize them) and the new message are prefilled over
    the store, read and never written, and compressed by ``method`` with them: question-aware compression of
    the whole conversation so far. A turn's cost grows with the conversation after the document, not with it."""
    store = past.store
    assert store is not None
    rows = [copy.deepcopy(row) for row in past.rows]
    contexts = {_store_row(row): context_ids(tokenizer, store.rows[_store_row(row)]) for row in rows}
    asked = []
    for row, text in zip(rows, _follow_ups(prompt, len(rows))):
        follow_up(tokenizer, row, text)
        asked.append(after_context(tokenizer, row, contexts[_store_row(row)]))
    return _asked_over(model, tokenizer, method, store, rows, asked, contexts, len(rows) > 1)


def _follow_ups(prompt: Given, rows: int) -> list[str]:
    """Each row's next message of a conversation, refused in one line unless a non-empty string."""
    texts = per_row(prompt, rows, "prompt")
    messages = [text for text in texts if isinstance(text, str) and text.strip()]
    if len(messages) != len(texts):
        raise InvalidParameterError("give each follow-up as a non-empty string (a list of them for a batch)")
    return messages


def _store_row(row: Row) -> int:
    """The row of its conversation's store ``row`` continues (a conversation over a store has one per row)."""
    if row.store_row is None:
        raise CacheMisuseError("kvcompress: a turn over a stored context lost the row of the store it continues")
    return row.store_row


def _asked_over(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    method: Method,
    store: Result,
    rows: list[Row],
    asked: list[list[int]],
    contexts: dict[int, list[int]],
    is_batch: bool,
) -> Start:
    """A fresh cache of ``method`` whose prompt continues rows ``row.store_row`` of ``store`` with each row's
    ``asked`` tokens (right-aligned), to be compressed with them."""
    index = [_store_row(row) for row in rows]
    width = max(len(ids) for ids in asked)
    chosen = torch.tensor(index, device=model.device)
    cache = method.make_cache(model, tokenizer)
    spans = joined_spans(
        cache.span_table, [contexts[i] + ids for i, ids in zip(index, asked)], store.attention_mask.shape[-1] + width
    )
    cache.continue_context(
        store.cache, chosen, [width - len(ids) for ids in asked], None if spans is None else spans.to(model.device)
    )
    return Start(
        cache,
        rows,
        is_batch,
        [[ids] for ids in asked],
        store.attention_mask[chosen],
        store.next_position[chosen],
        context=store.cache,
        store=store,
    )


def from_prefill(model: PreTrainedModel, method: Method, record: Prefill) -> KVCompressCache:
    cache = method.make_cache(model, record.tokenizer)
    for layer, recorded in zip(cache.layers, record.cache.layers):
        layer.load_prefill(recorded)
    feeder = Feeder(model, cache, record.attention_mask, record.next_position, pad_id(record.tokenizer))
    observe_prompts(feeder, record.prompts, ChatLeads(record.tokenizer, record.rows))
    return cache


class WayIn:
    """A way into a generation: where it starts, once the model and tokenizer are known, and the method whose cache
    it decodes with (``method``)."""

    method: Method

    def start(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Start:
        raise NotImplementedError


@dataclass
class NewPrompt(WayIn):
    """A new prompt (``question``: compressed without it first, then asked), its cache made per group of rows."""

    prompt: Prompt | list[Prompt]
    question: str | list[str] | None
    method: Method

    def start(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Start:
        rows, chunk_lists, is_batch, opened = new_rows(tokenizer, self.prompt, self.question)
        return Start(
            None,
            rows,
            is_batch,
            chunk_lists,
            *empty_state(model, len(rows)),
            make_cache=lambda: self.method.make_cache(model, tokenizer),
            lead=ChatLeads(tokenizer, opened),
        )


@dataclass
class FollowUp(WayIn):
    """The next message of a conversation, appended to its cache (the method that built the cache goes on)."""

    past: Result
    prompt: Given
    method: Method  # (the cache's own)

    def start(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Start:
        past = self.past
        if past.cache.get_seq_length() != past.attention_mask.shape[-1]:
            raise CacheMisuseError(
                "kvcompress: this conversation was already continued by another generate(past=...) call, which "
                "appended to its cache; ask each question of its own copy (past=context.copy()), or continue the "
                "Result that call returned"
            )
        texts = _follow_ups(self.prompt, len(past.rows))
        chunk_lists = [[follow_up(tokenizer, row, text)] for row, text in zip(past.rows, texts)]
        if past.cache.device_of() not in (None, model.device):  # a context stored in host memory, continued as it is
            past.cache.move(model.device)
        return Start(
            past.cache,
            past.rows,
            len(past.rows) > 1,
            chunk_lists,
            past.attention_mask,
            past.next_position,
            store=past.store,
        )


@dataclass
class StoredQuestion(WayIn):
    """A question over a stored context, or a conversation's next turn over its store: prefilled over the store (read,
    never written) with everything said after it, and compressed by ``method`` with them."""

    past: Result
    prompt: Given
    method: Method

    def start(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Start:
        over = _over_conversation if self.past.store is not None else _over_context
        return over(model, tokenizer, self.prompt, self.method, self.past)


@dataclass
class RecordedPrefill(WayIn):
    """A prompt prefilled once (``Prefill``), compressed by ``method`` as a fresh prefill would be."""

    record: Prefill
    method: Method

    def start(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Start:
        record = self.record
        return Start(
            from_prefill(model, self.method, record),
            copy.deepcopy(record.rows),
            record.is_batch,
            [],
            record.attention_mask,
            record.next_position,
            record.logits,
            record.prefill_s,
        )


def way_in(
    model: PreTrainedModel,
    prompt: Prompt | list[Prompt] | None,
    method: Method | str | None,
    question: str | list[str] | None,
    past: Result | None,
    record: Prefill | None,
) -> WayIn:
    """Which way in ``generate``'s arguments name, each refused in one line where they do not fit: with ``past``, a
    question compressed per question over its store (with a method, or over a whole stored context of the full cache
    asked as it is: the answer appending would give, the store kept for the next question) or a follow-up appended
    to its cache; with ``record``, its prefill; else a new prompt."""
    if past is not None:
        past.cache.check_model(
            model, "continue a conversation with the model that began it (or kvc.load it for this one)"
        )
        if question is not None:
            raise InvalidParameterError("with past=, give the question as prompt (question= splits a new prompt)")
        if method is not None:
            return StoredQuestion(past, prompt, resolve_method(method))
        if all(row.open_turn for row in past.rows) and type(past.cache.method) is FullKV and past.cache.storable():
            return StoredQuestion(past, prompt, past.method)
        return FollowUp(past, prompt, past.method)
    if record is not None:
        record.cache.check_model(model, "use a prefill record with the model that prefilled it")
        if prompt is not None or question is not None:
            raise InvalidParameterError("give either prompt (and question) or prefill, not both")
        return RecordedPrefill(record, resolve_method(method))
    if prompt is None:
        raise InvalidParameterError("give a prompt (or prefill=, or past=)")
    return NewPrompt(prompt, question, resolve_method(method))
