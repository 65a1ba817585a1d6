"""A worker's cached prompt keys, read back from vLLM's paged cache once per layer for every question that follows.

A request whose prompt starts with prefix-cached blocks (a document asked many questions) is scored over its whole
prompt: the cached part's keys read back from the pool and joined to the keys its prefill computed. Read and joined
per question, that cost a later question over a 7,500-token document ~40 ms of its ~370 (in-process, SmolLM2, two
cores). Each layer holds the keys of the last such prefix it read, with room after them: each question over the same
blocks lays its own keys out in that room when it is scored (``scoring.PromptKeys``), one after another, nothing read
or copied. An entry is dropped when a write reaches any of its blocks (a block freed from the prefix cache and handed
to another request holds other tokens), and is at most an eighth of its layer's pool (``POOL_SHARE``: past it a
prefix is read once a step and joined per question, as without it). Imports no vLLM: the worker hands it the
read-back."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

ROOM = 64  # tokens of room after a held prefix: a question's own tokens, plus what a hit cut to whole blocks left
POOL_SHARE = 8  # a layer's held keys take at most this fraction of its pool's bytes (keys and values): 1 / POOL_SHARE


@dataclasses.dataclass
class HeldPrefix:
    """One layer's held prefix: the blocks and token count it was read through and its keys ``[kv_heads, head_size,
    tokens + room]`` (transposed as a scorer's product reads them)."""

    blocks: tuple[int, ...]
    tokens: int
    keys: torch.Tensor

    @functools.cached_property
    def ids(self) -> frozenset[int]:
        return frozenset(self.blocks)


class HeldPrefixes:
    """Per layer, the keys of the last prefix-cache hit it scored over (``prefix``), until a write reaches its blocks
    (``forget``: the worker tells it every write into the pool)."""

    def __init__(self) -> None:
        self.held: dict[str, HeldPrefix] = {}

    def prefix(
        self,
        layer: str,
        blocks: tuple[int, ...],
        tokens: int,
        read: Callable[[], torch.Tensor],
        reads: dict[tuple, torch.Tensor],
        pool_bytes: int,
    ) -> tuple[torch.Tensor, Callable[[int], torch.Tensor | None]]:
        """The keys ``[kv_heads, head_size, tokens]`` of the ``tokens`` a hit spared (through ``blocks``), held where
        they were, else read (``read``, once a step and layer: ``reads``) and held from now on; and the prompt's room:
        given its whole length, the held buffer's first that many tokens (the prefix, then room for its own), or None
        where the layer holds something else by then. ``pool_bytes``: the layer's pool."""
        held = self.held.get(layer)
        if held is not None and (held.blocks, held.tokens) == (blocks, tokens):
            prefix = held.keys[..., :tokens]
        else:
            if (blocks, tokens) not in reads:
                reads[blocks, tokens] = read()
            prefix = reads[blocks, tokens]
            self.hold(layer, blocks, tokens, prefix, tokens, pool_bytes)
        return prefix, functools.partial(self.room, layer, blocks, tokens, pool_bytes)

    def room(
        self, layer: str, blocks: tuple[int, ...], tokens: int, pool_bytes: int, needed: int
    ) -> torch.Tensor | None:
        """``layer``'s held buffer through ``blocks`` to ``needed`` tokens (more room made where it has too little);
        None where the layer holds another prefix, or none."""
        held = self.held.get(layer)
        if held is None or (held.blocks, held.tokens) != (blocks, tokens):
            return None
        if held.keys.shape[-1] < needed:
            grown = self.hold(layer, blocks, tokens, held.keys[..., :tokens], needed, pool_bytes)
            if grown is None:
                return None
            held = grown
        return held.keys[..., :needed]

    def hold(
        self, layer: str, blocks: tuple[int, ...], tokens: int, prefix: torch.Tensor, needed: int, pool_bytes: int
    ) -> HeldPrefix | None:
        """Hold ``prefix`` for ``layer`` with room for ``needed`` tokens (or ``ROOM`` past it), in place of what the
        layer held; None, holding nothing for the layer, where that would pass its share of the pool."""
        self.held.pop(layer, None)
        width = max(needed, tokens + ROOM)
        if prefix.shape[0] * prefix.shape[1] * width * prefix.element_size() * POOL_SHARE > pool_bytes:
            return None
        keys = torch.empty(*prefix.shape[:2], width, dtype=prefix.dtype)
        keys[..., :tokens] = prefix
        self.held[layer] = HeldPrefix(blocks, tokens, keys)
        return self.held[layer]

    def forget(self, layer: str, slots: torch.Tensor, block_size: int) -> None:
        """Drop ``layer``'s entry if a write to ``slots`` (its pool's slot ids) reaches any of its blocks."""
        held = self.held.get(layer)
        if held is not None and not held.ids.isdisjoint(slot // block_size for slot in slots.tolist()):
            del self.held[layer]  # (a step's few slots checked in Python: ~1 us, where a tensor op takes ~30)
