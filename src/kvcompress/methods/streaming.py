"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Applied here as prompt compression, like SnapKV: at the end of prefill each layer keeps the first
``sinks`` tokens (the attention sinks) and the most recent ``budget - sinks`` tokens; generated
tokens are appended afterwards. Kept tokens keep their original RoPE positions (the cache stores
post-RoPE keys), which matches how the SnapKV paper's baselines are run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache import prompt_positions
from .base import Method, budget_counts, check_budget, check_positive_int


def sink_and_recent_scores(valid: torch.Tensor, sinks: int, kv_heads: int) -> torch.Tensor:
    """Scores ``[batch, kv_heads, seq]`` that rank the first ``sinks`` real tokens highest, then
    every other token by recency."""
    position = prompt_positions(valid)
    scores = position.float().masked_fill(position < sinks, math.inf)
    return scores[:, None, :].expand(-1, kv_heads, -1)


@dataclass
class StreamingLLM(Method):
    """Keep ``sinks`` initial tokens plus the most recent ``budget - sinks`` prompt tokens."""

    name: ClassVar[str] = "streamingllm"
    budget: int = 1024
    sinks: int = 4

    def validate(self) -> None:
        check_positive_int("StreamingLLM", "sinks", self.sinks, minimum=0)
        check_budget("StreamingLLM", self.budget, "sinks", self.sinks, "sinks")

    def keep_counts(self, lengths: torch.Tensor) -> torch.Tensor:
        return budget_counts(lengths, self.budget, None, floor=self.sinks)

    def scores(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
        return sink_and_recent_scores(valid, self.sinks, keys.shape[1])
