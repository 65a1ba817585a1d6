"""Triton kernels for the GPU paths. Importing this module needs Triton (raises ImportError otherwise).

``gather_chunks_triton`` is ShadowKV's cache-aware value fetch (Sec. 4, Fig. 5): one program per
selected chunk copies it either from the previous step's device buffer (a hit) or from the store,
typically pinned host memory read across PCIe through a zero-copy view (a miss). The loads are
masked, so a hit never touches the store. With ``TRITON_INTERPRET=1`` it runs on CPU tensors,
which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_chunks_kernel(store, chunks, hit, slot, previous, out, n_chunks, k, CHUNK_NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * kv_heads + h
    j = tl.program_id(1).to(tl.int64)  # which selected chunk
    entry = row * k + j
    offsets = tl.arange(0, BLOCK)
    inside = offsets < CHUNK_NUMEL
    is_hit = (tl.load(hit + entry).to(tl.int32) + tl.zeros([BLOCK], tl.int32)) != 0  # a block, so it combines with masks
    source = (row * n_chunks + tl.load(chunks + entry).to(tl.int64)) * CHUNK_NUMEL
    reused = (row * k + tl.load(slot + entry).to(tl.int64)) * CHUNK_NUMEL
    fresh = tl.load(store + source + offsets, mask=inside & ~is_hit)
    kept = tl.load(previous + reused + offsets, mask=inside & is_hit)
    tl.store(out + entry * CHUNK_NUMEL + offsets, tl.where(is_hit, kept, fresh), mask=inside)


def gather_chunks_triton(
    store: torch.Tensor, chunks: torch.Tensor, hit: torch.Tensor, slot: torch.Tensor, previous: torch.Tensor | None
) -> torch.Tensor:
    """Same result as ``offload.reuse_previous(offload.fetch_chunks(store, chunks), hit, slot, previous)``.

    ``store [b, h, n_chunks, chunk, d]`` contiguous; ``chunks``/``hit``/``slot [b, h, k]``;
    ``previous [b, h, k * chunk, d]`` or None (no hits)."""
    batch, heads, n_chunks, chunk, dim = store.shape
    k = chunks.shape[-1]
    out = torch.empty(batch, heads, k * chunk, dim, dtype=store.dtype, device=chunks.device)
    if previous is None:
        hit, previous = torch.zeros_like(hit), out
    _gather_chunks_kernel[(batch * heads, k)](
        store,
        chunks.contiguous(),
        hit.contiguous(),
        slot.contiguous(),
        previous.contiguous(),
        out,
        n_chunks,
        k,
        CHUNK_NUMEL=chunk * dim,
        BLOCK=triton.next_power_of_2(chunk * dim),
    )
    return out
