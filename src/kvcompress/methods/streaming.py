"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Applied here as prompt compression, like SnapKV: at the end of prefill each layer keeps the first
``sinks`` tokens (the attention sinks) and the most recent ``budget - sinks`` tokens; generated
tokens are appended afterwards. Kept tokens keep their original RoPE positions (the cache stores
post-RoPE keys), which matches how the SnapKV paper's baselines are run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..storage.tensors import prompt_positions
from .base import check_reserved
from .bounded import HeldTokens
from .fields import param
from .prompt import PromptMethod

if TYPE_CHECKING:
    from .bounded import BoundedPolicy


def sink_and_recent_scores(valid: torch.Tensor, sinks: int, kv_heads: int) -> torch.Tensor:
    """Scores ``[batch, kv_heads, seq]`` that rank the first ``sinks`` real tokens highest, then
    every other token by recency."""
    position = prompt_positions(valid)
    scores = position.float().masked_fill(position < sinks, math.inf)
    return scores[:, None, :].expand(-1, kv_heads, -1)


@dataclass
class StreamingLLM(PromptMethod):
    """Keep ``sinks`` initial tokens plus the most recent ``budget - sinks`` prompt tokens."""

    name: ClassVar[str] = "streamingllm"
    not_served: ClassVar[str | None] = None  # vLLM serves it (docs/vllm.md)
    sinks: int = param(4, "attention-sink tokens kept at the start of the prompt", minimum=0)

    def validate(self) -> None:
        super().validate()
        if self.ratio is None:
            check_reserved("StreamingLLM", self.budget_tokens, "sinks", self.sinks, "sinks")

    def reserved_tokens(self) -> int:
        return self.sinks

    def scores(
        self,
        query: torch.Tensor | None,
        keys: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        spans: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return sink_and_recent_scores(valid, self.sinks, keys.shape[1])

    def decode_scores(
        self, policy: BoundedPolicy, held: HeldTokens, query: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """While decoding as on the prompt: the sinks, then the most recent held tokens."""
        return sink_and_recent_scores(held.valid, self.sinks, held.keys.shape[1])
