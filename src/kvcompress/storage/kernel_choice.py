"""Which attention kernel each phase of a generation runs, chosen by timing, not left to PyTorch's default order.

The phases: ``decode`` (one new query per row), ``turn`` (several new queries over a cache) and ``prefill`` (the
queries are the keys, causal). The first call of a phase on a device and dtype times every kernel that accepts its
inputs on a probe of the same shape (at most ``PROBE_TOKENS`` keys) and keeps them fastest first. cuDNN's kernel is
never a candidate for ``decode`` or ``turn``: it builds a plan per shape, and a cache's length changes with every call
(measured on an H100: 1.6 ms of host time per call). On CUDA with Triton, ``decode`` has one more candidate,
``triton``: ``decode_kernel.decode_attention``, split along the slots (SDPA's fused kernels give each head's whole
cache to one program), which also reads 8- and 4-bit coded slots without decoding them first. A decoding probe has as
many keys as the cache (rounded up to a power of two, at most ``DECODE_PROBE_TOKENS``): which kernel wins depends on
the length. Each kernel is timed twice: as the host waits for it (an eager step's choice) and on the device alone (a
compiled step's, whose launches come from one graph): a kernel quick on the device and slow to launch wins only the
second.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from .decode_kernel import decode_attention, stack_groups
from .ops import runs_triton

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
