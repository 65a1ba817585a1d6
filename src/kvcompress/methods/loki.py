"""Loki (Singhania et al., 2024, "Loki: Low-Rank Keys for Efficient Sparse Attention").

Nothing is dropped. Keys are projected onto their top ``dim`` principal components (default: half
the head dimension); at each decoding step attention scores are approximated in that subspace,
``(q P)(K P)^T``, and exact attention runs over the top ``budget`` prompt tokens per KV head (max
over its query heads) plus the recent tokens.

Difference from the paper: Loki computes the principal components offline, once per model, on a
calibration set. Here they come from the prompt's own (post-RoPE) keys by default, per layer and
KV head (an uncentered SVD, so with ``dim = head_dim`` the scores are exact), or from a calibration
file: a tensor ``[layers, kv_heads, head_dim, head_dim]`` of components (columns by importance)
saved with ``torch.save``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cache.held import hold
from ..cache.layer import KVLayer
from ..cache.policy import present
from .base import model_head_dim
from .fields import InvalidParameterError, param
from .sparse import SparseDecodePolicy, SparseMethod

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def principal_components(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Right singular vectors of each KV head's real keys ``[b, kv_heads, d, d]`` (columns by importance)."""
    masked = keys.float() * valid[:, None, :, None]
    return torch.linalg.svd(masked, full_matrices=False).Vh.transpose(-1, -2)


def approximate_scores(query: torch.Tensor, projected_keys: torch.Tensor, components: torch.Tensor) -> torch.Tensor:
    """Approximate ``q . k`` in the component subspace, max over a group's query heads and queries ``[b, kv_heads,
    seq]`` (``projected_keys [b, kv_heads, seq, r]``, ``components [b, kv_heads, d, r]``)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, seq, rank = projected_keys.shape[1:]
    stacked = query.reshape(batch * kv_heads, -1, dim).to(components.dtype) @ components.reshape(
        batch * kv_heads, dim, rank
    )
    scores = stacked.to(projected_keys.dtype) @ projected_keys.view(batch * kv_heads, seq, rank).mT
    return scores.view(batch, kv_heads, -1, seq).amax(dim=2)


@functools.lru_cache(maxsize=4)
def load_calibration(path: str, layers: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The calibration components ``[layers, kv_heads, head_dim, head_dim]`` saved at ``path`` (read
    once per file and model shape: ``check_model`` reads it to check it, ``make_layer`` per layer)."""
    try:
        components = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same clear error
        raise InvalidParameterError(
            "Loki: {calibration=} could not be read as a saved tensor ({error})", calibration=path, error=error
        ) from None
    expected = (layers, kv_heads, head_dim, head_dim)
    if not isinstance(components, torch.Tensor) or tuple(components.shape) != expected:
        shape = tuple(components.shape) if isinstance(components, torch.Tensor) else type(components).__name__
        raise InvalidParameterError(
            "Loki: {calibration=} holds {shape}; expected a tensor of shape {expected} (layers, kv_heads, head_dim, "
            "head_dim)",
            calibration=path,
            shape=shape,
            expected=list(expected),
        )
    return components


@dataclass
class Loki(SparseMethod):
    """Low-rank approximate scores pick the tokens; attention over them is exact."""

    name: ClassVar[str] = "loki"
    not_served: ClassVar[str | None] = (
        "it changes every decoding step's attention (low-rank scores), not which tokens a request keeps"
    )
    dim: int | None = param(None, "principal components used for scoring (default half the head dimension)", minimum=1)
    recent: int = param(32, "recent tokens kept dense, never selected", minimum=0)
    calibration: str | None = param(
        None, "file of precomputed components [layers, kv_heads, head_dim, head_dim] (default: from the prompt)"
    )

    def validate(self) -> None:
        super().validate()
        if self.calibration is not None and not Path(self.calibration).is_file():
            raise InvalidParameterError(
                "Loki: {calibration=} is not a file; give a tensor saved with torch.save", calibration=self.calibration
            )

    def check_model(self, model: PreTrainedModel) -> None:
        head_dim = model_head_dim(model)
        if self.dim is not None and self.dim > head_dim:
            raise InvalidParameterError(
                "Loki: {dim=} exceeds head_dim={head_dim}; valid: 1 to {head_dim}", dim=self.dim, head_dim=head_dim
            )
        self.calibrated(model)

    def calibrated(self, model: PreTrainedModel) -> torch.Tensor | None:
        """The calibration file's components for ``model`` (None without a file)."""
        if self.calibration is None:
            return None
        config = model.config.get_text_config()
        return load_calibration(
            self.calibration, config.num_hidden_layers, config.num_key_value_heads, model_head_dim(model)
        )

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        components = self.calibrated(model)
        return KVLayer(layer_idx, LokiPolicy(self, None if components is None else components[layer_idx]))


class LokiPolicy(SparseDecodePolicy):
    SAVED_AS = "LokiLayer"  # the layer kind files record (docs/file-format.md)

    method: Loki
    calibrated: torch.Tensor | None = hold(saved=False)  # [h, d, d]: from a calibration file (None: per prompt)
    components: torch.Tensor | None = hold(rows=True, index=True)  # [b, h, d, dim]: the keys' top principal components
    projected: torch.Tensor | None = hold(rows=True, index=True)  # [b, h, n, dim]: the region's keys projected on them

    def __init__(self, method: Loki, calibrated: torch.Tensor | None) -> None:
        super().__init__(method, unit=1, offload=False)
        self.calibrated = calibrated

    def region_chunks(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths - self.method.recent

    def prepare(self, keys: torch.Tensor, valid: torch.Tensor, chunks: torch.Tensor) -> None:
        if self.calibrated is not None:
            components = self.calibrated.to(keys.device, torch.float32)[None].expand(keys.shape[0], -1, -1, -1)
        else:
            components = principal_components(keys, valid)
        dim = self.method.dim or keys.shape[-1] // 2
        self.components = components[..., :dim].contiguous()
        self.projected = (keys.float() @ self.components).to(keys.dtype)

    def chunk_scores(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return approximate_scores(query, *present(self.projected, self.components))
