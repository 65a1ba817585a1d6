"""Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Nothing is dropped. The prompt is cut into pages of ``page_size`` tokens; per page and KV head the
elementwise minimum and maximum of the keys are kept. At each decoding step, an upper bound of
``q . k`` over a page is ``sum_d max(q_d * min_d, q_d * max_d)``; pages are ranked by that bound
(max over the query heads of a KV group and over the step's queries), and attention runs exactly
over the top pages (``budget`` tokens) plus the last partial page and the recent tokens.
``offload=True`` keeps the paged keys and values in host memory and fetches only the selected pages
(the offloaded variant ShadowKV compares against), reporting bytes fetched per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cache.held import hold
from ..cache.layer import KVLayer
from ..cache.policy import present
from .fields import param
from .sparse import SparseDecodePolicy, SparseMethod

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def page_bounds(keys: torch.Tensor, valid: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of each page's real keys, ``[b, kv_heads, pages, d]`` each (a page
    without real keys gets zeros: it is never selectable anyway)."""
    batch, heads, seq, dim = keys.shape
    paged = keys.view(batch, heads, seq // page_size, page_size, dim)
    real = valid.view(batch, 1, seq // page_size, page_size, 1)
    low, high = paged.masked_fill(~real, math.inf).amin(dim=3), paged.masked_fill(~real, -math.inf).amax(dim=3)
    empty = ~real.any(dim=3)
    return low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)


def page_upper_bounds(query: torch.Tensor, low: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q . k`` over each page, max over query heads of a group and over queries ``[b, kv_heads,
    pages]``, from the pages' ``low`` and ``span = high - low``: ``sum_d max(q_d low_d, q_d high_d)`` is ``relu(q) .
    span + q . low``, two matrix products."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, pages = low.shape[1], low.shape[2]
    stacked = query.reshape(batch * kv_heads, -1, dim)
    bound = torch.baddbmm(
        stacked @ low.view(batch * kv_heads, pages, dim).mT,
        stacked.clamp(min=0),
        span.view(batch * kv_heads, pages, dim).mT,
    )
    return bound.view(batch, kv_heads, -1, pages).amax(dim=2)


@dataclass
class Quest(SparseMethod):
    """Query-aware page selection at every decoding step over the whole prompt."""

    name: ClassVar[str] = "quest"
    not_served: ClassVar[str | None] = (
        "it changes every decoding step's attention (page selection), not which tokens a request keeps"
    )
    unit_setting: ClassVar[tuple[str, str]] = ("page_size", "page")
    page_size: int = param(16, "tokens per page: the unit of selection", minimum=1)
    offload: bool = param(False, "keep the paged keys and values in host memory and fetch the selected pages")

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        return KVLayer(layer_idx, QuestPolicy(self, unit=self.page_size, offload=self.offload))


class QuestPolicy(SparseDecodePolicy):
    SAVED_AS = "QuestLayer"  # the layer kind files record (docs/file-format.md)

    method: Quest
    low: torch.Tensor | None = hold(rows=True, index=True)  # [b, h, pages, d]: each page's smallest key per dimension
    span: torch.Tensor | None = hold(rows=True, index=True)  # [b, h, pages, d]: its largest minus its smallest

    def region_chunks(self, lengths: torch.Tensor) -> torch.Tensor:
        return torch.div(lengths, self.unit, rounding_mode="floor")

    def prepare(self, keys: torch.Tensor, valid: torch.Tensor, chunks: torch.Tensor) -> None:
        self.low, high = page_bounds(keys, valid, self.unit)
        self.span = high - self.low

    def chunk_scores(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return page_upper_bounds(query, *present(self.low, self.span))
