"""The feeding loop: prompts fed into a cache a chunk of tokens per row at a time, the 2-D mask and per-row positions
kept in step (``Feeder``), a method's observation pass (``observe_prompts``), a batch prefilled in groups of rows
(``prefill_groups``), and a prompt prefilled once with the full cache for several methods (``Prefill``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.errors import Said
from ..cache.kv_cache import KVCompressCache
from ..storage.tensors import synced_clock
from .conversation import Lead
from .result import Row

# padded prompt tokens one prefill forward takes at most: a larger batch is prefilled in groups of rows
PREFILL_TOKENS = 8192


class PromptTooLongError(Said, ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


def _context_limit(model: PreTrainedModel) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def check_lengths(model: PreTrainedModel, total: list[int], max_new_tokens: int) -> None:
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
                "prompt {i} has {n} tokens; with {max_new_tokens=} it would run past the model's context of {limit} "
                "tokens (max_position_embeddings); lower {max_new_tokens!n} to {most} or less",
                i=i,
                n=n,
                max_new_tokens=max_new_tokens,
                limit=limit,
                most=limit - n,
            )


class Feeder:
    """Runs forward passes over the cache, keeping the 2-D mask and per-row positions in step."""

    def __init__(
        self, model: PreTrainedModel, cache: KVCompressCache, mask: torch.Tensor, position: torch.Tensor, pad_id: int
    ):
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


def observe_prompts(feeder: Feeder, prompts: list[list[int]], lead: Lead | None, first: int = 0) -> None:
    """Run the observation pass of the cache's method over each row's prompt, if it has one (KVzip:
    the model asked to repeat the context, and the context as its answer), piece by piece, then let
    the cache compress. ``lead`` addresses the rows (``first``: the batch row of ``prompts[0]``)."""
    observation = feeder.cache.method.observation() if feeder.cache.observe_first else None
    if observation is None:
        feeder.cache.compress_waiting()  # a prefill record's layers, ranked together without a pass
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
                lead.introduce(first + row, text, before) + ids[start : start + size] if start < len(ids) else []
            )
        feeder.peek(pieces)
    feeder.cache.end_observation(synced_clock(feeder.device) - clock)


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


def feed_chunks(feeder: Feeder, chunk_lists: list[list[list[int]]], logits: torch.Tensor | None = None) -> torch.Tensor:
    """Feed each row's chunks, one step per chunk; the last logits (``logits`` when nothing is left)."""
    for step in range(max((len(c) for c in chunk_lists), default=0)):
        logits = feeder.feed([chunks[step] if step < len(chunks) else [] for chunks in chunk_lists])
    if logits is None:
        raise ValueError("kvcompress: no tokens were fed, and no logits were given for the next token")
    return logits


def prefill_groups(
    model: PreTrainedModel,
    make_cache: Callable[[], KVCompressCache],
    prompts: list[list[int]],
    pad_id: int,
    prefill_tokens: int | None,
    lead: Lead | None = None,
) -> tuple[Feeder, torch.Tensor]:
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
        feeders.append(Feeder(model, cache, *empty_state(model, len(group)), pad_id))
        logits.append(feeders[-1].feed(group, width))
        observe_prompts(feeders[-1], group, lead, first=start)
    if len(feeders) == 1:
        return feeders[0], logits[0]
    cache = KVCompressCache.concat([feeder.cache for feeder in feeders])
    mask, position = (torch.cat([getattr(feeder, name) for feeder in feeders]) for name in ("mask", "position"))
    return Feeder(model, cache, mask, position, pad_id), torch.cat(logits)


def recording(cache: KVCompressCache, window: int | None) -> KVCompressCache:
    """``cache``, keeping each layer's last ``window`` prefill queries (None: all; 0: none)."""
    if window != 0:
        cache.record_prefill(window)
    return cache


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def empty_state(model: PreTrainedModel, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(batch, 0, dtype=torch.long, device=model.device), torch.zeros(
        batch, dtype=torch.long, device=model.device
    )
