"""A store of fixed-size token chunks that a decoding step gathers from, on the device or off it.

The store is a ``[batch, kv_heads, n_chunks, chunk, dim]`` tensor. Kept on the compute device it is
an ordinary gather. Offloaded it lives in host memory, pinned when the model runs on a GPU: with
unified virtual addressing a GPU kernel reads pinned host memory through the same pointer, across
PCIe, so gathering the chunks a step selected needs neither a host-side gather nor the chunk ids on
the host, and nothing waits for the GPU. Chunks the previous step already fetched are copied from
its device buffer instead (ShadowKV's cache-aware fetch); the Triton kernel in ``kernels.py`` skips
their PCIe reads entirely. The gather runs on a side CUDA stream, overlapped with whatever the
caller does meanwhile on the current stream (ShadowKV: rebuilding the keys).
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace
from typing import Callable, TypeVar

import torch

from .tensors import chunk_tokens, gather_tokens, to_host

T = TypeVar("T")


def zero_copy_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor aliasing pinned ``host`` memory (no copy), or None where that is unavailable.

    Built through ``__cuda_array_interface__`` over the raw bytes (it has no bfloat16 type code), then
    viewed back as the host dtype. One small read checks that the device really sees the host bytes."""
    if not host.is_pinned() or not host.is_contiguous() or host.numel() == 0:
        return None
    raw = host.view(torch.uint8)
    interface = {"shape": tuple(raw.shape), "typestr": "|u1", "data": (raw.data_ptr(), False), "version": 2, "strides": None}
    try:
        view = torch.as_tensor(SimpleNamespace(__cuda_array_interface__=interface, keep_alive=raw), device=device).view(host.dtype)
        probe = (0,) * (host.dim() - 1)
        if view.device != device or not torch.equal(view[probe].cpu(), host[probe]):
            return None
    except (RuntimeError, TypeError, ValueError):
        return None
    return view


def fetch_chunks(store: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """Tokens of ``chunks [b, h, k]`` from ``store [b, h, n_chunks, chunk, d]`` -> ``[b, h, k * chunk, d]``."""
    c, d = store.shape[-2:]
    index = chunks.to(store.device)[..., None, None].expand(-1, -1, -1, c, d)
    return store.gather(2, index).flatten(2, 3)


def match_previous(selected: torch.Tensor, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each selected chunk ``[b, h, k]`` (ascending): was it selected at the previous step
    (``hit``), and at which slot of it (``slot``). A binary search: fixed shapes, no host sync."""
    if previous is None or previous.shape != selected.shape:
        return torch.zeros_like(selected, dtype=torch.bool), torch.zeros_like(selected)
    slot = torch.searchsorted(previous.contiguous(), selected.contiguous()).clamp(max=previous.shape[-1] - 1)
    return previous.gather(-1, slot) == selected, slot


def reuse_previous(fetched: torch.Tensor, hit: torch.Tensor, slot: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """``fetched [b, h, k * chunk, d]`` with each hit chunk taken from ``previous`` at its ``slot`` instead."""
    if previous is None:
        return fetched
    c = fetched.shape[2] // hit.shape[-1]
    reused = gather_tokens(previous, chunk_tokens(slot, c))
    return torch.where(hit.repeat_interleave(c, dim=-1)[..., None], reused, fetched)


class ChunkStore:
    """Chunks a decoding step gathers from, and the fastest way this machine has to gather them.

    ``mode`` says which: "device" (kept on the compute device), "cpu" (offloaded, model on the CPU),
    "zero-copy+triton" (GPU kernel reading pinned memory, hit chunks never cross PCIe), "zero-copy"
    (the same read with plain torch ops: every selected chunk crosses PCIe) or "host-gather" (chunk
    ids copied to the host: synchronizes)."""

    def __init__(self, chunks: torch.Tensor, offload: bool) -> None:
        self.device = chunks.device
        self.offloaded = offload
        self.host = to_host(chunks) if offload else chunks
        self.view: torch.Tensor | None = self.host
        self.stream: torch.cuda.Stream | None = None
        self.kernel: Callable | None = None  # the Triton gather, when it can read the store
        if offload and chunks.is_cuda:
            self._connect()

    def _connect(self) -> None:
        self.view = zero_copy_view(self.host, self.device)
        self.stream = side_stream(self.device)
        self.kernel = _triton_gather() if self.view is not None else None

    @property
    def mode(self) -> str:
        if not self.offloaded:
            return "device"
        if self.kernel is not None:
            return "zero-copy+triton"
        if self.stream is None:
            return "cpu"
        return "host-gather" if self.view is None else "zero-copy"

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk of one KV head."""
        return self.host[0, 0, 0].numel() * self.host.element_size()

    def reads_hits(self) -> bool:
        """Whether a chunk selected again is read from the store again (all modes but the Triton kernel)."""
        return self.kernel is None

    def fetch(self, chunks: torch.Tensor, hit: torch.Tensor, slot: torch.Tensor, previous: torch.Tensor | None, overlap: Callable[[], T]) -> tuple[torch.Tensor, T]:
        """Gather ``chunks [b, h, k]`` (hits from ``previous``) on the side stream while ``overlap()``
        runs on the current one; returns the gathered ``[b, h, k * chunk, d]`` and ``overlap()``'s result."""
        if self.stream is None or torch.compiler.is_compiling():  # a compiled step runs on one stream
            return self._gather(chunks, hit, slot, previous), overlap()
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            gathered = self._gather(chunks, hit, slot, previous)
        result = overlap()
        main.wait_stream(self.stream)
        gathered.record_stream(main)
        return gathered, result

    def _gather(self, chunks: torch.Tensor, hit: torch.Tensor, slot: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            try:
                return self.kernel(self.view, chunks, hit, slot, previous)
            except Exception as error:  # noqa: BLE001 - any compile/launch failure: fall back, say so once
                warnings.warn(f"kvcompress: the Triton chunk gather failed ({error}); using torch ops instead", stacklevel=2)
                self.kernel = None
        if self.view is None:
            fetched = fetch_chunks(self.host, chunks.cpu()).to(self.device, non_blocking=True)
        else:
            fetched = fetch_chunks(self.view, chunks)
        return reuse_previous(fetched, hit, slot, previous)

    def batch_apply(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (beam reorder, repeat) to the stored rows."""
        self.host = apply(self.host)
        if self.offloaded:
            self.host = to_host(self.host.to(self.device)) if self.device.type == "cuda" else self.host
        self.view = self.host
        if self.offloaded and self.device.type == "cuda":
            self._connect()


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU, shared by every store (layers run one after another)."""
    return torch.cuda.Stream(device)


def _triton_gather() -> Callable | None:
    """The Triton gather kernel's launcher, or None when Triton is not installed."""
    try:
        from .kernels import gather_chunks_triton
    except ImportError:
        return None
    return gather_chunks_triton
