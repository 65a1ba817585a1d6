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
* ``decode_attention_triton``: one decoding query per head over a long cache, split along the slots
  (flash-decoding: SDPA's fused kernels give a head's whole cache to one program, 8 programs for the 8B
  shape's 8 KV heads at batch 1, a tenth of an H100's bandwidth at 32K: docs/gpu-runs/2026-11-27-h100).
  Each program reads one KV head's slice of slots, its GQA group's queries stacked as rows, and keeps
  an online softmax; a second pass weighs the slices by their log-normalisers. Slots coded in 8 or 4
  bits (``codec.IntCodec``) are decoded in registers as they are read: the codes, not a decoded copy,
  are what crosses memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import group_size


@triton.jit
def _gather_chunks_kernel(
    store,
    chunks,
    previous_chunks,
    previous,
    hits,
    out,
    n_chunks,
    k,
    REUSE: tl.constexpr,
    LOG_K: tl.constexpr,
    CHUNK_NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
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


def gather_chunks_triton(
    store: torch.Tensor,
    chunks: torch.Tensor,
    previous_chunks: torch.Tensor | None,
    previous: torch.Tensor | None,
    hits: torch.Tensor | None,
) -> torch.Tensor:
    """Same result as ``ops.gather_chunks`` (``store [b, h, n_chunks, chunk, d]`` contiguous)."""
    batch, heads, n_chunks, chunk, dim = store.shape
    k = chunks.shape[-1]
    out = torch.empty(batch, heads, k * chunk, dim, dtype=store.dtype, device=chunks.device)
    if previous is not None and previous_chunks is not None and hits is not None:  # all three, or none
        reuse, reused = True, (previous_chunks.contiguous(), previous.contiguous(), hits)
    else:  # any pointers: the kernel reads them only with REUSE
        reuse, reused = False, (chunks, out, chunks)
    _gather_chunks_kernel[(batch * heads, k)](
        store,
        chunks.contiguous(),
        *reused,
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
def _product(a, b, PRECISE: tl.constexpr):
    """``tl.dot``; with ``PRECISE`` (float32 operands of a float32 model) in IEEE float32, not the TF32 NVIDIA GPUs
    default to, whose 10-bit products moved ShadowKV's rebuilt keys by ~1e-3 against the CPU (11-26/27 GPU runs).
    16-bit operands are exact in TF32."""
    # one return, after the branches: Triton's compiler (unlike its interpreter) goes on past an early return
    if PRECISE:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _rotated_keys_kernel(
    factor_a,
    factor_b,
    chunks,
    inv_freq,
    out,
    heads,
    region,
    k,
    scale,
    RANK: tl.constexpr,
    UNIT: tl.constexpr,
    DIM: tl.constexpr,
    HALF_ROT: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISE: tl.constexpr,
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
        a = tl.load(
            factor_a + (batch * region + tokens[:, None]) * RANK + r[None, :],
            mask=real[:, None] & (r[None, :] < RANK),
            other=0.0,
        )
        b_row = factor_b + ((batch * RANK + r[:, None]) * heads + head) * DIM  # B is [b, r, heads, d]
        b = tl.load(b_row + d[None, :], mask=(r[:, None] < RANK) & (d[None, :] < DIM), other=0.0)
        b_turned = (
            tl.load(b_row + partner[None, :], mask=(r[:, None] < RANK) & (d[None, :] < DIM), other=0.0) * sign[None, :]
        )
        plain += _product(a.to(tl.float32), b.to(tl.float32), PRECISE)
        turned += _product(a.to(tl.float32), b_turned.to(tl.float32), PRECISE)
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


def rotated_keys_triton(
    factor_a: torch.Tensor,
    factor_b: torch.Tensor,
    chunks: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    unit: int,
) -> torch.Tensor:
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
        PRECISE=factor_a.dtype == torch.float32,
    )
    return out


@triton.jit
def _stored_rows(
    rows,
    meta,
    offset,
    slots,
    inside,
    d,
    DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``[BLOCK, DIM]`` vectors of ``slots`` from a row-per-slot buffer at ``offset`` (its elements): as
    stored (``BITS`` 0), or ``codec.IntCodec`` rows decoded (codes, then each group's float16 scale and
    minimum, read through ``meta``, the same bytes as float16). One return after the branches: the compiler (not
    the interpreter) would type the coded branch's integer arithmetic on the stored floats too (H200, 11-28)."""
    if BITS == 0:
        vectors = tl.load(rows + offset + slots[:, None] + d[None, :], mask=inside[:, None], other=0.0)
    else:
        vectors = _decoded_rows(rows, meta, offset, slots, inside, d, DIM, BITS, GROUP, DTYPE, BLOCK)
    return vectors


@triton.jit
def _decoded_rows(
    rows,
    meta,
    offset,
    slots,
    inside,
    d,
    DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``_stored_rows`` of coded rows (``BITS`` 8, 6 or 4). Each row's bytes and each group's scale and minimum are
    loaded once, as runs of neighbouring elements, and spread over the channels in registers (``tl.join``,
    ``tl.reshape``): indexing every channel's byte and scale made ~390 scalar loads per block of slots in the
    sm_90 build against 48 wide ones at 16 bits, and the 4-bit step 6.6x slower than the 16-bit one (H200, 11-28)."""
    row = rows + offset + slots[:, None]
    if BITS == 8:
        codes = tl.load(row + d[None, :], mask=inside[:, None], other=0)
    else:  # 4 bits, or 6 bits' low 4: two a byte, channel 2i in the low nibble
        packed = tl.load(row + tl.arange(0, DIM // 2)[None, :], mask=inside[:, None], other=0)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK, DIM])
    if BITS == 6:  # then each code's top 2 bits, as codec.Int6Codec places them: a group's even channels, then its
        # odd ones, each byte holding four places a quarter of the group apart (bits 0-1 the first quarter's, ...)
        tops = tl.load(row + DIM // 2 + tl.arange(0, DIM // 4)[None, :], mask=inside[:, None], other=0)
        tops = tl.reshape(tops, [BLOCK, DIM // GROUP, GROUP // 4])
        # a group's even channels' tops in order (its first two quarters' places), then its odd ones'
        evens = tl.reshape(
            tl.permute(tl.join(tops & 3, (tops >> 2) & 3), (0, 1, 3, 2)), [BLOCK, DIM // GROUP, GROUP // 2]
        )
        odds = tl.reshape(
            tl.permute(tl.join((tops >> 4) & 3, tops >> 6), (0, 1, 3, 2)), [BLOCK, DIM // GROUP, GROUP // 2]
        )
        codes = codes | (tl.reshape(tl.join(evens, odds), [BLOCK, DIM]) << 4)
    first = (offset + slots) // 2 + DIM * BITS // 16  # the row's scales, as float16 elements
    group = tl.arange(0, DIM // GROUP)
    scale = tl.load(meta + first[:, None] + group[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
    low = tl.load(meta + first[:, None] + DIM // GROUP + group[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
    grouped = tl.reshape(codes.to(tl.float32), [BLOCK, DIM // GROUP, GROUP])
    return tl.reshape(grouped * scale[:, :, None] + low[:, :, None], [BLOCK, DIM]).to(DTYPE)


# a Triton kernel's 35 parameters packed, as its launch passes them
# fmt: off
@triton.jit
def _decode_attention_kernel(
    query, keys, key_meta, values, value_meta, visible, out, lse, heads, seq, scaling,
    q_batch, q_head, k_batch, k_head, k_slot, v_batch, v_head, v_slot, m_batch, m_head,
    GROUP_ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, QUANT_GROUP: tl.constexpr,
    MASKED: tl.constexpr, PRECISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * kv_heads + h
    split = tl.program_id(1).to(tl.int64)
    splits = tl.num_programs(1).to(tl.int64)
    batch, head = row // heads, row % heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, DIM)
    q = tl.load(query + batch * q_batch + head * q_head + g[:, None] * DIM + d[None, :], mask=g[:, None] < GROUP_ROWS,
                other=0.0)
    dtype = q.dtype
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, DIM], tl.float32)
    # the loop's bound is a compile-time constant (BLOCKS per slice): Triton's interpreter needs one
    for block in range(BLOCKS):
        n = (split * BLOCKS + block) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = n < seq
        if MASKED:
            inside = inside & (tl.load(visible + batch * m_batch + head * m_head + n, mask=inside, other=0) != 0)
        k = _stored_rows(keys, key_meta, batch * k_batch + head * k_head, n * k_slot, inside, d, DIM, KEY_BITS,
                         QUANT_GROUP, dtype, BLOCK_N)
        logits = _product(q, tl.trans(k), PRECISE) * scaling
        logits = tl.where(inside[None, :], logits, float("-inf"))
        newest = tl.maximum(best, tl.max(logits, axis=1))
        shift = tl.where(newest == float("-inf"), 0.0, newest)  # no slot seen yet: nothing to rescale
        weights = tl.exp(logits - shift[:, None])
        rescale = tl.exp(best - shift)
        total = total * rescale + tl.sum(weights, axis=1)
        v = _stored_rows(values, value_meta, batch * v_batch + head * v_head, n * v_slot, inside, d, DIM,
                         VALUE_BITS, QUANT_GROUP, dtype, BLOCK_N)
        acc = acc * rescale[:, None] + _product(weights.to(dtype), v, PRECISE)
        best = newest
    seen = total > 0
    part = (row * splits + split) * BLOCK_G + g
    tl.store(out + part[:, None] * DIM + d[None, :], acc / tl.where(seen, total, 1.0)[:, None],
             mask=g[:, None] < GROUP_ROWS)
    tl.store(lse + part, tl.where(seen, best + tl.log(tl.where(seen, total, 1.0)), float("-inf")),
             mask=g < GROUP_ROWS)
# fmt: on


TARGET_PROGRAMS = 264  # two per streaming multiprocessor of an H100 (132)


def decode_split(rows: int, seq: int, block: int) -> tuple[int, int]:
    """(slices, blocks per slice) for ``rows`` KV heads over ``seq`` slots: about ``TARGET_PROGRAMS``
    programs in all; blocks per slice a power of two, so a cache growing token by token compiles the
    kernel a few times (one per doubling), not once per length."""
    blocks = triton.cdiv(seq, block)
    per_slice = triton.next_power_of_2(max(1, triton.cdiv(blocks * rows, TARGET_PROGRAMS)))
    return triton.cdiv(blocks, per_slice), per_slice


def decode_attention_triton(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
    key_bits: int,
    value_bits: int,
) -> torch.Tensor:
    """Same result as ``decode_kernel.decode_attention`` (its docstring gives the shapes)."""

    batch, heads, group_rows, dim = query.shape
    seq = keys.shape[-2]
    block_n = 64
    slices, per_slice = decode_split(batch * heads, seq, block_n)
    block_g = max(16, triton.next_power_of_2(group_rows))
    out = torch.empty(batch * heads, slices, block_g, dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch * heads, slices, block_g, dtype=torch.float32, device=query.device)
    query = query.contiguous()
    keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (keys, values))
    # a coded row's scales read as float16 (rows are even-sized); unused where the slots are not coded
    key_meta, value_meta = (
        t.view(torch.float16) if bits else t for t, bits in ((keys, key_bits), (values, value_bits))
    )
    mask, mask_strides = keys, (0, 0)  # no mask: any pointer, never read
    if visible is not None:  # [b, 1 | kv_heads, 1, s]
        mask = (visible if visible.stride(-1) == 1 else visible.contiguous()).view(torch.uint8)
        mask_strides = (mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0)
    pointers = (query, keys, key_meta, values, value_meta, mask, out, lse)
    strides = (query.stride(0), query.stride(1), *keys.stride()[:3], *values.stride()[:3], *mask_strides)
    shape = dict(GROUP_ROWS=group_rows, DIM=dim, BLOCK_G=block_g, BLOCK_N=block_n, BLOCKS=per_slice)
    coding = dict(KEY_BITS=key_bits, VALUE_BITS=value_bits, QUANT_GROUP=group_size(dim))
    _decode_attention_kernel[(batch * heads, slices)](
        *pointers,
        heads,
        seq,
        float(scaling),
        *strides,
        **shape,
        **coding,
        MASKED=visible is not None,
        PRECISE=query.dtype == torch.float32,
    )
    # the slices, weighed by their normalisers (a slice that saw no slot weighs nothing)
    out, lse = out[:, :, :group_rows], lse[:, :, :group_rows]
    top = lse.amax(dim=1, keepdim=True)
    weights = torch.exp(lse - torch.where(top == float("-inf"), 0.0, top))
    mixed = (out * weights[..., None]).sum(1) / weights.sum(1).clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    return mixed.view(batch, heads, group_rows, dim).to(query.dtype)
