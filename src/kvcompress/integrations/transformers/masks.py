"""A step's new tokens as transformers masks them (``ModelMasks``: the cache's ``steps.NewTokens``), and the
prompt attentions that read such a mask a block of queries at a time, so no ``prompt x prompt`` tensor is built.

transformers' mask covers logical positions; a compressed layer's slots no longer line up with them, so only the
mask's newest rows and columns are read: the new tokens' validity (its diagonal), and their mask among themselves
or over the prompt's keys while the prompt is whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch.nn.attention.bias import causal_lower_right

from ...cache.steps import Attend
from ...storage import attention
from . import longprompt
from .longprompt import LazyMask

Mask = torch.Tensor | LazyMask | None


@dataclass
class ModelMasks:
    """The ``q_len`` new tokens of a step under ``mask`` (transformers' 4-D mask, a ``LazyMask``, or None: causal)
    and the layer's ``sliding_window``; ``valid [b, q_len]``: which of them are real (None: all)."""

    mask: Mask
    q_len: int
    sliding_window: int | None
    valid: torch.Tensor | None = None

    @classmethod
    def of(cls, mask: Mask, q_len: int, sliding_window: int | None) -> ModelMasks:
        """A step's masks, its new tokens' validity read from ``mask``."""
        return cls(mask, q_len, sliding_window, new_token_validity(mask, q_len))

    def continuing(self, slot_valid: torch.Tensor) -> ModelMasks:
        """Masked by the slots' validity: causal by slot, padding masked (the new tokens' own validity kept)."""
        return replace(self, mask=longprompt.continued_mask(slot_valid, self.q_len))

    def causal(
        self,
        attend: Attend,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """A prefill's attention: the new queries are the newest of the prompt's keys so far (the whole prompt, or a
        block of it: ``longprompt.BlockedPrefill``). Plain causal attention is one call (SDPA's causal kernel, or its
        lower-right causal bias for a block on a GPU; on a CPU, which would build that bias as a mask, two flash calls
        merged: ``attention.after_prompt_with_lse``); otherwise blocks of queries, each with its block of the mask
        over the keys it can see."""
        q_len, kv_len = query.shape[-2], key.shape[-2]
        if self.mask is None and not self._cuts(kv_len) and softcap is None:
            if q_len == kv_len:
                return attend(query, key, value, None, scaling, softcap)
            if query.is_cuda:
                return attend(query, key, value, causal_lower_right(q_len, kv_len), scaling, softcap)
            # a CPU kernel would build that bias as a q x kv mask, and a masked call is slower:
            if query.device.type == "cpu":
                # the older keys unmasked, the block causal
                return attention.after_prompt_with_lse(query, key, value, scaling)[0]
        out = torch.empty_like(query)
        for (first, last), (start, end), mask in self._blocks(kv_len, key.shape[0], longprompt.BLOCK_ELEMENTS):
            out[:, :, first:last] = attend(
                query[:, :, first:last], key[:, :, start:end], value[:, :, start:end], mask, scaling, softcap
            )
        return out

    def causal_with_lse(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        softcap: float | None,
        unpadded: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new queries' attention (the newest of the keys) and each query's log-normaliser ``[b, q_heads, q]``.
        ``unpadded`` (nothing padded: an observation pass over a batch without padding) on a CPU, with no window
        that cuts the keys: two unmasked flash calls; otherwise a block of queries at a time, each with its mask as
        a float bias (a quarter of the booleans a prefill's block may build)."""
        kv_len = key.shape[-2]
        if unpadded and softcap is None and query.device.type == "cpu" and not self._cuts(kv_len):
            return attention.after_prompt_with_lse(query, key, value, scaling)
        out, lse = torch.empty_like(query), query.new_empty(query.shape[:-1], dtype=torch.float32)
        for (first, last), (start, end), mask in self._blocks(kv_len, key.shape[0], longprompt.BLOCK_ELEMENTS // 4):
            out[:, :, first:last], lse[:, :, first:last] = attention.attention_with_lse(
                query[:, :, first:last], key[:, :, start:end], value[:, :, start:end], mask, scaling, softcap
            )
        return out, lse

    def among_new(self) -> torch.Tensor | None:
        """Boolean mask ``[batch, 1, q_len, q_len]`` of the new queries against the new tokens, from the newest
        block of transformers' mask; None when that is plain causal."""
        if self.mask is None and (self.sliding_window is None or self.q_len <= self.sliding_window):
            return None
        return self._block(self.q_len, (0, self.q_len), (0, self.q_len))

    def _cuts(self, kv_len: int) -> bool:
        """The sliding window hides some of ``kv_len`` keys from some query."""
        return self.sliding_window is not None and kv_len > self.sliding_window

    def _blocks(
        self, kv_len: int, batch: int, elements: int
    ) -> Iterator[tuple[tuple[int, int], tuple[int, int], torch.Tensor]]:
        """Blocks of the new queries (the newest of ``kv_len`` keys), each with at most ``elements`` mask elements:
        its rows, the keys its queries can see, and its boolean mask over them."""
        q_len, window = self.q_len, self.sliding_window
        rows = max(1, elements // (batch * kv_len))
        for first in range(0, q_len, rows):
            last = min(q_len, first + rows)
            end = kv_len - q_len + last  # the keys up to the block's last query
            # older keys are out of every window
            start = max(0, kv_len - q_len + first - window + 1) if window is not None else 0
            yield (first, last), (start, end), self._block(kv_len, (first, last), (start, end))

    def _block(self, kv_len: int, rows: tuple[int, int], columns: tuple[int, int]) -> torch.Tensor:
        """Boolean mask ``[batch | 1, 1, rows, columns]``: rows ``rows`` of the new queries, which are the newest of
        ``kv_len`` keys, against keys ``columns`` (padding, causality, a sliding window), from transformers' mask
        (its newest rows and columns). Every query sees itself, so padding never gives NaNs."""
        (first, last), (start, end), q_len, mask = rows, columns, self.q_len, self.mask
        device = mask.device if mask is not None else None
        query_index = torch.arange(first, last, device=device)[:, None] + (kv_len - q_len)
        key_index = torch.arange(start, end, device=device)[None, :]
        if isinstance(mask, LazyMask):
            top, left = mask.q_length - q_len, mask.kv_length - kv_len
            block = mask.block(top + first, top + last, left + start, left + end)
        elif mask is not None:
            top, left = mask.shape[2] - q_len, mask.shape[3] - kv_len
            block = mask[:, :, top + first : top + last, left + start : left + end].bool()
        else:
            block = (key_index <= query_index)[None, None]
            if self.sliding_window is not None:
                block = block & (key_index > query_index - self.sliding_window)[None, None]
        return block | (key_index == query_index).to(block.device)[None, None]


def new_token_validity(mask: Mask, q_len: int) -> torch.Tensor | None:
    """``[batch, q_len]`` bool: which new tokens are real. A token sees itself unless it is padding,
    so this is the diagonal of the newest block of the boolean 4-D mask."""
    if mask is None:
        return None
    if isinstance(mask, LazyMask):
        return mask.diagonal(q_len)
    if q_len == 1:  # [b, 1, 1, kv]: the last element
        real = mask.view(-1, 1) if mask.shape[-1] == 1 else mask.flatten(1)[:, -1:]
    else:
        real = mask[:, 0, -q_len:, -q_len:].diagonal(dim1=-2, dim2=-1)
    return real if real.dtype == torch.bool else real.bool()
