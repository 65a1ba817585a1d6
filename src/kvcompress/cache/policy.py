"""The method's policy: what a method's layer overrides, with the defaults of an uncompressed layer.

Mixed into ``KVLayer`` (layer.py), whose ``__init__`` declares the state these methods read.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ..storage.tensors import nbytes


class OverlapProbe(NamedTuple):
    """Parts of a decoding step the speed benchmark times: a read from an offload store alone, the
    work the step overlaps with it alone, and both as the step runs them (``concurrent``: on a side stream)."""

    fetch: Callable[[], Any]
    work: Callable[[], Any]
    both: Callable[[], Any]
    concurrent: bool


class LayerPolicy:
    """The contract a method's layer overrides (docs/architecture.md, "The contract a method implements")."""

    def queries_needed(self) -> int | None:
        """The last prefill queries ``compress`` reads (None: all of them). Default: none."""
        return 0

    def compress(self, query: torch.Tensor, scaling: float) -> None:
        """After the prefill (the layer holds the whole prompt): keep or store what the method needs.
        ``query``: the prefill's post-RoPE queries ``[b, q_heads, seq, d]``. Default: keep everything."""

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Attention of ``query`` over this layer (``keys``/``values`` as ``update`` returned them)."""
        return self.slots.attend(query, keys, values, mask, scaling, softcap)

    def after_step(self, query: torch.Tensor, scaling: float) -> None:
        """After a later step's tokens are stored (e.g. evict while decoding). Default: nothing."""

    def observe(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, lse: torch.Tensor,
                context: torch.Tensor) -> None:
        """A step of the observation pass: ``query [b, q_heads, new, d]`` attended ``keys`` (the prompt's
        ``prefill_len`` slots, then the step's own), ``valid [b, prefill_len + new]``; ``lse [b, q_heads, new]``
        is each query's log-normaliser (a weight is ``exp(scaling q.k - lse)``); ``context [b, prefill_len]``
        marks the prompt slots the pass repeats (after each row's opening). Default: nothing."""

    def stats(self) -> dict[str, Any]:
        """This layer's counters (the storage's bytes, the method's index), summed over layers by the cache."""
        stats = {**self.slots.memory(self.full_tokens()), "offloaded_bytes": 0}
        recorded = self.intake.recorded[0] if self.intake.recorded is not None else None  # a stored context's queries
        stats["index_bytes"] += nbytes(*self.index_tensors(), recorded, self.spans)
        return stats

    def info(self) -> dict[str, Any]:
        """Facts about this layer shown in the cache's stats (kept when every layer agrees)."""
        return {}

    def uncapturable(self) -> str | None:
        """Why this layer's decoding step cannot be one compiled graph (None: it can)."""
        return None

    def fetch_overlap(self) -> OverlapProbe | None:
        """For layers that read an offload store while decoding: the parts to time. Default: None."""
        return None

    def full_tokens(self) -> int:
        """Tokens per KV head an uncompressed cache would hold for this layer."""
        return self.seen_tokens

    def index_tensors(self) -> list[torch.Tensor]:
        """Other device tensors the method keeps for this layer (scores, landmarks, factors, ...)."""
        return []

    def batch_tensors(self) -> list[str]:
        """The layer's attributes holding a batch dimension first (beam search reorders them, with the storage)."""
        return ["prompt_tokens", "spans"]

    def ragged_dims(self) -> dict[str, int]:
        """Batch tensors whose size along one dimension depends on the data (a factor's rank): groups
        are padded with zeros at its end before they are joined."""
        return {}
