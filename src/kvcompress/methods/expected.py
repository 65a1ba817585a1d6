"""Expected attention (Devoto, Jeblick and Jégou, 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution"; kvpress's ExpectedAttentionPress).

Questions to come are not known, but their queries are modelled from the prompt's: a Gaussian with
the mean and covariance of the prompt's queries before RoPE (each query head apart, leaving out the
first ``sinks`` positions), moved to where future queries will sit by the average RoPE rotation of
the next ``future`` positions. For a Gaussian query ``q ~ N(mu, S)`` the expected ``exp(s q.k)`` is
``exp(s mu.k + s^2 k'Sk / 2)``, so a key's expected attention is the softmax over the prompt of that
exponent (``covariance=False``: of ``s mu.k`` alone). It is averaged over the query heads of each KV
head and, with ``value_norm``, multiplied by the norm of the key's value (what the key would add to
the output). The first ``sinks`` tokens are always kept. The statistics come from the prefill's
queries: no pass beyond the prefill, one score per key.

Where it fails (docs/accuracy.md, question-agnostic track): a buried fact asked for after the
context is kept almost never (0.00-0.17 of the full cache's score at budgets 64-256, kvpress's
ExpectedAttentionPress alike), because the prompt's own queries, which the Gaussian is fitted to, do
not point at it: use KVzip for documents asked questions later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..cache.policy import ScoredLayer, present
from ..cache.tokens import span_max
from ..integrations.transformers.rope import apply_rope, invert_rope, rotary_for
from ..storage.tensors import prompt_positions
from .base import check_reserved, require_rope
from .bounded import HeldTokens
from .fields import param
from .prompt import PromptMethod

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache.layer import KVLayer
    from .bounded import BoundedPolicy


def query_statistics(
    query: torch.Tensor, real: torch.Tensor, covariance: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean ``[b, h, d]`` and (biased) covariance ``[b, h, d, d]`` in float32 of the queries
    ``[b, h, n, d]`` whose ``real [b, n]`` is True."""
    weight = real.float()[:, None, :, None]
    count = weight.sum(dim=2).clamp(min=1)
    mean = (query.float() * weight).sum(dim=2) / count
    if not covariance:
        return mean, None
    centred = (query.float() - mean[:, :, None]) * weight
    return mean, centred.transpose(-1, -2) @ centred / count[..., None]


def rotate_rows(matrix: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``matrix @ R'`` for the linear map ``R: x -> apply_rope(x, cos, sin)``: each row of ``matrix [..., d, d]``
    mapped by ``R``."""
    return apply_rope(matrix, cos[..., None, :], sin[..., None, :])


def future_statistics(
    mean: torch.Tensor, cov: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``R mean`` and ``R cov R'`` for ``R`` the average rotation of the future positions:
    ``cos``/``sin [b, future, rotary_dim]`` are averaged (a mean of rotations is the map with the
    mean coefficients)."""
    cos, sin = cos.float().mean(dim=1)[:, None], sin.float().mean(dim=1)[:, None]
    mean = apply_rope(mean, cos, sin)
    if cov is None:
        return mean, None
    return mean, rotate_rows(rotate_rows(cov, cos, sin).transpose(-1, -2), cos, sin).transpose(-1, -2)


def expected_attention_scores(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    mean: torch.Tensor,
    cov: torch.Tensor | None,
    scaling: float,
    sinks: int,
    value_norm: bool,
) -> torch.Tensor:
    """``[b, kv_heads, seq]``: each key's expected attention from queries ``N(mean, cov)`` (per query
    head ``[b, q_heads, d]``, ``[b, q_heads, d, d]``), the softmax over the real keys after the first
    ``sinks`` real tokens, averaged over each KV head's query heads, times the value norm; ``+inf`` on the sinks."""
    kv_heads = keys.shape[1]
    group = mean.shape[1] // kv_heads
    counted = valid & (prompt_positions(valid) >= sinks)
    scores = []
    for head in range(kv_heads):
        key = keys[:, head].float()
        heads = slice(head * group, (head + 1) * group)
        exponent = scaling * (mean[:, heads] @ key.transpose(-1, -2))
        if cov is not None:
            exponent = exponent + scaling**2 / 2 * ((key[:, None] @ cov[:, heads]) * key[:, None]).sum(dim=-1)
        attention = exponent.masked_fill(~counted[:, None], -math.inf).softmax(dim=-1).mean(dim=1)
        scores.append(attention * values[:, head].float().norm(dim=-1) if value_norm else attention)
    return torch.stack(scores, dim=1).masked_fill((~counted & valid)[:, None], math.inf)


@dataclass
class ExpectedAttention(PromptMethod):
    """Keep each KV head's ``budget`` prompt positions that future queries, modelled from the
    prompt's, are expected to attend to most (plus the first ``sinks``)."""

    name: ClassVar[str] = "expected"
    not_served: ClassVar[str | None] = None  # vLLM serves it (docs/vllm.md)
    future: int = param(512, "future positions whose average rotation moves the query statistics", minimum=1)
    sinks: int = param(4, "first prompt tokens always kept, and left out of the statistics", minimum=0)
    covariance: bool = param(True, "use the queries' covariance as well as their mean")
    value_norm: bool = param(True, "weight each key's expected attention by the norm of its value")
    clustering: str = param(
        "spans",
        "spans: each word or number scored by its best token, kept whole; none: per-token scores",
        choices=("spans", "none"),
    )

    def validate(self) -> None:
        super().validate()
        if self.ratio is None:
            check_reserved("ExpectedAttention", self.budget_tokens, "sinks", self.sinks, "sink tokens")

    def reserved_tokens(self) -> int:
        return self.sinks

    def queries_needed(self, asked: int | None = None) -> None:
        return None

    def needs_tokens(self) -> bool:
        return self.clustering == "spans"

    def needs_rotary(self) -> bool:
        return True

    def check_model(self, model: PreTrainedModel) -> None:
        require_rope(model, "ExpectedAttention")

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        layer = super().make_layer(layer_idx, model)
        layer.rotary = rotary_for(model, layer_idx)
        return layer

    def layer_scores(self, layer: ScoredLayer, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        (query,) = present(query)
        valid = layer.slot_validity()
        positions = prompt_positions(valid)  # the prompt's slots in order: every slot holds its own token
        asked = positions[:, -query.shape[-2] :]
        voting = (asked >= self.sinks) & valid[:, -query.shape[-2] :]
        held = HeldTokens(layer.keys, layer.values, valid, positions[:, None].expand(-1, layer.keys.shape[1], -1))
        # (the layer's prompt_tokens, not held_prompt: the vLLM worker's PromptLayer stands in for a layer here)
        scores = self._expected(layer.rotary, held, query, asked, voting, present(layer.prompt_tokens)[0], scaling)
        if self.clustering == "none":
            return scores
        if layer.spans is None:
            raise ValueError(
                "ExpectedAttention(clustering='spans') needs the prompt's token ids; the model was called with "
                "embeddings only: use clustering='none'"
            )
        return span_max(scores, layer.spans)

    def decode_scores(
        self, policy: BoundedPolicy, held: HeldTokens, query: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Under ``decode_budget``: the statistics of the last steps' queries (at their positions), moved ``future``
        positions past the next token, score every held token (per token: answer tokens have no recorded spans)."""
        asked = held.positions[:, 0, -query.shape[-2] :]
        (next_position,) = present(policy.next_position)
        return self._expected(policy.layer.rotary, held, query, asked, asked >= 0, next_position, scaling)

    def _expected(
        self,
        rotary: Any,
        held: HeldTokens,
        query: torch.Tensor,
        asked: torch.Tensor,
        voting: torch.Tensor,
        next_position: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """Scores of ``held``'s keys from ``query``'s statistics (queries at positions ``asked [b, n]``, those
        ``voting`` counted), moved to the ``future`` positions from ``next_position [b]`` on."""
        query = query.float()
        cos, sin = rotary.cos_sin(asked.clamp(min=0), query)
        unrotated = invert_rope(query, cos[:, None], sin[:, None])
        mean, cov = query_statistics(unrotated, voting, self.covariance)
        ahead = next_position[:, None] + torch.arange(self.future, device=query.device)[None, :]
        mean, cov = future_statistics(mean, cov, *rotary.cos_sin(ahead, mean))
        return expected_attention_scores(
            held.keys, held.values, held.valid, mean, cov, scaling, self.sinks, self.value_norm
        )
