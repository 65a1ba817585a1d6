"""vLLM's CPU paged KV cache as the plugin reads and attends it: the kernel's layout of a block found by its own write
(``paged_order``, ``paged_layout``), a request's cached keys read back a block at a time (``read_keys``) and values at
positions (``read_at``), and vLLM's kernel called over a compressed request's own blocks (``attend_kept``,
``scheduling``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl


@functools.lru_cache(maxsize=8)
def paged_order(kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """Where vLLM's CPU kernels keep each token's key and value inside a block (their layout is the ISA's own: keys
    transposed on some): for each element of a KV head's ``[block_size, head_size]`` keys then values, token-major,
    its offset in the head's stored ``2 * block_size * head_size`` elements, ``[kv_heads, 2 * block_size *
    head_size]``. Found by writing a block whose elements spell their own index one bit at a time (0 and 1 are exact
    in every dtype) with the kernel's own write, so no layout is assumed."""
    count = block_size * head_size
    index = torch.arange(count).view(block_size, 1, head_size).expand(block_size, kv_heads, head_size)
    stored = torch.zeros(kv_heads, 2 * count, dtype=torch.long)
    for bit in range((2 * count - 1).bit_length()):
        keys, values = (((part >> bit) & 1).to(dtype).contiguous() for part in (index, index + count))
        cache = torch.zeros(1, kv_heads, block_size * 2, head_size, dtype=dtype)
        ops.cpu_attn_reshape_and_cache(
            keys,
            values,
            *cache.chunk(2, dim=2),
            torch.arange(block_size),
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        stored |= (cache[0].reshape(kv_heads, 2 * count) != 0).long() << bit
    return stored.argsort(dim=1)


@functools.lru_cache(maxsize=8)
def paged_layout(
    kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str
) -> tuple[bool, ...] | None:
    """Whether the kernel keeps a block's keys, then its values, transposed (``[head_size, block_size]``) or token by
    token (``[block_size, head_size]``), read from ``paged_order``; None where it keeps them some other way."""
    order, count = paged_order(kv_heads, block_size, head_size, dtype, isa), block_size * head_size
    plain, transposed = torch.arange(count), torch.arange(count).view(head_size, block_size).T.reshape(-1)
    layout = []
    for part in (order[:, :count], order[:, count:] - count):
        if not (bool((part == plain).all()) or bool((part == transposed).all())):
            return None
        layout.append(bool((part == transposed).all()))
    return tuple(layout)


def read_keys(kv_cache: torch.Tensor, blocks: torch.Tensor, tokens: int, isa: str) -> torch.Tensor:
    """The keys of a request's first ``tokens`` positions in vLLM's CPU paged cache (``kv_cache [blocks, kv_heads,
    block_size, 2 * head_size]`` in the model's dtype), through ``blocks``, its block table row: the prompt a
    prefix-cache hit spared its prefill, transposed ``[kv_heads, head_size, tokens]`` as a scorer's product with its
    queries reads them. A layout ``paged_layout`` knows is read whole blocks at a time (one copy; where the kernel
    keeps keys transposed, in runs of a block's tokens); another element by element (``read_at``)."""
    _, kv_heads, block_size, width = kv_cache.shape
    used, head_size = -(-tokens // block_size), width // 2
    layout = paged_layout(kv_heads, block_size, head_size, kv_cache.dtype, isa)
    if layout is None:
        return read_at(kv_cache, blocks, torch.arange(tokens).expand(kv_heads, tokens), isa, 0).transpose(1, 2)
    stored = kv_cache.view(-1, kv_heads, 2, block_size * head_size)[blocks[:used].long(), :, 0]
    # [used, kv_heads, head_size, block_size] transposed, else [used, kv_heads, block_size, head_size]
    by_block = (
        stored.view(used, kv_heads, head_size, block_size).permute(1, 2, 0, 3)
        if layout[0]
        else stored.view(used, kv_heads, block_size, head_size).permute(1, 3, 0, 2)
    )
    return by_block.reshape(kv_heads, head_size, used * block_size)[..., :tokens]


def read_at(kv_cache: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor, isa: str, part: int) -> torch.Tensor:
    """The keys (``part`` 0) or values (1) at ``positions [kv_heads, n]`` (each head its own tokens) of a request's
    paged cache, ``[kv_heads, n, head_size]`` (a compressed prompt's kept values: read where they lie, not the whole
    prompt's): a token's row (or column) at a time in a layout ``paged_layout`` knows, else each element found
    through ``paged_order``'s offsets."""
    count_blocks, kv_heads, block_size, width = kv_cache.shape
    head_size = width // 2
    layout = paged_layout(kv_heads, block_size, head_size, kv_cache.dtype, isa)
    if layout is not None:
        stored = kv_cache.view(count_blocks, kv_heads, 2, block_size * head_size)[:, :, part]
        where, head = blocks.long()[positions // block_size], torch.arange(kv_heads)[:, None]
        if layout[part]:  # (transposed: a token's channels a column of its block)
            return stored.view(count_blocks, kv_heads, head_size, block_size)[where, head, :, positions % block_size]
        return stored.view(count_blocks, kv_heads, block_size, head_size)[where, head, positions % block_size]
    order = paged_order(kv_heads, block_size, head_size, kv_cache.dtype, isa)
    heads = torch.arange(kv_heads)[:, None, None]
    inside = (part * block_size + positions % block_size)[..., None] * head_size + torch.arange(head_size)
    stored = kv_cache.view(count_blocks, kv_heads, 2 * block_size * head_size)
    return stored[blocks.long()[positions // block_size][..., None], heads, order[heads, inside]]


def attend_kept(
    impl: CPUAttentionBackendImpl,
    layer: Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    blocks: torch.Tensor,
    kept: int,
    output: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Attention of a recomputed request's generated tokens (``query``, the last of its ``kept + n`` slots) over its
    compressed cache, causal, with vLLM's kernel (the model's ``dtype``), into ``output``: the prefill that recomputes
    a preempted request let them attend to the whole prompt, which its decoding steps never saw."""
    n = query.shape[0]
    starts, lengths = torch.tensor([0, n], dtype=torch.int32), torch.tensor([kept + n], dtype=torch.int32)
    key_cache, value_cache = kv_cache.view(*kv_cache.shape[:2], kv_cache.shape[2] * 2, -1).chunk(2, dim=2)
    schedule = scheduling(impl, layer, starts, lengths, True, dtype)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=starts,
        seq_lens=lengths,
        scale=impl.scale,
        causal=True,
        alibi_slopes=impl.alibi_slopes,
        sliding_window=impl.sliding_window,
        block_table=blocks[None],
        softcap=impl.logits_soft_cap,
        scheduler_metadata=schedule,
        s_aux=impl.sinks,
        dynamic_causal=None,
        k_scale=layer._k_scale_float,
        v_scale=layer._v_scale_float,
        kv_cache_dtype=impl.kv_cache_dtype,
    )


def scheduling(
    impl: CPUAttentionBackendImpl,
    layer: Any,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    causal: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """vLLM's CPU kernel's work split for requests of ``lengths`` tokens whose queries start at ``starts``, in the
    model's ``dtype``."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lengths.shape[0],
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size,
        seq_lens=lengths,
        dtype=dtype,
        query_start_loc=starts,
        causal=causal,
        sliding_window_size=impl.sliding_window,
        isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
