"""What every KV-cache method is: a dataclass of hyperparameters that validates itself, scores
prompt positions at the end of prefill, and builds the cache that applies it.

Shapes used throughout: keys/values ``[batch, kv_heads, seq, head_dim]``, queries
``[batch, q_heads, seq, head_dim]``, scores ``[batch, kv_heads, seq]``, per-token validity
``[batch, seq]`` (False = padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache import CompressedLayer, KVCompressCache


class InvalidParameterError(ValueError):
    """A method was given a hyperparameter outside its valid range."""


def require(ok: bool, message: str) -> None:
    """Raise ``InvalidParameterError(message)`` unless ``ok``."""
    if not ok:
        raise InvalidParameterError(message)


def check_positive_int(method: str, name: str, value: object, minimum: int = 1) -> None:
    """Integers only (bools rejected), at least ``minimum``."""
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{method}: {name}={value!r} is invalid; it must be an integer >= {minimum}",
    )


def check_budget(method: str, budget: object, reserved_name: str, reserved: int, reserved_what: str) -> None:
    """``budget`` is a positive integer larger than the ``reserved`` tokens it always includes."""
    check_positive_int(method, "budget", budget)
    require(
        budget > reserved,
        f"{method}: budget={budget} must be greater than {reserved_name}={reserved} "
        f"(budget counts the {reserved_what}; valid: budget > {reserved})",
    )


@dataclass
class Method:
    """Base of all methods. Subclasses set ``name`` and override ``keep_counts`` / ``scores``."""

    name: ClassVar[str] = "method"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` naming the parameter, its value and the valid range."""

    def make_cache(self, model: PreTrainedModel) -> KVCompressCache:
        """A transformers ``Cache`` applying this method; also prepares ``model`` (see hooks.attach)."""
        from ..cache import KVCompressCache
        from ..hooks import attach

        attach(model)
        self.check_model(model)
        return KVCompressCache(self, model)

    def check_model(self, model: PreTrainedModel) -> None:
        """Raise ``InvalidParameterError`` where a hyperparameter does not fit ``model``."""

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> CompressedLayer:
        """The cache layer that stores and attends for ``layer_idx``."""
        from ..cache import CompressedLayer

        return CompressedLayer(self, layer_idx)

    def queries_needed(self) -> int | None:
        """How many of the last prefill queries ``scores`` reads (None: all of them)."""
        return 1

    def keep_counts(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """Tokens each row keeps after prefill, given each row's real prompt length ``[batch]``.

        ``None`` means "keep everything" (no compression)."""
        return None

    def scores(
        self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Importance of each prompt position per KV head ``[batch, kv_heads, seq]``; higher is kept.

        ``query`` holds the prefill queries (post-RoPE), ``keys`` the prompt keys, ``valid`` marks
        real (non-padding) tokens. Padding is excluded by the caller whatever is returned here."""
        raise NotImplementedError

    def describe(self) -> str:
        """Short human-readable form, e.g. ``snapkv(budget=256)``."""
        fields = ", ".join(f"{k}={v}" for k, v in vars(self).items() if v is not None)
        return f"{self.name}({fields})"


def budget_counts(lengths: torch.Tensor, budget: int | None, ratio: float | None, floor: int) -> torch.Tensor:
    """Per-row kept-token counts for a fixed ``budget`` or a ``ratio`` of each prompt.

    A row never keeps more than it has, and (with ``ratio``) never fewer than ``floor`` tokens."""
    if ratio is not None:
        wanted = torch.clamp(torch.ceil(lengths.double() * ratio).long(), min=floor)
    else:
        wanted = torch.full_like(lengths, budget)
    return torch.minimum(wanted, lengths)


def select_kept(scores: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick, per row and KV head, the ``counts[row]`` highest-scoring real positions.

    Returns ``(indices, slot_valid)``: ``indices [batch, kv_heads, n]`` with ``n = counts.max()``,
    ascending within each head, and ``slot_valid [batch, n]``. Rows that keep fewer than ``n``
    tokens get filler slots at the front (pointing at padding or dropped positions) that
    ``slot_valid`` marks False, so every head of a batch stores the same number of slots.
    """
    batch, heads, seq = scores.shape
    n = int(counts.max())
    masked = scores.float().masked_fill(~valid[:, None, :], -math.inf)
    order = masked.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(seq, device=scores.device).expand_as(order))
    chosen = rank < counts[:, None, None]
    positions = torch.arange(seq, device=scores.device)
    # Chosen positions sort after every filler candidate; among fillers the latest positions win.
    sort_key = torch.where(chosen, positions + seq, positions)
    picked = sort_key.topk(n, dim=-1).values.sort(dim=-1).values
    indices = torch.where(picked >= seq, picked - seq, picked)
    slot_valid = (picked >= seq)[:, 0, :]
    return indices, slot_valid
