"""FullKV: the uncompressed baseline. Every prompt and generated token stays in the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..cache.layer import KVLayer
from .base import Method

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class FullKV(Method):
    """Keep the whole KV cache (the reference every method is compared against)."""

    name: ClassVar[str] = "full"
    not_served: ClassVar[str | None] = None  # vLLM serves it (docs/vllm.md)

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        return KVLayer(layer_idx)
