"""``kvcompress.generate``: the generation loop over a compressed cache, with timing and stats.

Prompts are fed as one or two chunks of tokens (conversation.py makes them; feed.py feeds them): the whole prompt
(question-aware compression: the question sits at the end, inside SnapKV's observation window), or, with
``question=``, the context first (compressed without seeing the question, as kvpress does) and then the question. A
``Result`` can be continued with a follow-up turn (``past=result``) over the same cache, or asked a question
compressed over it (a stored context): ways_in.py says which way in the arguments name and where each starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.errors import CacheMisuseError, flag_for
from ..methods import FullKV, InvalidParameterError, Method
from ..methods.fields import field_specs, param, setting
from ..storage.cpu_kernels import ready_cpu_kernel
from ..storage.tensors import synced_clock
from .conversation import ChatLeads, Prompt, context_turn, new_rows, prompt_rows
from .decode import Compile, Decoded, Sampling, greedy_decode
from .feed import (
    PREFILL_TOKENS,
    Feeder,
    Prefill,
    check_lengths,
    empty_state,
    feed_chunks,
    pad_id,
    prefill_groups,
    recording,
)
from .result import Result
from .stops import Stops, text_of
from .ways_in import Start, WayIn, resolve_method, way_in

# a stored context's last prefill queries kept per layer, for the question-aware methods asked over it
QUERY_WINDOW = 64


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt | list[Prompt],
    query_window: int | None = 64,
) -> Prefill:
    """Prefill ``prompt`` once (full cache), keeping the last ``query_window`` queries per layer
    (None: all, as H2O needs), so several methods can be compared on it without prefilling again
    (``generate(prefill=...)``). It must cover every method's ``queries_needed()``."""
    rows, chunk_lists, is_batch, _ = new_rows(tokenizer, prompt, None)
    check_lengths(model, [len(chunks[0]) for chunks in chunk_lists], 1)
    cache = FullKV().make_cache(model, tokenizer)
    cache.record_prefill(query_window)
    feeder = Feeder(model, cache, *empty_state(model, len(rows)), pad_id(tokenizer))
    start = time.perf_counter()
    logits = feed_chunks(feeder, chunk_lists)
    return Prefill(
        rows,
        is_batch,
        cache,
        logits,
        feeder.mask,
        feeder.position,
        synced_clock(model.device) - start,
        tokenizer,
        [chunks[0] for chunks in chunk_lists],
    )


@torch.inference_mode()
def teacher_forced_logprobs(model: PreTrainedModel, record: Prefill, method: Method, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(tokens), vocab]`` of the next token before each of ``tokens`` is fed,
    with ``method``'s cache built from ``record`` (a single prompt): ``forced_logprobs(..., prefill=record)``."""
    return forced_logprobs(model, record.tokenizer, tokens, method=method, prefill=record)


@torch.inference_mode()
def forced_logprobs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tokens: list[int],
    prompt: Prompt | None = None,
    method: Method | str | None = None,
    question: str | None = None,
    past: Result | None = None,
    prefill: Prefill | None = None,
) -> torch.Tensor:
    """Log-probabilities ``[len(tokens), vocab]`` of the next token before each of ``tokens`` is fed, over the cache
    ``generate`` with the same arguments (one prompt) would decode from; the first row is the prompt's. Fed with
    another cache's answer, it says how closely this one follows it, token by token (teacher-forced agreement).

    The continuation is fed as one block: exact for methods that only compress the prompt; for
    sparse decoding methods the block's queries select their chunks together (Algorithm 2 of
    ShadowKV with several queries); a decoding bound re-selects once, after the block. As with ``generate``, a later
    turn appends to ``past``'s cache (pass a copy to ask it again); a question over a stored context reads it only."""
    way = way_in(model, prompt, method, question, past, prefill)
    begin, feeder, logits, _ = _begun(model, tokenizer, way, max(len(tokens), 1), PREFILL_TOKENS)
    if begin.is_batch:
        raise InvalidParameterError("forced_logprobs takes one prompt, not a batch")
    rows = [logits[:1]]
    if len(tokens) > 1:
        block = torch.tensor([tokens[:-1]], device=model.device)
        rows.append(feeder.forward(block, torch.ones_like(block), every_position=True)[0])
    return torch.cat(rows).float().log_softmax(dim=-1)


def _begun(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    way: WayIn,
    max_new_tokens: int,
    prefill_tokens: int | None,
) -> tuple[Start, Feeder, torch.Tensor, float]:
    """The way in taken: its start, the feeder holding the prompt's cache (compressed), the logits after the prompt
    and the seconds the prompt took."""
    clock = time.perf_counter()
    begin = way.start(model, tokenizer)
    fed = (
        [int(p) + sum(len(c) for c in chunks) for p, chunks in zip(begin.position.tolist(), begin.chunk_lists)]
        if begin.chunk_lists
        else begin.position.tolist()
    )
    check_lengths(model, fed, max_new_tokens)
    if begin.cache is None:  # a new prompt: prefilled in groups of rows when the batch is large
        if begin.make_cache is None:
            raise CacheMisuseError("kvcompress: a new prompt came with no way to make its cache")
        feeder, first = prefill_groups(
            model,
            begin.make_cache,
            [chunks[0] for chunks in begin.chunk_lists],
            pad_id(tokenizer),
            prefill_tokens,
            begin.lead,
        )
        logits = feed_chunks(feeder, [chunks[1:] for chunks in begin.chunk_lists], first)
    else:
        feeder = Feeder(model, begin.cache, begin.mask, begin.position, pad_id(tokenizer))
        logits = feed_chunks(feeder, begin.chunk_lists, begin.logits)
    return begin, feeder, logits, begin.prefill_s + synced_clock(model.device) - clock


@dataclass(frozen=True)
class Settings:
    """``generate``'s and ``compress``'s own settings, declared as a method's fields are (``methods.fields.param``), so
    each is checked by its declaration and refused in one line naming its value and range, in the methods' words."""

    max_new_tokens: int = param(64, "tokens to generate per row at most", minimum=1)
    prefill_tokens: int | None = param(
        PREFILL_TOKENS,
        "padded prompt tokens one prefill forward takes at most",
        minimum=1,
        none="one prefill of all rows",
    )
    temperature: float = param(
        0.0, "sample at this temperature instead of the greedy choice (0: greedy)", minimum=0, at_most=100
    )
    top_p: float = param(1.0, "nucleus sampling's probability mass", above=0, at_most=1)
    seed: int | None = param(
        None, "the sampling seed (the same seed repeats an answer)", minimum=0, none="an unseeded draw"
    )
    query_window: int | None = param(
        QUERY_WINDOW,
        "a stored context's last prefill queries kept per layer (or 'auto')",
        minimum=0,
        none="every query, or 'auto'",
    )


SETTINGS = {spec.name: spec for spec in field_specs(Settings)}  # read once: generate checks them at every call


def _check(**values: Any) -> None:
    """Each of ``values`` against its declaration in ``Settings``."""
    for name, value in values.items():
        SETTINGS[name].check("kvcompress", value)


def _check_settings(max_new_tokens: int, compile: bool | Compile, prefill_tokens: int | None) -> None:
    """``generate``'s own settings, each refused in one line naming its value and what it takes."""
    _check(max_new_tokens=max_new_tokens, prefill_tokens=prefill_tokens)
    if not isinstance(compile, (bool, Compile)):
        raise InvalidParameterError("{compile=} is invalid; give True, False or a kvcompress.Compile", compile=compile)


def _sampling(temperature: float, top_p: float, seed: int | None) -> Sampling | None:
    """The sampling settings (None: greedy), each refused in one line naming its value and range."""
    _check(temperature=temperature, top_p=top_p, seed=seed)
    unused = {name: value for name, value, default in (("top_p", top_p, 1.0), ("seed", seed, None)) if value != default}
    if temperature == 0 and unused:
        flags = " ".join(f"{flag_for(name)} {value}" for name, value in unused.items())
        raise InvalidParameterError(
            ", ".join(map(setting, unused)) + " applies only when sampling: give {temperature!n} > 0, or leave it out "
            "(greedy)",
            cli=f"{flags} applies only when sampling: give --temperature above 0, or leave it out (greedy)",
            **unused,
        )
    return Sampling(float(temperature), float(top_p), seed) if temperature > 0 else None


def _result(
    begin: Start,
    feeder: Feeder,
    decoded: Decoded,
    tokenizer: PreTrainedTokenizerBase,
    eos: set[int],
    prefill_s: float,
    decode_s: float,
    compiled: bool,
    build_s: float = 0.0,
    stops: Stops | None = None,
) -> Result:
    """The conversation after a decode: each row's tokens and text (before a stop string), the cache's stats and the
    run's timings (a CPU kernel's build, ``build_s``, apart from them)."""
    cache = feeder.cache
    feeder.mask, feeder.position = torch.cat([feeder.mask, decoded.fed_real.long()], dim=-1), decoded.position
    generated, finished, steps = decoded.tokens, decoded.finished, decoded.steps

    for row, tokens, done in zip(begin.rows, generated, finished):
        row.generated = [t for t in tokens if t not in eos]
        row.pending = None if done else tokens[-1]
    texts = [text_of(tokenizer, row.generated, skip_special_tokens=True) for row in begin.rows]
    texts = texts if stops is None else [stops.ended(text) for text in texts]
    timed = steps - decoded.compile_steps  # the steps that compiled are timed as compile_s, never as decoding
    # ttft_s: what a user waits for the first token: the prompt fed, any observation pass and the compression, the first
    # token's logits (it is their argmax); decoding's own time is decode_ms_per_token, a first compilation compile_s
    cache.timings = {
        "prefill_s": prefill_s,
        "ttft_s": prefill_s,
        "decode_ms_per_token": 1000 * (decode_s - decoded.compile_s) / timed if timed else None,
        "compile_s": decoded.compile_s if compiled else None,
        **({"kernel_build_s": build_s} if build_s else {}),
    }
    stats = cache.stats()
    stats["new_tokens"] = [len(g) for g in generated] if begin.is_batch else len(generated[0])
    # the tokens this call fed before decoding: its message, and over a store the conversation it re-read
    fed = [sum(len(chunk) for chunk in chunks) for chunks in begin.chunk_lists] or [0] * len(begin.rows)
    stats["turn_tokens"] = fed if begin.is_batch else fed[0]
    if begin.context is not None:  # the stored context, apart: where it is and what it holds
        held = begin.context.stats()
        stats.update(
            context_bytes=held["device_bytes"] + held["offloaded_bytes"], context_on=str(begin.context.device_of())
        )
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
    stop: str | list[str] | None = None,
) -> Result:
    """Greedy generation with ``method`` (a method, or its name) applied to the prompt's KV cache.

    ``prompt``: a string (raw text), chat messages (the chat template is applied), or a list of either for a batch
    (left-padded; each row compressed as if alone). ``question``: compress the prompt without it first
    (question-agnostic), then append it. ``past``: a previous Result whose conversation (and cache) this call
    continues with ``prompt`` as the next user message: a cache that keeps only its method's selection is continued
    with that method; one that holds its document whole (a stored context, a saved chat) has each question
    compressed over it with ``method`` (``ways_in`` says which way in the arguments name). ``prefill``: a
    ``Prefill`` of the prompt to start from instead of prefilling again (``prompt`` is
    then not given). ``compile``: decode with one compiled graph per step (``torch.compile(fullgraph=True)``; on a
    GPU replayed as a CUDA graph), or a ``Compile`` with other options; the prompt runs eagerly. ``prefill_tokens``:
    the most padded prompt tokens one prefill forward takes; a larger batch is prefilled in groups of rows, each
    compressed before the next (``prefill_groups``; None: all rows at once). ``temperature`` > 0 samples instead of
    the greedy choice (``top_p``: nucleus sampling; ``seed``: the same seed repeats an answer). ``streamer``: given
    the prompt's tokens, then each new token as it comes (transformers' ``TextStreamer`` works: ``put``, ``end``).
    ``stop``: a string, or strings, that end an answer where its text first holds one (not part of ``text``; what a
    base model needs, e.g. ``"\n"``: stops.py)."""
    _check_settings(max_new_tokens, compile, prefill_tokens)
    sampling, stops = _sampling(temperature, top_p, seed), Stops.of(stop, tokenizer)
    way = way_in(model, prompt, method, question, past, prefill)  # (checks only)
    build_s = _ready_kernel(model, way.method)  # (before the clock)
    begin, feeder, logits, prefill_s = _begun(model, tokenizer, way, max_new_tokens, prefill_tokens)
    cache = feeder.cache

    eos = _eos_ids(model, tokenizer)
    decode_start = time.perf_counter()
    options = Compile() if compile is True else compile or None
    if streamer is not None:  # as transformers' generate does: the prompt first (a TextStreamer may skip it)
        streamer.put(
            torch.tensor(
                [[t for chunk in begin.chunk_lists[0] for t in chunk] if begin.chunk_lists else []], dtype=torch.long
            )
        )
    decoded = greedy_decode(
        model, cache, logits, feeder.position, max_new_tokens, eos, options, sampling, streamer, stops
    )
    decode_s = synced_clock(model.device) - decode_start
    return _result(begin, feeder, decoded, tokenizer, eos, prefill_s, decode_s, options is not None, build_s, stops)


def _ready_kernel(model: PreTrainedModel, method: Method) -> float:
    """The CPU decoding kernel built before any clock starts, where the generation's ``method`` stores codes on a
    CPU: the seconds its build took this time, reported apart from every timing (``kernel_build_s``; 0.0 once
    built)."""
    return ready_cpu_kernel() if model.device.type == "cpu" and method.kv_codec() is not None else 0.0


@torch.inference_mode()
def compress(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt | list[Prompt],
    method: Method | str | None = None,
    prefill_tokens: int | None = PREFILL_TOKENS,
    query_window: int | None | str = "auto",
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
    _check(prefill_tokens=prefill_tokens, **({} if auto else {"query_window": query_window}))
    clock = time.perf_counter()
    prompts, is_batch = prompt_rows(prompt)
    turns = [context_turn(tokenizer, p) for p in prompts]
    check_lengths(model, [len(context) for _, context in turns], 1)
    resolved = resolve_method(method)
    rows = [row for row, _ in turns]
    window = QUERY_WINDOW if isinstance(query_window, str) else query_window  # ("auto": the only text _check takes)
    feeder, _ = prefill_groups(
        model,
        lambda: recording(resolved.make_cache(model, tokenizer), window),
        [context for _, context in turns],
        pad_id(tokenizer),
        prefill_tokens,
        ChatLeads(tokenizer, rows),
    )
    feeder.cache.timings = {
        "prefill_s": synced_clock(model.device) - clock,
        "ttft_s": None,
        "decode_ms_per_token": None,
        "compile_s": None,
    }
    whole = feeder.cache.hold_in_host()  # a stored context: in host memory on a GPU
    if auto and not whole:
        feeder.cache.forget_records()
    return Result(
        text=[""] * len(rows) if is_batch else "",
        stats=feeder.cache.stats(),
        cache=feeder.cache,
        token_ids=[[] for _ in rows],
        rows=rows,
        attention_mask=feeder.mask,
        next_position=feeder.position,
    )
