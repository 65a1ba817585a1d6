"""Attention over cache slots: exact SDPA with GQA, the grouped logits every scorer needs, and the
choice of SDPA kernel for each phase of a generation.

Query head ``h`` reads KV head ``h // (q_heads // kv_heads)`` (the usual GQA grouping), so a KV
head is never repeated in memory: when the mask differs per KV head (or a single query attends to a
cache), the queries of a group are stacked as one head's queries instead.

Which SDPA kernel runs is chosen per phase, not left to PyTorch's default order: ``decode`` (one
new query per row), ``turn`` (several new queries over a cache) and ``prefill`` (the queries are the
keys, causal). The first call of a phase on a device and dtype times every kernel that accepts its
inputs on a probe of the same shape (at most ``PROBE_TOKENS`` keys) and keeps them fastest first.
cuDNN's kernel is never a candidate for ``decode`` or ``turn``: it builds a plan per shape, and a
cache's length changes with every call (measured on an H100: 1.6 ms of host time per call). On CUDA
with Triton, ``decode`` has one more candidate, ``triton``: ``decode_attention``, split along the slots
(SDPA's fused kernels give each head's whole cache to one program), which also reads 8- and 4-bit
coded slots without decoding them first. A decoding probe has as many keys as the cache (rounded up to
a power of two, at most ``DECODE_PROBE_TOKENS``): which kernel wins depends on the length. Each kernel is
timed twice: as the host waits for it (an eager step's choice) and on the device alone (a compiled step's, whose
launches come from one graph): a kernel quick on the device and slow to launch wins only the second. On a CPU, 8-,
6- and 4-bit and float8 coded slots are always read as stored by ``cpu_kernels``' kernel where it is built
(``reads_codes``); on CUDA a step hands the split kernel its codes (``hands_codes``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
import warnings
from collections.abc import Callable
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from .codec import codec_of_code
from .cpu_kernels import cpu_kernel, has_cpu_kernel
from .ops import fused, runs_triton

# keys of the probe a phase's kernels are timed on (a prefill's probe: a quarter, its cost is quadratic)
PROBE_TOKENS = 4096
DECODE_PROBE_TOKENS = 131072  # a decoding probe's keys at most (a GPU's; the cache's length, rounded up)
PROBE_ELEMENTS = 1 << 25  # a probe's keys, summed over its rows, at most (unless one row has more)
BACKEND_NAMES = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
KERNEL_NAMES = (*BACKEND_NAMES, "triton")  # SDPA's kernels and decode_attention's
# PyTorch's kernel numbers
_NAMES = {int(backend): name for name, backend in BACKEND_NAMES.items()}  # type: ignore[call-overload]
_default_picks: dict[tuple, str | None] = {}  # input shapes -> the kernel PyTorch picks for them
_chosen: dict[tuple, tuple[str, ...]] = {}  # (phase, device type, dtype, head_dim, masked) -> kernels, fastest first
_graphed: dict[tuple, tuple[str, ...]] = {}  # the same by device time alone: a compiled step's (_device_seconds)
_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def grouped_logits(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * q . k`` in float32, ``[b, q_heads, q, s]``, for ``query [b, q_heads, q, d]`` and
    ``keys [b, kv_heads, s, d]`` (any per-KV-head vectors: keys, chunk landmarks, projections)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, seq = keys.shape[1], keys.shape[2]
    stacked = query.float().reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)
    return (stacked @ keys.float().transpose(-1, -2)).view(batch, q_heads, q_len, seq).mul_(scaling)


def phase_of(q_len: int, seq: int) -> str:
    """``decode`` (one query), ``prefill`` (queries are the keys) or ``turn`` (several queries over a cache)."""
    return "decode" if q_len == 1 else "prefill" if q_len == seq else "turn"


def candidates(phase: str, device_type: str, head_dim: int) -> tuple[str, ...]:
    """Kernels a phase may use: all but cuDNN's where the key length changes from call to call; for ``decode``
    where the fused ops run Triton (CUDA), also ``decode_attention``'s kernel (heads of 16 to 256 channels, a
    power of two)."""
    sdpa_kernels = tuple(name for name in BACKEND_NAMES if not (name == "cudnn" and phase != "prefill"))
    split = phase == "decode" and runs_triton(device_type) and head_dim in (16, 32, 64, 128, 256)
    return (*sdpa_kernels, "triton") if split else sdpa_kernels


def length_bucket(phase: str, device_type: str, seq: int) -> int | None:
    """The key length a choice is made for: a CUDA decoding step's, rounded up to a power of two (the
    split kernel's gain grows with it); one choice for every length otherwise."""
    if phase != "decode" or device_type != "cuda":
        return None
    return min(DECODE_PROBE_TOKENS, 1 << max(0, seq - 1).bit_length())


def forced_backends(phase: str) -> tuple[str, ...] | None:
    """``KVCOMPRESS_SDPA`` (e.g. ``decode=efficient,math;prefill=flash``) overrides the timing (read
    when a phase is first used)."""
    return _parse_forced(os.environ.get("KVCOMPRESS_SDPA", "")).get(phase)


@functools.cache
def _parse_forced(text: str) -> dict[str, tuple[str, ...]]:
    forced = {}
    for part in text.split(";"):
        name, _, kernels = part.partition("=")
        if kernels:
            chosen = tuple(k.strip() for k in kernels.split(","))
            unknown = [k for k in chosen if k not in KERNEL_NAMES or (k == "triton" and name.strip() != "decode")]
            if unknown:
                raise ValueError(
                    f"KVCOMPRESS_SDPA names unknown kernels {unknown} for {name.strip()}; "
                    f"valid: {', '.join(BACKEND_NAMES)} (and triton for decode)"
                )
            forced[name.strip()] = chosen
    return forced


def forget_choices() -> None:
    """Choose every phase's kernels afresh (after ``KVCOMPRESS_SDPA`` changed, say)."""
    _chosen.clear()
    _graphed.clear()


def sdpa_choices(graphed: bool = False) -> dict[str, tuple[str, ...]]:
    """The kernels chosen so far in this process, fastest first, per ``phase/device/dtype/head_dim/masked``
    (``graphed``: a compiled step's, by device time alone)."""
    return {
        "/".join(str(part).removeprefix("torch.") for part in key): kernels
        for key, kernels in (_graphed if graphed else _chosen).items()
    }


@torch.compiler.assume_constant_result
def _compiled_backends(phase: str, device_type: str, dtype: str, head_dim: int, masked: bool, bucket: int) -> str:
    """The kernels chosen for a compiled step (by device time), as a string: it bakes the choice in without
    guarding on it. ``bucket``: ``length_bucket``'s (0: none, or a length the graph leaves symbolic: the longest one
    chosen for)."""
    made = [
        k for k in _graphed if k[:2] == (phase, device_type) and str(k[2]) == dtype and k[3:5] == (head_dim, masked)
    ]
    exact = [k for k in made if (k[5] or 0) == bucket]
    key = exact[0] if exact else max(made, key=lambda k: k[5] or 0, default=None)
    if key is not None:
        return ",".join(_graphed[key])
    return ",".join(forced_backends(phase) or candidates(phase, device_type, head_dim))


def _time_backend(name: str, probe: tuple, is_causal: bool, enable_gqa: bool) -> tuple[float, float] | None:
    """Median seconds of three calls with only kernel ``name`` enabled, as the host waits for them and (on CUDA) on
    the device alone; None where it does not run."""
    query, keys, values, mask = probe
    cuda = query.is_cuda

    def call() -> None:
        if name == "triton":
            decode_attention(stack_groups(query, keys.shape[1]), keys, values, mask, query.shape[-1] ** -0.5, 0, 0)
        else:
            F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa
            )

    try:
        with contextlib.nullcontext() if name == "triton" else sdpa_kernel([BACKEND_NAMES[name]]):
            times = []
            for _ in range(4):
                if cuda:
                    torch.cuda.synchronize(query.device)
                start = time.perf_counter()
                call()
                if cuda:
                    torch.cuda.synchronize(query.device)
                times.append(time.perf_counter() - start)
            device = _device_seconds(call) if cuda else None
    except RuntimeError:  # this kernel does not take these inputs
        return None
    except Exception as error:  # Triton's own errors (a kernel that does not build here)
        if name != "triton":
            raise
        warnings.warn(
            f"kvcompress: the split decoding kernel did not run here ({error}); SDPA's kernels are used", stacklevel=2
        )
        return None
    wall = sorted(times[1:])[1]
    return wall, wall if device is None else device


DEVICE_WAIT_CYCLES = 2_000_000  # ~1 ms of a GPU's clock: longer than the host takes to queue one attention call


def _device_seconds(call: Callable[[], None]) -> float:
    """Median device time of three ``call``s, each queued behind a wait on the GPU so the host's launches never leave
    it idle: what the call costs inside a CUDA graph. By wall time alone the split kernel (a launch and its slices'
    merge) lost to SDPA's efficient kernel at 4K slots on the H200 (11-28), which took 90 us a layer on the device
    for 2K slots where the split kernel read 32K in 39."""
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(DEVICE_WAIT_CYCLES)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[1]


def _probe(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, phase: str) -> tuple:
    """Random inputs shaped like these, with at most ``PROBE_TOKENS`` keys (a quarter, and as many
    queries, for a prefill; a CUDA decoding step's: its length bucket) and at most 4 rows (fewer where a
    long probe's keys would pass ``PROBE_ELEMENTS``: a first step near a full device must not run out)."""
    bucket = length_bucket(phase, query.device.type, keys.shape[-2])
    seq = bucket or min(keys.shape[-2], PROBE_TOKENS // 4 if phase == "prefill" else PROBE_TOKENS)
    q_len = seq if phase == "prefill" else min(query.shape[-2], seq)
    dim = query.shape[-1]  # ``keys`` may be coded rows (``hands_codes``): only their heads and slots are read
    batch = max(1, min(query.shape[0], 4, PROBE_ELEMENTS // (keys.shape[1] * seq * dim)))
    probe_query = torch.randn(batch, query.shape[1], q_len, dim, device=query.device, dtype=query.dtype)
    probe_keys = torch.randn(batch, keys.shape[1], seq, dim, device=query.device, dtype=query.dtype)
    probe_mask: torch.Tensor | CausalBias | None
    if isinstance(mask, CausalBias):
        probe_mask = causal_lower_right(q_len, seq)
    else:
        shape = (batch, 1 if mask is None else mask.shape[1], q_len, seq)
        probe_mask = None if mask is None else torch.ones(shape, dtype=torch.bool, device=query.device)
    return probe_query, probe_keys, torch.randn_like(probe_keys), probe_mask


def choose_backends(
    phase: str, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, enable_gqa: bool
) -> tuple[str, ...]:
    """The phase's kernels, fastest first (timed once per phase, device, dtype, head size and masking)."""
    if torch.compiler.is_compiling():
        seq = keys.shape[-2]
        bucket = length_bucket(phase, query.device.type, seq) if isinstance(seq, int) else None
        return tuple(
            _compiled_backends(
                phase, query.device.type, str(query.dtype), query.shape[-1], mask is not None, bucket or 0
            ).split(",")
        )
    bucket = length_bucket(phase, query.device.type, keys.shape[-2])
    key = (phase, query.device.type, query.dtype, query.shape[-1], mask is not None, bucket)
    chosen = _chosen.get(key)
    if chosen is None:
        forced = forced_backends(phase)
        if forced is not None:
            chosen = graphed = forced
        else:
            probe = _probe(query, keys, mask, phase)
            times = (
                (_time_backend(name, probe, is_causal, enable_gqa), name)
                for name in candidates(phase, query.device.type, query.shape[-1])
            )
            timed = [(t, name) for t, name in times if t is not None]
            chosen = tuple(name for _, name in sorted(timed)) or ("math",)
            graphed = tuple(name for _, name in sorted(timed, key=lambda each: each[0][1])) or ("math",)
        _chosen[key], _graphed[key] = chosen, graphed
    return chosen


def kernel_context(chosen: tuple[str, ...]):
    """``sdpa_kernel`` enabling ``chosen``'s SDPA kernels in that order of priority (where this torch can order
    them)."""
    backends = [BACKEND_NAMES[name] for name in chosen if name in BACKEND_NAMES] or [SDPBackend.MATH]
    return sdpa_kernel(backends, set_priority=True) if _PRIORITY else sdpa_kernel(backends)


def chosen_kernels(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None):
    """The chosen kernels as a context, for SDPA called by someone else (transformers' own cache)."""
    phase = phase_of(query.shape[-2], keys.shape[-2])
    return kernel_context(
        choose_backends(
            phase,
            query,
            keys,
            mask,
            is_causal=mask is None and phase == "prefill",
            enable_gqa=query.shape[1] != keys.shape[1],
        )
    )


def sdpa(
    phase: str,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the kernels chosen for ``phase`` (see ``phase_of``).
    Where PyTorch would pick the fastest one anyway, no context is entered (it costs ~20 us a call)."""
    chosen = choose_backends(phase, query, keys, mask, is_causal, enable_gqa)
    if chosen[0] == "triton":  # a decoding step, its queries stacked per KV head (dense_attention)
        return decode_attention(
            query, keys, values, mask, query.shape[-1] ** -0.5 if scaling is None else scaling, 0, 0
        )
    compiling = torch.compiler.is_compiling()
    if not compiling and chosen[0] == default_backend(query, keys, values, mask, is_causal, scaling, enable_gqa):
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa
        )
    with kernel_context(chosen):
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa
        )


def default_backend(query, keys, values, mask, is_causal, scaling, enable_gqa) -> str | None:
    """The kernel PyTorch would pick by itself for these inputs (None where this torch cannot say),
    asked once per shapes: a decoding step's shapes repeat."""
    key = (
        query.shape,
        keys.shape,
        None if mask is None else (mask.shape, mask.dtype),
        query.dtype,
        query.device,
        is_causal,
        enable_gqa,
    )
    if key not in _default_picks:
        try:
            _default_picks[key] = _NAMES.get(
                torch._fused_sdp_choice(query, keys, values, mask, 0.0, is_causal, scale=scaling, enable_gqa=enable_gqa)
            )
        except (AttributeError, TypeError, RuntimeError):
            _default_picks[key] = None
    return _default_picks[key]


def stack_groups(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, q_heads, q, d]`` -> ``[b, kv_heads, group * q, d]``: a KV head's query heads as one head's queries."""
    batch, q_heads, q_len, dim = query.shape
    return query.reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)


def group_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """A mask ``[b, 1 | kv_heads, q, s]`` for stacked queries ``[b, kv_heads, group * q, s]`` (one query: a
    broadcast)."""
    if mask.shape[2] == 1:
        return mask
    batch, heads, q_len, seq = mask.shape
    return mask[:, :, None].expand(batch, heads, group, q_len, seq).reshape(batch, heads, group * q_len, seq)


def _decoded_like(query: torch.Tensor, *args) -> torch.Tensor:
    return query.new_empty(query.shape)


TRITON_BITS = (4, 6, 8)  # the codes the Triton kernel reads (float8 rows: decoded first on CUDA)


@fused("decode_attention", mutates_args=(), fake=_decoded_like)
def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
    key_bits: int,
    value_bits: int,
) -> torch.Tensor:
    """A decoding step's attention ``[b, kv_heads, rows, d]``: ``query [b, kv_heads, rows, d]`` (a GQA group's
    query heads stacked as rows) over ``keys``/``values [b, kv_heads, s, ...]`` as a storage holds them: at the
    model's precision (bits 0) or as rows of an 8-, 6- (keys) or 4-bit ``codec.IntCodec`` or of float8
    (``key_bits``, ``value_bits``: the codecs' ``kernel_code``; the Triton kernel reads ``TRITON_BITS``);
    ``visible [b, 1 | kv_heads, 1, s]`` bool (None: every slot). On CUDA one Triton kernel, split along the slots,
    reads the rows as they are (``kernels.decode_attention_triton``); on a CPU, coded rows are read as they are by
    ``cpu_kernels``' kernel where it is built; otherwise they are decoded first."""
    kernel = cpu_kernel() if query.is_cpu and key_bits and value_bits else None
    if kernel is not None:
        return kernel.coded_decode_attention(query, keys, values, visible, scaling, key_bits, value_bits)
    dim = query.shape[-1]
    keys, values = (
        rows if bits == 0 else codec_of_code(bits, dim, query.dtype).decode(rows)
        for rows, bits in ((keys, key_bits), (values, value_bits))
    )
    logits = (query.float() @ keys.float().transpose(-1, -2)) * scaling
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    return (logits.softmax(dim=-1) @ values.float()).to(query.dtype)


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    coded: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """Exact attention ``[b, q_heads, q, d]``. ``mask`` is boolean, ``[b, 1 | kv_heads, q, s]``, or
    SDPA's lower-right causal bias; None means causal over the last ``q`` slots (or no mask for one
    query). ``softcap`` (Gemma 2): logits become ``softcap * tanh(logits / softcap)`` before the softmax.
    ``coded``: the same slots as stored, integer-coded rows and their key and value bits
    (``codec.coded_rows``), which a decoding step reads without decoding where ``decode_attention``'s kernel is
    the one chosen, or on a CPU where its kernel is built (``keys``/``values``: decoded, or the same coded rows where
    the caller handed them on undecoded, ``hands_codes``: then decoded here if SDPA's kernel is the choice)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, seq = keys.shape[1], keys.shape[-2]
    if mask is None and 1 < q_len and (q_len != seq or softcap is not None):
        mask = causal_slot_mask(q_len, seq, keys.device)
    if softcap is not None:
        logits = grouped_logits(query, keys, scaling)
        logits = softcap * torch.tanh(logits / softcap)
        if mask is not None:
            hidden = ~group_mask(mask, q_heads // kv_heads)
            logits = logits.view(batch, kv_heads, -1, seq).masked_fill(hidden, torch.finfo(torch.float32).min)
        probs = logits.view(batch, kv_heads, -1, seq).softmax(dim=-1)
        return (probs @ values.float()).view(batch, q_heads, q_len, -1).to(query.dtype)
    phase = phase_of(q_len, seq)
    if isinstance(mask, CausalBias):  # the newest q of the slots, causal, without building the mask
        if q_heads != kv_heads and not query.is_cpu:
            # PyTorch's fused kernels take a lower-right bias only for equal head counts; with GQA it falls back
            # to the math kernel and a q x s float32 score tensor (16 GiB per 4K block over 32K keys on the 8B
            # shape: the 11-26 H100 run's out-of-memory). The KV heads are repeated instead, for this call only
            # (group x the keys and values seen: 512 MiB at 32K on the 8B shape)
            keys, values = (t.repeat_interleave(q_heads // kv_heads, dim=1) for t in (keys, values))
        return sdpa(phase, query, keys, values, mask, scaling, enable_gqa=q_heads != keys.shape[1])
    # stacked: KV read once per KV head, a per-head mask as is
    if q_len == 1 or (mask is not None and mask.shape[1] > 1):
        mask = None if mask is None else group_mask(mask, q_heads // kv_heads)
        stacked = stack_groups(query, kv_heads)
        stored = coded if phase == "decode" else None
        if stored is not None and (
            reads_codes(query)
            or (
                set(stored[2:]) <= set(TRITON_BITS)
                and choose_backends(phase, stacked, keys, mask, False, False)[0] == "triton"
            )
        ):
            out = decode_attention(stacked, *stored[:2], mask, scaling, *stored[2:])
        else:
            if coded is not None and keys.dtype != query.dtype:  # handed as codes (hands_codes) and SDPA won
                keys, values = (
                    codec_of_code(bits, dim, query.dtype).decode(rows) for rows, bits in zip(coded[:2], coded[2:])
                )
            out = sdpa(phase, stacked, keys, values, mask, scaling)
        # a fused kernel's output may be laid out [b, group * q, kv_heads, d] (CUDA's efficient kernel): no view
        return out.reshape(batch, q_heads, q_len, dim)
    return sdpa(phase, query, keys, values, mask, scaling, is_causal=mask is None, enable_gqa=q_heads != kv_heads)


def hands_codes(query: torch.Tensor, key_bits: int, value_bits: int) -> bool:
    """Whether a decoding step on ``query``'s device hands its slots' codes to ``dense_attention`` undecoded
    (``Slots.reads_codes``): where a kernel reads them all (``reads_codes``), and where the split kernel runs and
    reads these codes, the likely choice of a long cache (``dense_attention`` decodes them for SDPA's kernels when
    one of them wins). Decoding first, the 4-bit full cache's step spent ~40 ms at 32K on the H200 (11-28) making a
    copy the split kernel then never read."""
    return reads_codes(query) or (
        {key_bits, value_bits} <= set(TRITON_BITS)
        and "triton" in candidates("decode", query.device.type, query.shape[-1])
    )


def reads_codes(query: torch.Tensor) -> bool:
    """Whether a decoding step on ``query``'s device reads integer-coded slots without decoding them whatever the
    kernel choice: on a CPU where ``cpu_kernels``' kernel is built (decoding first is never faster there)."""
    return query.is_cpu and has_cpu_kernel()


def attention_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``[b, q_heads, q, d]`` and each query's log-normaliser (the log of its softmax's
    sum) ``[b, q_heads, q]`` float32, for a boolean ``mask [b | 1, 1, q, s]``: an observation pass's
    attention, whose normalisers a method scores with. On a CPU, SDPA's own flash kernel returns both
    (the KV heads repeated for it: a few MiB, where the mask repeated per query head would be far more);
    elsewhere, or with soft-capping, the logits are spelled out."""
    if query.device.type != "cpu" or softcap is not None:
        return spelled_out_with_lse(query, keys, values, mask, scaling, softcap)
    group = query.shape[1] // keys.shape[1]
    bias = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, -torch.inf)
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, keys, values, 0.0, False, attn_mask=bias, scale=scaling)


def spelled_out_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` from the logits in float32 (any device, soft-capping included; ``mask`` None: every
    slot seen)."""
    batch, q_heads, q_len, dim = query.shape
    group = q_heads // keys.shape[1]
    logits = grouped_logits(query, keys, scaling).view(batch, keys.shape[1], group * q_len, -1)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if mask is not None:
        logits.masked_fill_(~group_mask(mask, group), -torch.inf)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    out = logits.sub_(lse).exp_() @ values.float()
    return out.view(batch, q_heads, q_len, dim).to(query.dtype), lse.view(batch, q_heads, q_len)


def after_prompt_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` on a CPU for queries that are the newest of ``keys`` and see every older
    key (no padding): two flash calls, the older keys unmasked and the new ones causal, merged by their
    log-normalisers (each call is faster than one call with a mask: 0.11 s against 0.18 s for 2K
    queries over 4K keys, 9 heads, on 2 cores; 3.4 s against 5.3 s for 8K over 16K on one). The older
    keys are read once per KV head (a GQA group's queries stacked as one head's: no mask to shift);
    only the new keys are repeated per query head, for the causal call."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    old_out, old_lse = flash(
        stack_groups(query, kv_heads), keys[:, :, :-q_len], values[:, :, :-q_len], 0.0, False, scale=scaling
    )
    old_out, old_lse = old_out.reshape(batch, q_heads, q_len, dim), old_lse.reshape(batch, q_heads, q_len)
    new_keys, new_values = (t[:, :, -q_len:].repeat_interleave(q_heads // kv_heads, dim=1) for t in (keys, values))
    new_out, new_lse = flash(query, new_keys, new_values, 0.0, True, scale=scaling)
    lse = torch.logaddexp(old_lse, new_lse)
    out = old_out.float() * (old_lse - lse).exp_()[..., None] + new_out.float() * (new_lse - lse).exp_()[..., None]
    return out.to(query.dtype), lse


def causal_slot_mask(q_len: int, slots: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q_len, slots]``: the newest ``q_len`` slots are the queries, each sees itself and all before."""
    return torch.ones(q_len, slots, dtype=torch.bool, device=device).tril(slots - q_len)[None, None]


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out [b, q_heads, q, d]`` whose softmax also has a learned sink logit per query head
    (``sinks [q_heads]``, gpt-oss) in its denominator, with no value: each query's row scaled by
    ``exp(lse) / (exp(lse) + exp(sink))``, from its log-normaliser over the keys ``lse [b, q_heads, q]``."""
    return (out.float() * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None]).to(out.dtype)


def sink_normaliser(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The log-normaliser ``[b, q_heads, q]`` of a softmax over the keys and the learned sink."""
    return torch.logaddexp(lse, sinks.float()[None, :, None])


_SCORING_SINKS: ContextVar[torch.Tensor | None] = ContextVar("kvcompress_scoring_sinks", default=None)


@contextlib.contextmanager
def scoring_sinks(sinks: torch.Tensor | None):
    """While a layer's method scores its prompt: the layer's learned sink logits ``[q_heads]`` (None: none),
    which ``key_probabilities`` gives their share of each softmax, as the model's attention does."""
    token = _SCORING_SINKS.set(sinks)
    try:
        yield
    finally:
        _SCORING_SINKS.reset(token)


def key_probabilities(logits: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """A scorer's attention probabilities: the softmax of ``logits [b, h, q, s]`` over the keys and, where the
    layer being scored has learned sinks (``scoring_sinks``; ``heads``: which query heads ``h`` are), each
    row's sink in the denominator, so a query's weights sum to what the model gives the keys."""
    probs = logits.softmax(dim=-1)
    sinks = _SCORING_SINKS.get()
    if sinks is None:
        return probs
    sink = (sinks if heads is None else sinks[heads]).float()
    return probs * torch.sigmoid(logits.logsumexp(dim=-1) - sink[None, :, None])[..., None]
