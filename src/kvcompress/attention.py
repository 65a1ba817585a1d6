"""Attention over cache slots: exact SDPA with GQA, and the grouped logits every scorer needs.

Query head ``h`` reads KV head ``h // (q_heads // kv_heads)`` (the usual GQA grouping), so a KV
head is never repeated in memory: the queries of a group are stacked instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_logits(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * q . k`` in float32, ``[b, q_heads, q, s]``, for ``query [b, q_heads, q, d]`` and
    ``keys [b, kv_heads, s, d]`` (any per-KV-head vectors: keys, chunk landmarks, projections)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, seq = keys.shape[1], keys.shape[2]
    stacked = query.float().reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)
    return (stacked @ keys.float().transpose(-1, -2)).view(batch, q_heads, q_len, seq) * scaling


def per_query_head(mask: torch.Tensor, q_heads: int) -> torch.Tensor:
    """A boolean mask ``[b, 1 | kv_heads | q_heads, q, s]`` broadcastable over query heads."""
    if 1 < mask.shape[1] < q_heads:
        return mask.repeat_interleave(q_heads // mask.shape[1], dim=1)
    return mask


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """Exact attention ``[b, q_heads, q, d]``. ``mask`` is boolean, ``[b, 1 | kv_heads | q_heads, q, s]``;
    None means causal over the last ``q`` slots (or no mask for one query). ``softcap`` (Gemma 2):
    logits become ``softcap * tanh(logits / softcap)`` before the softmax."""
    q_heads, kv_heads = query.shape[1], keys.shape[1]
    q_len, seq = query.shape[-2], keys.shape[-2]
    if mask is None and 1 < q_len and (q_len != seq or softcap is not None):
        mask = causal_slot_mask(q_len, seq, keys.device)
    if softcap is not None:
        logits = grouped_logits(query, keys, scaling)
        logits = softcap * torch.tanh(logits / softcap)
        if mask is not None:
            logits = logits.masked_fill(~per_query_head(mask, q_heads), torch.finfo(torch.float32).min)
        probs = logits.softmax(dim=-1)
        batch, _, q_len, seq = probs.shape
        out = probs.view(batch, kv_heads, -1, seq) @ values.float()
        return out.view(batch, q_heads, q_len, -1).to(query.dtype)
    return F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=None if mask is None else per_query_head(mask, q_heads),
        is_causal=mask is None and q_len > 1,  # only when queries and slots coincide (a prefill)
        scale=scaling,
        enable_gqa=q_heads != kv_heads,
    )


def causal_slot_mask(q_len: int, slots: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q_len, slots]``: the newest ``q_len`` slots are the queries, each sees itself and all before."""
    return torch.ones(q_len, slots, dtype=torch.bool, device=device).tril(slots - q_len)[None, None]


def attend_selected(
    query: torch.Tensor,
    selected: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention over per-head selected tokens (``keys, values, valid [b, h, n]``) followed by
    the layer's dense slots (``keys``/``values`` with their ``mask``; None = causal)."""
    chosen_keys, chosen_values, chosen_valid = selected
    q_len = query.shape[-2]
    if mask is None:
        mask = causal_slot_mask(q_len, keys.shape[-2], keys.device)
    dense = mask.expand(keys.shape[0], -1, -1, -1)
    if dense.shape[1] == 1:
        dense = dense.expand(-1, keys.shape[1], -1, -1)
    full_mask = torch.cat([chosen_valid[:, :, None, :].expand(-1, -1, q_len, -1), dense], dim=-1)
    return dense_attention(query, torch.cat([chosen_keys, keys], dim=2), torch.cat([chosen_values, values], dim=2), full_mask, scaling, softcap)
