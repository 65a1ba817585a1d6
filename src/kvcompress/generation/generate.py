"""``kvcompress.generate``: the generation loop over a compressed cache, with timing and stats.

Prompts are fed as one or two chunks of tokens (conversation.py makes them): the whole prompt (question-aware
compression: the question sits at the end, inside SnapKV's observation window), or, with ``question=``, the context
first (compressed without seeing the question, as kvpress does) and then the question. A ``Result`` can be continued
with a follow-up turn (``past=result``) over the same cache, or asked a question compressed over it (a stored context).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.errors import CacheMisuseError
from ..cache.kv_cache import KVCompressCache
from ..methods import FullKV, InvalidParameterError, Method, method_from_name
from ..storage.cpu_kernels import ready_cpu_kernel
from ..storage.tensors import synced_clock
from .conversation import (
    ChatLeads,
    Lead,
    Prompt,
    after_context,
    ask,
    context_ids,
    context_turn,
    follow_up,
    joined_spans,
    new_rows,
    per_row,
    prompt_rows,
)
from .decode import Compile, Decoded, Sampling, greedy_decode
from .result import Result, Row

# padded prompt tokens one prefill forward takes at most: a larger batch is prefilled in groups of rows
PREFILL_TOKENS = 8192


class PromptTooLongError(ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


def _context_limit(model: PreTrainedModel) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def _check_lengths(model: PreTrainedModel, total: list[int], max_new_tokens: int) -> None:
    limit = _context_limit(model)
    if limit is None:
        return
    for i, n in enumerate(total):
        if n > limit:
            raise PromptTooLongError(
                f"prompt {i} has {n} tokens, longer than the model's context of {limit} tokens "
                "(max_position_embeddings); shorten it, kvcompress does not truncate prompts"
            )
        if n + max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it would run past the model's "
                f"context of {limit} tokens (max_position_embeddings); lower max_new_tokens to {limit - n} or less"
            )


class _Feeder:
    """Runs forward passes over the cache, keeping the 2-D mask and per-row positions in step."""

    def __init__(self, model: PreTrainedModel, cache: KVCompressCache, mask: torch.Tensor, position: torch.Tensor,
                 pad_id: int):
        self.model, self.cache, self.mask, self.position, self.pad_id = model, cache, mask, position, pad_id
        self.device = model.device

    def feed(self, chunks: list[list[int]], width: int | None = None) -> torch.Tensor:
        """Feed one token list per row (left-padded to a common length, at least ``width``); return the last logits
        ``[batch, vocab]``."""
        width = max(width or 0, max(len(c) for c in chunks))
        ids = torch.full((len(chunks), width), self.pad_id, dtype=torch.long)
        real = torch.zeros(len(chunks), width, dtype=torch.long)
        for i, chunk in enumerate(chunks):
            if chunk:
                ids[i, width - len(chunk) :] = torch.tensor(chunk)
                real[i, width - len(chunk) :] = 1
        return self.forward(ids.to(self.device), real.to(self.device))

    def forward(self, ids: torch.Tensor, real: torch.Tensor, every_position: bool = False) -> torch.Tensor:
        """Logits after the last fed token ``[batch, vocab]`` (or ``[batch, seq, vocab]`` for ``every_position``)."""
        positions = (self.position[:, None] + real.cumsum(-1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, real], dim=-1)
        self.position = self.position + real.sum(-1)
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=positions,
            **{self.cache.keyword: self.cache},
            use_cache=True,
            logits_to_keep=0 if every_position else 1,
        )
        return out.logits if every_position else out.logits[:, -1, :]

    def peek(self, chunks: list[list[int]]) -> None:
        """Feed tokens the cache attends but does not keep (an observation pass): mask and positions stay."""
        mask, position = self.mask, self.position
        self.feed(chunks)
        self.mask, self.position = mask, position


def observe_prompts(feeder: _Feeder, prompts: list[list[int]], lead: Lead | None, first: int = 0) -> None:
    """Run the observation pass of the cache's method over each row's prompt, if it has one (KVzip:
    the model asked to repeat the context, and the context as its answer), piece by piece, then let
    the cache compress. ``lead`` addresses the rows (``first``: the batch row of ``prompts[0]``)."""
    observation = feeder.cache.method.observation() if feeder.cache.observe_first else None
    if observation is None:
        return
    if lead is None:
        raise ValueError(
            f"{feeder.cache.method.describe()} compresses after an observation pass, whose instruction needs the "
            "tokenizer"
        )
    clock = time.perf_counter()
    openings = [lead.opening(first + row, ids) for row, ids in enumerate(prompts)]
    feeder.cache.begin_observation(torch.tensor(openings, device=feeder.device))
    size = observation.chunk
    texts = [ids[opening:] for opening, ids in zip(openings, prompts)]
    for start in range(0, max(len(t) for t in texts), size):
        pieces = []
        for row, ids in enumerate(texts):
            text = observation.first if start == 0 else observation.later
            before = ids[max(0, start - observation.overlap) : start]
            pieces.append(
                lead.introduce(first + row, text, before) + ids[start:start + size] if start < len(ids) else [])
        feeder.peek(pieces)
    feeder.cache.end_observation(synced_clock(feeder.device) - clock)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


@dataclass
class Prefill:
    """A prompt prefilled once with the full cache. ``generate(..., prefill=p)`` derives any method's
    cache from it: every method attends to the full prompt during prefill and compresses each layer
    from its keys, values and last queries, so this gives exactly what a fresh prefill would."""

    rows: list[Row]
    is_batch: bool
    cache: KVCompressCache  # an uncompressed cache that kept each layer's last prefill queries (and the prompt's spans)
    logits: torch.Tensor
    attention_mask: torch.Tensor
    next_position: torch.Tensor
    prefill_s: float
    tokenizer: PreTrainedTokenizerBase
    prompts: list[list[int]]  # each row's prompt tokens (for a method's observation pass)


def _feed_chunks(feeder: _Feeder, chunk_lists: list[list[list[int]]],
                 logits: torch.Tensor | None = None) -> torch.Tensor | None:
    """Feed each row's chunks, one step per chunk; the last logits (``logits`` when nothing is left)."""
    for step in range(max(len(c) for c in chunk_lists)):
        logits = feeder.feed([chunks[step] if step < len(chunks) else [] for chunks in chunk_lists])
    return logits


def prefill_groups(
    model: PreTrainedModel, make_cache: Callable[[], KVCompressCache], prompts: list[list[int]], pad_id: int,
    prefill_tokens: int | None, lead: Lead | None = None
) -> tuple[_Feeder, torch.Tensor]:
    """Feed each row's prompt into a new cache (and run its method's observation pass, introduced by
    ``lead``: ``observe_prompts``). A batch whose padded prompt tokens exceed
    ``prefill_tokens`` is prefilled in groups of rows that fit (at least one row each): each group's
    cache compresses into the shapes the whole batch takes (``note_batch``) before the next group is
    prefilled, and the groups are joined (``KVCompressCache.concat``). The peak then holds one group's
    prefill plus the kept cache of every row, and the result is the batched prefill's."""
    width = max(len(p) for p in prompts)
    per_group = len(prompts) if prefill_tokens is None else max(1, prefill_tokens // width)
    lengths = torch.tensor([len(p) for p in prompts], device=model.device)
    feeders, logits = [], []
    for start in range(0, len(prompts), per_group):
        group = prompts[start : start + per_group]
        cache = make_cache()
        if per_group < len(prompts):
            cache.note_batch(lengths)
        feeders.append(_Feeder(model, cache, *_empty_state(model, len(group)), pad_id))
        logits.append(feeders[-1].feed(group, width))
        observe_prompts(feeders[-1], group, lead, first=start)
    if len(feeders) == 1:
        return feeders[0], logits[0]
    cache = KVCompressCache.concat([feeder.cache for feeder in feeders])
    mask, position = (torch.cat([getattr(feeder, name) for feeder in feeders]) for name in ("mask", "position"))
    return _Feeder(model, cache, mask, position, pad_id), torch.cat(logits)


def _recording(cache: KVCompressCache, window: int | None) -> KVCompressCache:
    """``cache``, keeping each layer's last ``window`` prefill queries (None: all; 0: none)."""
    if window != 0:
        cache.record_prefill(window)
    return cache


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _empty_state(model: PreTrainedModel, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(batch, 0, dtype=torch.long,
                       device=model.device), torch.zeros(batch, dtype=torch.long, device=model.device)


@torch.inference_mode()
def prefill(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: Prompt | list[Prompt],
            query_window: int | None = 64) -> Prefill:
    """Prefill ``prompt`` once (full cache), keeping the last ``query_window`` queries per layer
    (None: all, as H2O needs), so several methods can be compared on it without prefilling again
    (``generate(prefill=...)``). It must cover every method's ``queries_needed()``."""
    rows, chunk_lists, is_batch, _ = new_rows(tokenizer, prompt, None)
    _check_lengths(model, [len(chunks[0]) for chunks in chunk_lists], 1)
    cache = FullKV().make_cache(model, tokenizer)
    cache.record_prefill(query_window)
    feeder = _Feeder(model, cache, *_empty_state(model, len(rows)), _pad_id(tokenizer))
    start = time.perf_counter()
    logits = _feed_chunks(feeder, chunk_lists)
    return Prefill(rows, is_batch, cache, logits, feeder.mask, feeder.position,
                   synced_clock(model.device) - start, tokenizer, [chunks[0] for chunks in chunk_lists])


def _from_prefill(model: PreTrainedModel, method: Method, record: Prefill) -> KVCompressCache:
    cache = method.make_cache(model, record.tokenizer)
    for layer, recorded in zip(cache.layers, record.cache.layers):
        layer.load_prefill(recorded)
    feeder = _Feeder(model, cache, record.attention_mask, record.next_position, _pad_id(record.tokenizer))
    observe_prompts(feeder, record.prompts, ChatLeads(record.tokenizer, record.rows))
    return cache


@torch.inference_mode()
def teacher_forced_logprobs(model: PreTrainedModel, record: Prefill, method: Method, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(tokens), vocab]`` of the next token before each of ``tokens`` is fed,
    with ``method``'s cache built from ``record`` (a single prompt); the first row is the prefill's.

    The continuation is fed as one block: exact for methods that only compress the prompt; for
    sparse decoding methods the block's queries select their chunks together (Algorithm 2 of
    ShadowKV with several queries)."""
    logits = record.logits[0][None]
    if len(tokens) > 1:
        feeder = _Feeder(model, _from_prefill(model, method, record), record.attention_mask, record.next_position, 0)
        block = torch.tensor([tokens[:-1]], device=model.device)
        logits = torch.cat([logits, feeder.forward(block, torch.ones_like(block), every_position=True)[0]])
    return logits.float().log_softmax(dim=-1)


@dataclass
class _Start:
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


def _resolve_method(method: Method | str | None) -> Method:
    if method is None:
        return FullKV()
    if isinstance(method, str):
        return method_from_name(method)
    if not isinstance(method, Method):
        raise InvalidParameterError(
            f"method={method!r} is invalid; give a kvcompress method (e.g. kvcompress.SnapKV()) or its name")
    return method


def check_per_question(method: Method) -> None:
    """Refuse, in one line, a method that cannot compress a question over a stored context (it scores a prompt by
    an observation pass of its own before any question)."""
    if method.observation() is not None:
        raise InvalidParameterError(
            f"{method.describe()} scores a prompt by an observation pass before its question, which a question over a "
            "stored context does not need: compress per question with a question-aware method (snapkv, h2o, "
            "streamingllm, expected)")


def _over_context(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str | list[str], method: Method,
                  past: Result) -> _Start:
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
            "cache keeps its method)")
    if not past.cache.storable():
        kept = (f"this context was compressed with {past.cache.method.describe()}, which does not keep its prompt's "
                "tokens in a form a question can be prefilled over")
        raise InvalidParameterError(
            f"{kept}; store it with kvc.compress(..., method=kvc.FullKV()) (or a prompt method with heads='uniform' "
            "and layers='uniform', which thins it) to compress per question, or continue it with method=None",
            cli=f"{kept}; to compress each question with --method, store the document with `kvcompress compress "
            "--method full` (or a prompt method with --heads uniform --layers uniform, which thins it); or leave "
            "--method out to ask this file with the method it was compressed with")
    stored = len(past.rows)
    if isinstance(prompt, list) and stored == 1:
        questions, index = prompt, [0] * len(prompt)
    else:
        questions, index = per_row(prompt, stored, "prompt"), list(range(stored))
    if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
        raise InvalidParameterError(
            "give each question over a stored context as a non-empty string (a list of them for a batch)")
    contexts = {i: context_ids(tokenizer, past.rows[i]) for i in set(index)}
    rows = [copy.deepcopy(past.rows[i]) for i in index]
    asked = [ask(tokenizer, row, question, contexts[i]) for row, question, i in zip(rows, questions, index)]
    for row, i in zip(rows, index):
        row.store_row = i
    return _asked_over(model, tokenizer, method, past, rows, asked, contexts,
                       len(rows) > 1 or isinstance(prompt, list))


def _over_conversation(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str | list[str],
                       method: Method, past: Result) -> _Start:
    """A follow-up compressed per question: everything said after the stored context (each earlier question
    and answer, as the whole conversation's prompt would tokenize them) and the new message are prefilled over
    the store, read and never written, and compressed by ``method`` with them: question-aware compression of
    the whole conversation so far. A turn's cost grows with the conversation after the document, not with it."""
    store = past.store
    assert store is not None
    rows = [copy.deepcopy(row) for row in past.rows]
    contexts = {row.store_row: context_ids(tokenizer, store.rows[row.store_row]) for row in rows}
    asked = []
    for row, text in zip(rows, per_row(prompt, len(rows), "prompt")):
        if not isinstance(text, str) or not text.strip():
            raise InvalidParameterError("give each follow-up as a non-empty string (a list of them for a batch)")
        follow_up(tokenizer, row, text)
        asked.append(after_context(tokenizer, row, contexts[row.store_row]))
    return _asked_over(model, tokenizer, method, store, rows, asked, contexts, len(rows) > 1)


def _asked_over(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, method: Method, store: Result,
                rows: list[Row], asked: list[list[int]], contexts: dict[int, list[int]], is_batch: bool) -> _Start:
    """A fresh cache of ``method`` whose prompt continues rows ``row.store_row`` of ``store`` with each row's
    ``asked`` tokens (right-aligned), to be compressed with them."""
    index = [row.store_row for row in rows]
    width = max(len(ids) for ids in asked)
    chosen = torch.tensor(index, device=model.device)
    cache = method.make_cache(model, tokenizer)
    spans = joined_spans(cache.span_table, [contexts[i] + ids for i, ids in zip(index, asked)],
                         store.attention_mask.shape[-1] + width)
    cache.continue_context(store.cache, chosen, [width - len(ids) for ids in asked],
                           None if spans is None else spans.to(model.device))
    return _Start(cache, rows, is_batch, [[ids] for ids in asked], store.attention_mask[chosen],
                  store.next_position[chosen], context=store.cache, store=store)


def _start(model, tokenizer, prompt, method, question, past, record) -> _Start:
    """The ways in: a new prompt, a follow-up turn (``past``), a question over a stored context (``past``
    and a method), or a shared prefill (``record``)."""
    if past is not None:
        past.cache.check_model(model,
                               "continue a conversation with the model that began it (or kvc.load it for this one)")
        if question is not None:
            raise InvalidParameterError("with past=, give the question as prompt (question= splits a new prompt)")
        if method is not None and past.store is not None:
            return _over_conversation(model, tokenizer, prompt, _resolve_method(method), past)
        if method is not None:
            return _over_context(model, tokenizer, prompt, _resolve_method(method), past)
        if all(row.open_turn for row in past.rows) and type(past.cache.method) is FullKV and past.cache.storable():
            # a whole stored context asked as it is: its tokens continued in a new cache of its method, the store
            # kept for the next question (the answer is the one appending to the store would give)
            return _over_context(model, tokenizer, prompt, past.cache.method, past)
        if past.cache.get_seq_length() != past.attention_mask.shape[-1]:
            raise CacheMisuseError(
                "kvcompress: this conversation was already continued by another generate(past=...) call, which "
                "appended to its cache; ask each question of its own copy (past=context.copy()), or continue the "
                "Result that call returned"
            )
        chunk_lists = [
            [follow_up(tokenizer, row, text)] for row, text in zip(past.rows, per_row(prompt, len(past.rows), "prompt"))
        ]
        if past.cache.device_of() not in (None, model.device):  # a context stored in host memory, continued as it is
            past.cache.move(model.device)
        return _Start(past.cache, past.rows, len(past.rows) > 1, chunk_lists, past.attention_mask, past.next_position,
                      store=past.store)
    if record is not None:
        record.cache.check_model(model, "use a prefill record with the model that prefilled it")
        if prompt is not None or question is not None:
            raise InvalidParameterError("give either prompt (and question) or prefill, not both")
        cache = _from_prefill(model, _resolve_method(method), record)
        return _Start(cache, copy.deepcopy(record.rows), record.is_batch, [], record.attention_mask,
                      record.next_position, record.logits, record.prefill_s)
    if prompt is None:
        raise InvalidParameterError("give a prompt (or prefill=, or past=)")
    resolved = _resolve_method(method)
    rows, chunk_lists, is_batch, opened = new_rows(tokenizer, prompt, question)
    return _Start(
        None, rows, is_batch, chunk_lists, *_empty_state(model, len(rows)),
        make_cache=lambda: resolved.make_cache(model, tokenizer), lead=ChatLeads(tokenizer, opened)
    )


def _check_settings(max_new_tokens: int, compile: bool | Compile, prefill_tokens: int | None) -> None:
    """``generate``'s own settings, each refused in one line naming its value and what it takes."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InvalidParameterError(f"max_new_tokens={max_new_tokens!r} is invalid; it must be an integer >= 1")
    if not isinstance(compile, (bool, Compile)):
        raise InvalidParameterError(f"compile={compile!r} is invalid; give True, False or a kvcompress.Compile")
    if prefill_tokens is not None and (not isinstance(prefill_tokens, int) or isinstance(prefill_tokens, bool) or
                                       prefill_tokens < 1):
        raise InvalidParameterError(
            f"prefill_tokens={prefill_tokens!r} is invalid; give an integer >= 1, or None for one prefill of all rows")


def _sampling(temperature: float, top_p: float, seed: int | None) -> Sampling | None:
    """The sampling settings (None: greedy), each refused in one line naming its value and range."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 100:
        raise InvalidParameterError(f"temperature={temperature!r} is invalid; give a number in [0, 100] (0: greedy)")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise InvalidParameterError(f"top_p={top_p!r} is invalid; give a number in (0, 1]")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise InvalidParameterError(f"seed={seed!r} is invalid; give an integer >= 0, or None")
    unused = [f"{name}={value}" for name, value, default in (("top_p", top_p, 1.0), ("seed", seed, None))
              if value != default]
    if temperature == 0 and unused:
        flags = " ".join(f"--{each.replace('_', '-').replace('=', ' ')}" for each in unused)
        raise InvalidParameterError(
            f"{', '.join(unused)} applies only when sampling: give temperature > 0, or leave it out (greedy)",
            cli=f"{flags} applies only when sampling: give --temperature above 0, or leave it out (greedy)")
    return Sampling(float(temperature), float(top_p), seed) if temperature > 0 else None


def _result(begin: _Start, feeder: _Feeder, decoded: Decoded, tokenizer: PreTrainedTokenizerBase, eos: set[int],
            prefill_s: float, decode_s: float, compiled: bool, build_s: float = 0.0) -> Result:
    """The conversation after a decode: each row's tokens and text, the cache's stats and the run's timings (a CPU
    kernel's build, ``build_s``, apart from them)."""
    cache = feeder.cache
    feeder.mask, feeder.position = torch.cat([feeder.mask, decoded.fed_real.long()], dim=-1), decoded.position
    generated, finished, steps = decoded.tokens, decoded.finished, decoded.steps

    for row, tokens, done in zip(begin.rows, generated, finished):
        row.generated = [t for t in tokens if t not in eos]
        row.pending = None if done else tokens[-1]
    texts = [tokenizer.decode(row.generated, skip_special_tokens=True) for row in begin.rows]
    timed = steps - decoded.compile_steps  # the steps that compiled are timed as compile_s, never as decoding
    # ttft_s: what a user waits for the first token: the prompt fed, any observation pass and the compression, the first
    # token's logits (it is their argmax); decoding's own time is decode_ms_per_token, a first compilation compile_s
    cache.timings = {
        "prefill_s": prefill_s, "ttft_s": prefill_s,
        "decode_ms_per_token": 1000 * (decode_s - decoded.compile_s) / timed if timed else None,
        "compile_s": decoded.compile_s if compiled else None, **({"kernel_build_s": build_s} if build_s else {})
    }
    stats = cache.stats()
    stats["new_tokens"] = [len(g) for g in generated] if begin.is_batch else len(generated[0])
    # the tokens this call fed before decoding: its message, and over a store the conversation it re-read
    fed = [sum(len(chunk) for chunk in chunks) for chunks in begin.chunk_lists] or [0] * len(begin.rows)
    stats["turn_tokens"] = fed if begin.is_batch else fed[0]
    if begin.context is not None:  # the stored context, apart: where it is and what it holds
        held = begin.context.stats()
        stats.update(context_bytes=held["device_bytes"] + held["offloaded_bytes"],
                     context_on=str(begin.context.device_of()))
    return Result(
        text=texts if begin.is_batch else texts[0],
        stats=stats,
        cache=cache,
        token_ids=generated,
        rows=begin.rows,
        attention_mask=feeder.mask,
        next_position=feeder.position,
        store=begin.store,
    )


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt | list[Prompt] | None = None,
    method: Method | str | None = None,
    max_new_tokens: int = 64,
    question: str | list[str] | None = None,
    past: Result | None = None,
    prefill: Prefill | None = None,
    compile: bool | Compile = False,
    prefill_tokens: int | None = PREFILL_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    streamer: Any = None,
) -> Result:
    """Greedy generation with ``method`` (a method, or its name) applied to the prompt's KV cache.

    ``prompt``: a string (raw text), chat messages (the chat template is applied), or a list of either for a batch
    (left-padded; each row compressed as if alone). ``question``: compress the prompt without it first
    (question-agnostic), then append it. ``past``: a previous Result whose conversation (and cache) this call
    continues with ``prompt`` as the next user message; the method is the one that built that cache and is not
    applied again. ``prefill``: a ``Prefill`` of the prompt to start from instead of prefilling again (``prompt`` is
    then not given). ``compile``: decode with one compiled graph per step (``torch.compile(fullgraph=True)``; on a
    GPU replayed as a CUDA graph), or a ``Compile`` with other options; the prompt runs eagerly. ``prefill_tokens``:
    the most padded prompt tokens one prefill forward takes; a larger batch is prefilled in groups of rows, each
    compressed before the next (``prefill_groups``; None: all rows at once). ``temperature`` > 0 samples instead of
    the greedy choice (``top_p``: nucleus sampling; ``seed``: the same seed repeats an answer). ``streamer``: given
    the prompt's tokens, then each new token as it comes (transformers' ``TextStreamer`` works: ``put``, ``end``)."""
    _check_settings(max_new_tokens, compile, prefill_tokens)
    sampling = _sampling(temperature, top_p, seed)
    build_s = _ready_kernel(model, method, past)  # (before the clock)
    clock = time.perf_counter()
    begin = _start(model, tokenizer, prompt, method, question, past, prefill)
    fed = [int(p) + sum(len(c) for c in chunks) for p, chunks in zip(begin.position.tolist(), begin.chunk_lists)
           ] if begin.chunk_lists else begin.position.tolist()
    _check_lengths(model, fed, max_new_tokens)
    if begin.cache is None:  # a new prompt: prefilled in groups of rows when the batch is large
        feeder, first = prefill_groups(model, begin.make_cache, [chunks[0] for chunks in begin.chunk_lists],
                                       _pad_id(tokenizer), prefill_tokens, begin.lead)
        logits = _feed_chunks(feeder, [chunks[1:] for chunks in begin.chunk_lists], first)
    else:
        feeder = _Feeder(model, begin.cache, begin.mask, begin.position, _pad_id(tokenizer))
        logits = _feed_chunks(feeder, begin.chunk_lists) if begin.chunk_lists else begin.logits
    cache = feeder.cache
    prefill_s = begin.prefill_s + synced_clock(model.device) - clock

    eos = _eos_ids(model, tokenizer)
    decode_start = time.perf_counter()
    options = Compile() if compile is True else compile or None
    if streamer is not None:  # as transformers' generate does: the prompt first (a TextStreamer may skip it)
        streamer.put(torch.tensor([[t for chunk in begin.chunk_lists[0] for t in chunk] if begin.chunk_lists else []],
                                  dtype=torch.long))
    decoded = greedy_decode(model, cache, logits, feeder.position, max_new_tokens, eos, options, sampling, streamer)
    decode_s = synced_clock(model.device) - decode_start
    return _result(begin, feeder, decoded, tokenizer, eos, prefill_s, decode_s, options is not None, build_s)


def _ready_kernel(model: PreTrainedModel, method: Method | str | None, past: Result | None) -> float:
    """The CPU decoding kernel built before any clock starts, where the generation's method (``method``, or else the
    continued ``past``'s) stores codes on a CPU: the seconds its build took this time, reported apart from every
    timing (``kernel_build_s``; 0.0 once built)."""
    asked = past.cache.method if past is not None and method is None else _resolve_method(method)
    return ready_cpu_kernel() if model.device.type == "cpu" and asked.kv_codec() is not None else 0.0


# a stored context's last prefill queries kept per layer, for the question-aware methods asked over it
QUERY_WINDOW = 64


@torch.inference_mode()
def compress(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: Prompt | list[Prompt],
    method: Method | str | None = None, prefill_tokens: int | None = PREFILL_TOKENS,
    query_window: int | None | str = "auto"
) -> Result:
    """Prefill and compress ``prompt`` (a document, a codebase, a chat history; or a list of them)
    once, with no question: the result waits for one, ``generate(model, tokenizer, question,
    past=result)``, asked of it or of copies saved with ``result.save(path)`` and ``load``. The cache
    is the one ``generate(prompt, question=...)`` compresses, so asking gives its tokens.

    A stored context (a method that keeps the prompt's tokens: ``FullKV``, or a prompt method with
    uniform budgets, which thins it) can also be asked with a method of its own, ``generate(model,
    tokenizer, question, past=result, method=SnapKV(...))``: each question is prefilled over the
    context, and compressed with it, which leaves the context as it is. ``query_window``: its last
    prefill queries kept per layer (None: all, as H2O needs), for methods that score with queries
    before the question's; "auto": the last ``QUERY_WINDOW`` where the context keeps every token, none
    where it is thinned (they would add to what a compressed context holds). On an accelerator, a
    context that keeps every token is held in host memory."""
    auto = query_window == "auto"
    if not auto and query_window is not None and (not isinstance(query_window, int) or isinstance(query_window, bool) or
                                                  query_window < 0):
        raise InvalidParameterError(
            f"query_window={query_window!r} is invalid; give an integer >= 0, None to keep every query, or 'auto'")
    clock = time.perf_counter()
    prompts, is_batch = prompt_rows(prompt)
    turns = [context_turn(tokenizer, p) for p in prompts]
    _check_lengths(model, [len(context) for _, context in turns], 1)
    resolved = _resolve_method(method)
    rows = [row for row, _ in turns]
    feeder, _ = prefill_groups(
        model, lambda: _recording(resolved.make_cache(model, tokenizer), QUERY_WINDOW if auto else query_window),
        [context for _, context in turns], _pad_id(tokenizer), prefill_tokens, ChatLeads(tokenizer, rows)
    )
    feeder.cache.timings = {
        "prefill_s": synced_clock(model.device) - clock, "ttft_s": None, "decode_ms_per_token": None, "compile_s": None
    }
    whole = feeder.cache.hold_in_host()  # a stored context: in host memory on a GPU
    if auto and not whole:
        feeder.cache.forget_records()
    return Result(
        text=[""] * len(rows) if is_batch else "", stats=feeder.cache.stats(), cache=feeder.cache,
        token_ids=[[] for _ in rows], rows=rows, attention_mask=feeder.mask, next_position=feeder.position
    )
