"""Loki (Singhania et al., 2024, "Loki: Low-Rank Keys for Efficient Sparse Attention").

Nothing is dropped. Keys are projected onto their top ``dim`` principal components (default: half
the head dimension); at each
decoding step attention scores are approximated in that subspace, ``(q P)(K P)^T``, and exact
attention runs over the top ``token_budget`` prompt tokens per KV head (max over its query heads)
plus the recent tokens.

Difference from the paper: Loki computes the principal components offline, once per model, on a
calibration set. Here they come from the prompt's own (post-RoPE) keys by default, per layer and
KV head (an uncentered SVD, so with ``dim = head_dim`` the scores are exact), or from a calibration
file: a tensor ``[layers, kv_heads, head_dim, head_dim]`` of components (columns by importance)
saved with ``torch.save``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cache import SelectiveLayer
from .base import InvalidParameterError, Method, check_positive_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def principal_components(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Right singular vectors of each KV head's real keys ``[b, kv_heads, d, d]`` (columns by importance)."""
    masked = keys.float() * valid[:, None, :, None]
    return torch.linalg.svd(masked, full_matrices=False).Vh.transpose(-1, -2)


def approximate_scores(query: torch.Tensor, projected_keys: torch.Tensor, components: torch.Tensor) -> torch.Tensor:
    """Approximate ``q . k`` in the component subspace, max over a group's query heads and queries ``[b, kv_heads, seq]``."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, rank = projected_keys.shape[1], projected_keys.shape[-1]
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads * q_len, dim) @ components[..., :rank]
    return (q @ projected_keys.float().transpose(-1, -2)).amax(dim=2)


@dataclass
class Loki(Method):
    """Low-rank approximate scores pick the tokens; attention over them is exact."""

    name: ClassVar[str] = "loki"
    token_budget: int = 2048
    dim: int | None = None  # default: half the head dimension
    recent: int = 32
    calibration: str | None = None

    def validate(self) -> None:
        check_positive_int("Loki", "token_budget", self.token_budget)
        if self.dim is not None:
            check_positive_int("Loki", "dim", self.dim)
        check_positive_int("Loki", "recent", self.recent, minimum=0)

    def check_model(self, model: PreTrainedModel) -> None:
        config = model.config.get_text_config()
        head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        if self.dim is not None and self.dim > head_dim:
            raise InvalidParameterError(f"Loki: dim={self.dim} exceeds head_dim={head_dim}; valid: 1 to {head_dim}")

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> LokiLayer:
        components = None
        if self.calibration is not None:
            components = torch.load(self.calibration, map_location="cpu")[layer_idx]
        return LokiLayer(self, layer_idx, components)


class LokiLayer(SelectiveLayer):
    method: Loki

    def __init__(self, method: Loki, layer_idx: int, components: torch.Tensor | None) -> None:
        super().__init__(method, layer_idx)
        self.calibrated = components

    def region_length(self, seq: int) -> int:
        return max(0, seq - self.method.recent)

    def prepare(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        if self.calibrated is not None:
            components = self.calibrated.to(keys.device, torch.float32)[None].expand(keys.shape[0], -1, -1, -1)
        else:
            components = principal_components(keys, valid)
        dim = self.method.dim or keys.shape[-1] // 2
        self.components = components[..., :dim].contiguous()
        self.projected = (keys.float() @ self.components).to(keys.dtype)

    def select(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        scores = approximate_scores(query, self.projected, self.components)
        scores = scores.masked_fill(~self.region_valid[:, None, :], -torch.inf)
        count = min(self.projected.shape[2], self.method.token_budget)
        return scores.topk(count, dim=-1).indices.sort(dim=-1).values

    def index_tensors(self) -> list[torch.Tensor]:
        return [self.components, self.projected] if self.region_keys is not None else []
