"""Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Nothing is dropped. The prompt is cut into pages of ``page_size`` tokens; per page and KV head the
elementwise minimum and maximum of the keys are kept. At each decoding step, an upper bound of
``q . k`` over a page is ``sum_d max(q_d * min_d, q_d * max_d)``; pages are ranked by that bound
(max over the query heads of a KV group and over the step's queries), and attention runs exactly
over the top pages (``token_budget`` tokens) plus the last partial page and the recent tokens.
``offload=True`` keeps the paged keys and values in host memory and fetches only the selected pages
(the offloaded variant ShadowKV compares against), reporting bytes fetched per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cache import SelectiveLayer
from ..offload import chunk_tokens
from .base import Method, check_positive_int, require

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def page_bounds(keys: torch.Tensor, valid: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of each page's real keys, ``[b, kv_heads, pages, d]`` each."""
    batch, heads, seq, dim = keys.shape
    paged = keys.view(batch, heads, seq // page_size, page_size, dim)
    real = valid.view(batch, 1, seq // page_size, page_size, 1)
    return paged.masked_fill(~real, math.inf).amin(dim=3), paged.masked_fill(~real, -math.inf).amax(dim=3)


def page_upper_bounds(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q . k`` over each page, max over query heads of a group and over queries ``[b, kv_heads, pages]``."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = low.shape[1]
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads * q_len, 1, dim)
    bound = torch.maximum(q * low.float()[:, :, None], q * high.float()[:, :, None]).sum(dim=-1)
    return bound.nan_to_num(-math.inf).amax(dim=2)


@dataclass
class Quest(Method):
    """Query-aware page selection at every decoding step over the whole (kept) prompt."""

    name: ClassVar[str] = "quest"
    token_budget: int = 2048
    page_size: int = 16
    offload: bool = False

    def validate(self) -> None:
        check_positive_int("Quest", "page_size", self.page_size)
        check_positive_int("Quest", "token_budget", self.token_budget)
        require(
            self.token_budget >= self.page_size,
            f"Quest: token_budget={self.token_budget} is smaller than one page (page_size={self.page_size}); valid: token_budget >= {self.page_size}",
        )

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> QuestLayer:
        return QuestLayer(self, layer_idx, self.offload)


class QuestLayer(SelectiveLayer):
    method: Quest

    def region_length(self, seq: int) -> int:
        return seq // self.method.page_size * self.method.page_size

    def prepare(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        self.low, self.high = page_bounds(keys, valid, self.method.page_size)

    def select(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        bounds = page_upper_bounds(query, self.low, self.high)
        pages = min(self.low.shape[2], self.method.token_budget // self.method.page_size)
        chosen = bounds.topk(pages, dim=-1).indices.sort(dim=-1).values
        return chunk_tokens(chosen, self.method.page_size)

    def index_tensors(self) -> list[torch.Tensor]:
        return [self.low, self.high] if self.region_keys is not None else []
