"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models").

A prompt position's importance is the attention it receives, accumulated over every prompt query
(causal). Each KV head keeps its top ``budget - recent`` positions (the heavy hitters) plus the
``recent`` most recent tokens. Scores are accumulated in blocks of queries, so memory stays linear
in the prompt length. GQA: accumulated over the query heads of each KV head (mean), as for SnapKV.

With ``evict_during_decoding=True`` the cache stays at ``budget`` while generating, as in the
original H2O: every step adds the new query's attention to the scores and evicts, per KV head, the
lowest-scoring slot outside the recent window. The defaults split the budget evenly between heavy
hitters and recent tokens (the H2O paper's setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cache import CompressedLayer, causal_slot_mask
from .base import Method, budget_counts, check_budget, check_positive_int
from .snapkv import average_over_groups

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def accumulated_attention(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, block: int = 256) -> torch.Tensor:
    """Attention each key receives, summed over all (real, causal) queries, per query head
    ``[batch, q_heads, seq]``; computed ``block`` queries at a time."""
    batch, q_heads, seq, dim = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    total = torch.zeros(batch, q_heads, seq, dtype=torch.float32, device=query.device)
    key_pos = torch.arange(seq, device=query.device)
    for start in range(0, seq, block):
        q = query[:, :, start : start + block].float()
        rows = q.shape[2]
        logits = (q.reshape(batch, kv_heads, group * rows, dim) @ keys.float().transpose(-1, -2)).view(batch, q_heads, rows, seq) * scaling
        visible = (key_pos[None, :] <= torch.arange(start, start + rows, device=query.device)[:, None])[None, None] & valid[:, None, None, :]
        probs = logits.masked_fill(~visible, torch.finfo(torch.float32).min).softmax(dim=-1)
        probs = probs * valid[:, None, start : start + rows, None]  # padding queries vote nothing
        total += probs.sum(dim=2)
    return total


def protect_recent(scores: torch.Tensor, recent: int) -> torch.Tensor:
    """A copy of ``scores [..., seq]`` with the ``recent`` last positions at ``+inf`` (always kept)."""
    protected = scores.clone()
    protected[..., protected.shape[-1] - recent :] = math.inf
    return protected


def h2o_scores(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, recent: int, block: int = 256) -> torch.Tensor:
    """``[batch, kv_heads, seq]``: accumulated attention, with the ``recent`` last tokens at ``+inf``."""
    return protect_recent(average_over_groups(accumulated_attention(query, keys, valid, scaling, block), keys.shape[1]), recent)


@dataclass
class H2O(Method):
    """Keep heavy hitters (top accumulated attention) plus recent tokens; optionally evict while decoding."""

    name: ClassVar[str] = "h2o"
    budget: int = 1024
    recent: int | None = None  # default: budget // 2
    evict_during_decoding: bool = False
    block: int = 256

    def validate(self) -> None:
        check_positive_int("H2O", "block", self.block)
        if self.recent is not None:
            check_positive_int("H2O", "recent", self.recent, minimum=0)
        check_budget("H2O", self.budget, "recent", self.recent_tokens, "recent tokens")

    @property
    def recent_tokens(self) -> int:
        return self.recent if self.recent is not None else self.budget // 2

    def queries_needed(self) -> int | None:
        return None  # every prompt query votes

    def keep_counts(self, lengths: torch.Tensor) -> torch.Tensor:
        return budget_counts(lengths, self.budget, None, floor=self.recent_tokens)

    def scores(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
        return h2o_scores(query, keys, valid, scaling, self.recent_tokens, self.block)

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> CompressedLayer:
        return H2OLayer(self, layer_idx) if self.evict_during_decoding else CompressedLayer(self, layer_idx)


class H2OLayer(CompressedLayer):
    """H2O with eviction while decoding: the layer keeps its slots' accumulated scores."""

    method: H2O

    def __init__(self, method: H2O, layer_idx: int) -> None:
        super().__init__(method, layer_idx)
        self.slot_scores: torch.Tensor | None = None  # [batch, kv_heads, slots]
        self.prompt_accumulated: torch.Tensor | None = None  # only during prefill compression

    def _compress_prompt(self, query: torch.Tensor, scaling: float) -> None:
        # Computed once: it ranks the prompt (prompt_scores) and seeds the scores eviction keeps adding to.
        accumulated = accumulated_attention(query, self.keys, self.slot_validity(), scaling, self.method.block)
        self.prompt_accumulated = average_over_groups(accumulated, self.keys.shape[1])
        super()._compress_prompt(query, scaling)
        full, self.prompt_accumulated = self.prompt_accumulated, None
        if self.positions is None:
            self.slot_scores = full
        else:  # the kept slots' scores (filler slots: -inf, evicted first)
            self.slot_scores = full.gather(2, self.positions.clamp(min=0)).masked_fill(self.positions < 0, -math.inf)

    def prompt_scores(self, query: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
        return protect_recent(self.prompt_accumulated, self.method.recent_tokens)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        if self.slot_scores is None:
            return super().attend(query, keys, values, mask, scaling)
        batch, q_heads, q_len, dim = query.shape
        kv_heads = keys.shape[1]
        group = q_heads // kv_heads
        logits = (query.float().reshape(batch, kv_heads, group * q_len, dim) @ keys.float().transpose(-1, -2)).view(batch, q_heads, q_len, -1) * scaling
        if mask is None:
            mask = causal_slot_mask(q_len, keys.shape[-2], keys.device)
        probs = logits.masked_fill(~mask, torch.finfo(torch.float32).min).softmax(dim=-1)
        new = torch.zeros(batch, kv_heads, q_len, device=keys.device)
        self.slot_scores = torch.cat([self.slot_scores, new], dim=-1) + average_over_groups(probs.sum(dim=2), kv_heads)
        out = (probs.view(batch, kv_heads, group * q_len, -1) @ values.float()).view(batch, q_heads, q_len, dim)
        return out.to(query.dtype)

    def commit(self, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float) -> None:
        super().commit(query, new_valid, scaling)
        if self.slot_scores is not None:
            self._evict()

    def _evict(self) -> None:
        """Drop, per KV head, the lowest-scoring slots outside the recent window until ``budget`` remain."""
        excess = self.keys.shape[-2] - self.method.budget
        if excess <= 0:
            return
        keep = protect_recent(self.slot_scores, self.method.recent_tokens).topk(self.method.budget, dim=-1).indices.sort(dim=-1).values
        gather = keep[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys, self.values = self.keys.gather(2, gather), self.values.gather(2, gather)
        self.slot_scores = self.slot_scores.gather(2, keep)
        self.valid = None if self.valid is None else self.valid.gather(1, keep[:, 0])
        self.positions = None  # positions of a decode-evicted cache mix prompt and generated tokens
