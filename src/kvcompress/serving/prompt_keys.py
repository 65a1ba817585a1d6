"""A worker's cached prompt keys, read back from vLLM's paged cache once per layer for every question that follows.

A request whose prompt starts with prefix-cached blocks (a document asked many questions) is scored over its whole
prompt: the cached part's keys read back from the pool and joined to the keys its prefill computed. Read and joined
per question, that cost a later question over a 7,500-token document ~40 ms of its ~370 (in-process, SmolLM2, two
cores). Each layer holds the keys of the last such prefix it read, with room after them: the next question over the
same blocks writes its own keys into that room and is scored over a view, nothing read or copied. A second prompt of
the same step over the same blocks gets a copy (the room is the first one's). An entry is dropped when a write reaches
any of its blocks (a block freed from the prefix cache and handed to another request holds other tokens), and is at
most an eighth of its layer's pool (``POOL_SHARE``: past it a prefix is read and joined per question, as without it).
Imports no vLLM: the worker hands it the read-back."""

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


class PromptKeys:
    """Per layer, the keys of the last prefix-cache hit it scored over (``joined``), until a write reaches its blocks
    (``forget``: the worker tells it every write into the pool)."""

    def __init__(self) -> None:
        self.held: dict[str, HeldPrefix] = {}

    def joined(
        self,
        layer: str,
        blocks: tuple[int, ...],
        tokens: int,
        computed: torch.Tensor,
        read: Callable[[], torch.Tensor],
        taken: dict[tuple, torch.Tensor],
        pool_bytes: int,
    ) -> torch.Tensor:
        """A prompt's keys ``[kv_heads, head_size, tokens + n]``: the ``tokens`` its hit spared (through ``blocks``,
        read by ``read`` where not held) then ``computed [n, kv_heads, head_size]``. ``taken``: this step's and layer's
        prefixes a prompt already scores over (its room taken: a copy for the next; this call adds its own);
        ``pool_bytes``: the layer's pool."""
        needed = tokens + computed.shape[0]
        prefix = taken.get((blocks, tokens))
        if prefix is None:
            held = self.room(layer, blocks, tokens, needed, read, pool_bytes)
            if isinstance(held, HeldPrefix):  # its room lent to this prompt
                taken[blocks, tokens] = held.keys[..., :tokens]
                keys = held.keys[..., :needed]
                keys[..., tokens:] = computed.permute(1, 2, 0)
                return keys
            prefix = taken[blocks, tokens] = held
        keys = torch.empty(*prefix.shape[:2], needed, dtype=prefix.dtype)
        keys[..., :tokens] = prefix
        keys[..., tokens:] = computed.permute(1, 2, 0)
        return keys

    def room(
        self,
        layer: str,
        blocks: tuple[int, ...],
        tokens: int,
        needed: int,
        read: Callable[[], torch.Tensor],
        pool_bytes: int,
    ) -> HeldPrefix | torch.Tensor:
        """``layer``'s held prefix through ``blocks`` with room for ``needed`` tokens, held now where it was not (or
        with too little room); the prefix as read where it cannot be held."""
        held = self.held.get(layer)
        if held is not None and (held.blocks, held.tokens) == (blocks, tokens):
            if held.keys.shape[-1] >= needed:
                return held
            prefix = held.keys[..., :tokens]
        else:
            prefix = read()
        return self.hold(layer, blocks, tokens, prefix, needed, pool_bytes) or prefix

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
