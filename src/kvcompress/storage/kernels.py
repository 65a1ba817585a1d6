"""Triton kernels of the sparse decoding step (``ops.py`` dispatches to them on a GPU). Importing this
module needs Triton (raises ImportError otherwise). With ``TRITON_INTERPRET=1`` they run on CPU
tensors, which is how the tests check them on machines without a GPU.

* ``gather_chunks_triton``: the selected chunks of an offload store, one program per chunk. A chunk
  the previous step also selected is found there (a binary search over its ascending chunk ids) and
  copied from its buffer instead (ShadowKV's cache-aware fetch, Sec. 4 / Fig. 5); the loads are
  masked, so a hit never touches the store, which is typically pinned host memory read across PCIe
  through a zero-copy view. Hits are counted on the device.
* ``rotated_keys_triton``: ShadowKV's keys of the selected chunks, ``A @ B`` rebuilt from the low-rank
  factors and rotated at their positions, one program per chunk: the two products (``B`` and its
  rotate-half) and RoPE in one pass, nothing written but the keys. The angle is the model's
  (``position * inv_freq`` in float32), reduced to one turn in float64 before its cosine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_chunks_kernel(store, chunks, previous_chunks, previous, hits, out, n_chunks, k, REUSE: tl.constexpr,
                          LOG_K: tl.constexpr, CHUNK_NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * kv_heads + h
    j = tl.program_id(1).to(tl.int64)  # which selected chunk
    entry = row * k + j
    chunk = tl.load(chunks + entry).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < CHUNK_NUMEL
    hit = chunk < 0  # False, as a tensor
    slot = j
    if REUSE:  # binary search of the chunk in last step's ascending ids
        low = tl.zeros((), tl.int64)
        high = low + k
        for _ in tl.static_range(LOG_K):
            middle = (low + high) // 2
            below = tl.load(previous_chunks + row * k + tl.minimum(middle, k - 1)).to(tl.int64) < chunk
            low = tl.where(below & (middle < high), middle + 1, low)
            high = tl.where(below | (middle >= high), high, middle)
        slot = tl.minimum(low, k - 1)
        hit = tl.load(previous_chunks + row * k + slot).to(tl.int64) == chunk
        tl.atomic_add(hits, hit.to(tl.int64))
    is_hit = (hit.to(tl.int32) + tl.zeros([BLOCK], tl.int32)) != 0  # a block, so it combines with masks
    fresh = tl.load(store + (row * n_chunks + chunk) * CHUNK_NUMEL + offsets, mask=inside & ~is_hit)
    kept = tl.load(previous + (row * k + slot) * CHUNK_NUMEL + offsets, mask=inside & is_hit)
    tl.store(out + entry * CHUNK_NUMEL + offsets, tl.where(is_hit, kept, fresh), mask=inside)


def gather_chunks_triton(store: torch.Tensor, chunks: torch.Tensor, previous_chunks: torch.Tensor | None,
                         previous: torch.Tensor | None, hits: torch.Tensor | None) -> torch.Tensor:
    """Same result as ``ops.gather_chunks`` (``store [b, h, n_chunks, chunk, d]`` contiguous)."""
    batch, heads, n_chunks, chunk, dim = store.shape
    k = chunks.shape[-1]
    out = torch.empty(batch, heads, k * chunk, dim, dtype=store.dtype, device=chunks.device)
    reuse = previous is not None
    _gather_chunks_kernel[(batch * heads, k)](
        store,
        chunks.contiguous(),
        previous_chunks.contiguous() if reuse else chunks,
        previous.contiguous() if reuse else out,
        hits if reuse else chunks,
        out,
        n_chunks,
        k,
        REUSE=reuse,
        LOG_K=max(1, int(k).bit_length()),
        CHUNK_NUMEL=chunk * dim,
        BLOCK=triton.next_power_of_2(chunk * dim),
    )
    return out


@triton.jit
def _rotated_keys_kernel(
    factor_a, factor_b, chunks, inv_freq, out, heads, region, k, scale, RANK: tl.constexpr, UNIT: tl.constexpr,
    DIM: tl.constexpr, HALF_ROT: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # b * kv_heads + h
    j = tl.program_id(1).to(tl.int64)
    batch, head = row // heads, row % heads
    chunk = tl.load(chunks + row * k + j).to(tl.int64)
    t = tl.arange(0, BLOCK_U)
    tokens = chunk * UNIT + t  # a region token's index is its position in the prompt
    real = t < UNIT
    d = tl.arange(0, BLOCK_D)
    rotated = d < 2 * HALF_ROT
    # rotate_half on the rotated dims: the first half takes minus the second, the second the first
    partner = tl.where(d < HALF_ROT, d + HALF_ROT, d - HALF_ROT)
    partner = tl.where(rotated, partner, d)
    sign = tl.where(d < HALF_ROT, -1.0, 1.0)
    plain = tl.zeros([BLOCK_U, BLOCK_D], tl.float32)
    turned = tl.zeros([BLOCK_U, BLOCK_D], tl.float32)
    # the rank is a compile-time constant: Triton 3.6's interpreter cannot bound a loop by an argument
    for r0 in range(0, RANK, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        a = tl.load(factor_a + (batch * region + tokens[:, None]) * RANK + r[None, :],
                    mask=real[:, None] & (r[None, :] < RANK), other=0.0)
        b_row = factor_b + ((batch * RANK + r[:, None]) * heads + head) * DIM  # B is [b, r, heads, d]
        b = tl.load(b_row + d[None, :], mask=(r[:, None] < RANK) & (d[None, :] < DIM), other=0.0)
        b_turned = tl.load(b_row + partner[None, :], mask=(r[:, None] < RANK) & (d[None, :] < DIM),
                           other=0.0) * sign[None, :]
        plain += tl.dot(a.to(tl.float32), b.to(tl.float32))
        turned += tl.dot(a.to(tl.float32), b_turned.to(tl.float32))
    freq = tl.load(inv_freq + d % HALF_ROT, mask=rotated, other=0.0)
    # the model's float32 angle, as its rotary computes it
    angle = (tokens[:, None].to(tl.float32) * freq[None, :]).to(tl.float64)
    # reduced to [-pi, pi] in float64: exact cos/sin at any position
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    angle = (angle - turns * 6.283185307179586).to(tl.float32)
    cos = tl.where(rotated[None, :], tl.cos(angle) * scale, 1.0)
    sin = tl.where(rotated[None, :], tl.sin(angle) * scale, 0.0)
    keys = plain * cos + turned * sin
    target = out + ((row * k + j) * UNIT + t[:, None]) * DIM + d[None, :]
    tl.store(target, keys.to(out.dtype.element_ty), mask=real[:, None] & (d[None, :] < DIM))


def rotated_keys_triton(factor_a: torch.Tensor, factor_b: torch.Tensor, chunks: torch.Tensor, inv_freq: torch.Tensor,
                        scale: float, unit: int) -> torch.Tensor:
    """Same result as ``ops.rotated_keys`` (``factor_a [b, region, r]``, ``factor_b [b, r, heads, d]``)."""
    batch, region, rank = factor_a.shape
    heads, dim = factor_b.shape[2], factor_b.shape[3]
    k = chunks.shape[-1]
    out = torch.empty(batch, heads, k * unit, dim, dtype=factor_a.dtype, device=chunks.device)
    _rotated_keys_kernel[(batch * heads, k)](
        factor_a.contiguous(),
        factor_b.contiguous(),
        chunks.contiguous(),
        inv_freq.float().contiguous(),
        out,
        heads,
        region,
        k,
        float(scale),
        RANK=rank,
        UNIT=unit,
        DIM=dim,
        HALF_ROT=inv_freq.shape[0],
        BLOCK_U=max(16, triton.next_power_of_2(unit)),
        BLOCK_R=16,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )
    return out
