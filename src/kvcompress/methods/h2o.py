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
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from ..cache.held import hold
from ..cache.layer import KVLayer
from ..cache.policy import present
from ..storage.attention import group_mask, grouped_logits, key_probabilities
from ..storage.capped import CappedSlots
from ..storage.codec import attended_pair
from ..storage.tensors import gather_tokens
from .base import check_reserved
from .bounded import HeldTokens, note_step_positions, prompt_positions_held
from .eviction import EvictionPolicy
from .fields import param, require
from .prompt import PromptMethod
from .snapkv import average_over_groups, window_votes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .bounded import BoundedPolicy


def accumulated_attention(
    query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, block: int = 256
) -> torch.Tensor:
    """Attention each key receives, summed over all (real, causal) queries, per query head
    ``[batch, q_heads, seq]``; computed ``block`` queries and one KV head at a time, so memory stays
    linear in the prompt length."""
    batch, q_heads, seq, _ = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    total = torch.zeros(batch, q_heads, seq, dtype=torch.float32, device=query.device)
    key_pos = torch.arange(seq, device=query.device)
    for start in range(0, seq, block):
        rows = min(block, seq - start)
        visible = (key_pos[None, :] <= torch.arange(start, start + rows, device=query.device)[:, None])[
            None, None
        ] & valid[:, None, None, :]
        for h in range(kv_heads):
            logits = grouped_logits(
                query[:, h * group : (h + 1) * group, start : start + rows], keys[:, h : h + 1], scaling
            )
            probs = key_probabilities(
                logits.masked_fill(~visible, torch.finfo(torch.float32).min), slice(h * group, (h + 1) * group)
            )
            # padding queries vote nothing
            total[:, h * group : (h + 1) * group] += (probs * valid[:, None, start : start + rows, None]).sum(dim=2)
    return total


def protect_recent(scores: torch.Tensor, recent: int) -> torch.Tensor:
    """A copy of ``scores [..., seq]`` with the ``recent`` last positions at ``+inf`` (always kept)."""
    protected = scores.clone()
    protected[..., protected.shape[-1] - recent :] = math.inf
    return protected


def h2o_scores(
    query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, recent: int, block: int = 256
) -> torch.Tensor:
    """``[batch, kv_heads, seq]``: accumulated attention, with the ``recent`` last tokens at ``+inf``."""
    return protect_recent(
        average_over_groups(accumulated_attention(query, keys, valid, scaling, block), keys.shape[1]), recent
    )


@dataclass
class H2O(PromptMethod):
    """Keep heavy hitters (top accumulated attention) plus recent tokens; optionally evict while decoding."""

    name: ClassVar[str] = "h2o"
    not_served: ClassVar[str | None] = None  # vLLM serves it (docs/vllm.md)
    recent: int | None = param(None, "recent tokens always kept (default budget // 2)", minimum=0)
    evict_during_decoding: bool = param(False, "keep evicting while generating, so the cache stays at the budget")
    block: int = param(256, "prompt queries whose attention is accumulated at once (memory vs speed)", minimum=1)

    def validate(self) -> None:
        super().validate()
        require(
            not (self.evict_during_decoding and self.ratio is not None),
            "{owner}: {evict_during_decoding!n} needs a fixed budget, not {ratio!n}",
            owner="H2O",
        )
        require(
            not (self.evict_during_decoding and self.decode_budget is not None),
            "{owner}: {evict_during_decoding!n} keeps the cache at {budget=} at every step; give it or "
            "{decode_budget=}, not both",
            owner="H2O",
            budget=self.budget_tokens,
            decode_budget=self.decode_budget,
        )
        require(
            not (self.evict_during_decoding and self.heads == "adaptive"),
            "{owner}: {evict_during_decoding!n} keeps a uniform budget per head; it does not combine with "
            "{heads='adaptive'}",
            owner="H2O",
        )
        require(
            self.kv_bytes is None or self.recent is not None,
            "{owner}: {kv_bytes=} has no token budget to split into heavy hitters and recent tokens ({recent!n} "
            "defaults to half the budget); valid: {kv_bytes!n} with {recent!n} given, e.g. {recent=32}",
            owner="H2O",
            kv_bytes=self.kv_bytes,
        )
        require(
            not (self.evict_during_decoding and self.kv_bytes is not None),
            "{owner}: {evict_during_decoding!n} keeps a token budget at every step; it does not combine with "
            "{kv_bytes=}",
            owner="H2O",
            kv_bytes=self.kv_bytes,
        )
        if self.ratio is None and self.kv_bytes is None:
            check_reserved("H2O", self.budget_tokens, "recent", self.recent_tokens, "recent tokens")

    @property
    def recent_tokens(self) -> int:
        return self.recent if self.recent is not None else self.budget_tokens // 2

    def reserved_tokens(self) -> int:
        return self.recent_tokens

    def queries_needed(self, asked: int | None = None) -> int | None:
        return None  # every prompt query votes

    def scores(
        self,
        query: torch.Tensor | None,
        keys: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        spans: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return h2o_scores(present(query)[0], keys, valid, scaling, self.recent_tokens, self.block)

    def decode_scores(
        self, policy: BoundedPolicy, held: HeldTokens, query: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Under ``decode_budget``: the attention the last steps' queries gave each held token, accumulated (the
        heavy hitters of the recent steps; ``evict_during_decoding`` accumulates every step's), with the ``recent``
        tokens kept."""
        votes = average_over_groups(window_votes(query, held.keys, held.valid, scaling), held.keys.shape[1])
        window = torch.full((*votes.shape[:2], query.shape[-2]), math.inf, device=votes.device)
        return protect_recent(torch.cat([votes, window], dim=-1), self.recent_tokens)

    def attends_slots(self) -> bool:
        # evicting, a step runs its own attention (H2OPolicy.attend)
        return super().attends_slots() and not self.evict_during_decoding

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        layer = super().make_layer(layer_idx, model)
        if not self.evict_during_decoding:
            return layer
        # a pyramid's share (a float: layers="global" needs an observation pass, which H2O has not); capped at the
        # layer's budget while decoding, notes per slot [batch, kv_heads, slots]: accumulated attention, and position
        # in the row (-1: padding)
        share = float(cast(EvictionPolicy, layer.policy).share)
        fills = {"slot_scores": 0.0, "slot_positions": -1}
        capped = CappedSlots(math.ceil(self.budget_tokens * share), fills, accumulated=("slot_scores",))
        return KVLayer(layer_idx, H2OPolicy(self, share), capped)


class H2OPolicy(EvictionPolicy):
    """H2O with eviction while decoding: the layer's storage (``make_layer`` gives it) is capped at its budget
    (``capped.CappedSlots``), each slot noted with its accumulated score and position.

    Each step writes its tokens after the held ones, adds the step's attention to every slot's
    score, then keeps, per KV head, the ``budget`` best slots (the recent window first, then by
    score, padding and free room last) moved to the front in slot order. Every shape is fixed by
    the buffers' capacity, so a decoding step is one capturable graph. Slots of padding (filler
    slots, tokens of rows that finished) score lowest, and ties are broken by slot order, so every
    KV head of a row evicts the same padding slots and slot validity stays per row."""

    SAVED_AS = "H2OLayer"  # the layer kind files record (docs/file-format.md)

    method: H2O
    next_position: torch.Tensor | None = hold(rows=True)  # [batch]: the position of each row's next token

    @property
    def slots(self) -> CappedSlots:
        return cast(CappedSlots, self.layer.slots)  # (make_layer gives its layer CappedSlots at its budget)

    @property
    def budget(self) -> int:
        """Tokens the layer keeps while decoding (its storage's cap)."""
        return self.slots.limit

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        # Computed once: it ranks the prompt and seeds the scores that eviction keeps adding to.
        full = average_over_groups(
            accumulated_attention(
                present(query)[0], self.layer.keys, self.layer.slot_validity(), scaling, self.method.block
            ),
            self.layer.keys.shape[1],
        )
        kept = self.keep_top(lambda: protect_recent(full, self.method.recent_tokens))
        self.slots.notes["slot_positions"] = super().kept_positions()
        self.slots.notes["slot_scores"] = full if kept is None else full.gather(2, kept)
        self.next_position = self.layer.held_prompt()[0].clone()

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if self.layer.phase.taking_prompt:
            return super().attend(query, keys, values, mask, scaling, softcap)
        keys, values = attended_pair(self.slots.codec, keys, values)  # its own weights, from decoded keys
        batch, q_heads, q_len, dim = query.shape
        kv_heads, slots = keys.shape[1], keys.shape[-2]
        logits = grouped_logits(query, keys, scaling).view(batch, kv_heads, -1, slots)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        seen, scores = present(mask, self.slots.notes["slot_scores"])  # a step's slots: capped, hence masked
        probs = logits.masked_fill(~group_mask(seen, q_heads // kv_heads), torch.finfo(torch.float32).min).softmax(
            dim=-1
        )
        received = average_over_groups(probs.view(batch, q_heads, q_len, slots).sum(dim=2), kv_heads)
        scores.add_(received)
        return (probs @ values.float()).view(batch, q_heads, q_len, dim).to(query.dtype)

    def after_step(self, query: torch.Tensor, scaling: float) -> None:
        """Record the new tokens' positions, then keep, per KV head, the ``budget`` best slots at the front."""
        slots, q_len = self.slots, query.shape[-2]
        scores, positions, next_position = present(
            slots.notes["slot_scores"], slots.notes["slot_positions"], self.next_position
        )
        note_step_positions(slots, next_position, positions, q_len)
        slot = torch.arange(slots.keys.shape[-2], device=slots.keys.device)
        cursor, valid = slots.stepping()
        end = cursor + q_len  # past this step's tokens
        recent = (slot >= end - self.method.recent_tokens) & (slot < end)
        score = scores.masked_fill(recent, math.inf).masked_fill(~valid[:, None, :], -math.inf)
        keep = score.sort(dim=-1, descending=True, stable=True).indices[..., : self.budget].sort(dim=-1).values
        front = slice(0, self.budget)
        for buffer in (slots.keys, slots.values):
            buffer[:, :, front].copy_(gather_tokens(buffer, keep))
        for kept in (scores, positions):
            kept[..., front].copy_(kept.gather(2, keep))
        valid[:, front].copy_(valid.gather(1, keep[:, 0]))
        valid[:, self.budget :] = False

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions still held per head, ascending; -1 for slots holding padding or generated tokens."""
        if self.slots.notes["slot_positions"] is None:
            return super().kept_positions()
        held = self.slots.notes["slot_positions"][..., : self.slots.used]
        return prompt_positions_held(held, self.layer.held_prompt()[0])
