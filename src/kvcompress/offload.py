"""An offload store of fixed-size token chunks that the GPU reads without a host round trip.

The store is a ``[batch, kv_heads, n_chunks, chunk, head_dim]`` tensor in host memory (pinned when
the model runs on a GPU). With unified virtual addressing a GPU kernel can read pinned host memory
through the same pointer, across PCIe, so gathering the chunks a decoding step selected needs
neither a host-side gather nor the chunk ids on the host: nothing waits for the GPU. Chunks that the
previous step already fetched are copied from its device buffer instead of read again (ShadowKV's
cache-aware fetch); the Triton kernel in ``kernels.py`` skips their PCIe reads entirely.

The gather runs on a side CUDA stream, overlapped with whatever the caller does meanwhile on the
current stream (ShadowKV: rebuilding the keys). On a CPU model the same code runs synchronously
on an ordinary tensor.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace
from typing import Callable, TypeVar

import torch

from .cache import gather_tokens, to_host

T = TypeVar("T")


def chunk_tokens(chunks: torch.Tensor, chunk: int) -> torch.Tensor:
    """Token indices ``[b, h, n * chunk]`` of chunk indices ``[b, h, n]``."""
    offsets = torch.arange(chunk, device=chunks.device)
    return (chunks[..., None] * chunk + offsets).flatten(-2)


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


def reuse_previous(fetched: torch.Tensor, hit: torch.Tensor, slot: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """``fetched [b, h, k * chunk, d]`` with each hit chunk taken from ``previous`` at its ``slot`` instead."""
    if previous is None:
        return fetched
    c = fetched.shape[2] // hit.shape[-1]
    reused = gather_tokens(previous, chunk_tokens(slot, c))
    return torch.where(hit.repeat_interleave(c, dim=-1)[..., None], reused, fetched)


class ChunkStore:
    """Chunks kept off the compute device, and the fastest way this machine has to gather them.

    ``mode`` says which: "cpu" (model on the CPU), "zero-copy+triton" (GPU kernel reading pinned
    memory, hit chunks never cross PCIe), "zero-copy" (the same read with plain torch ops: every
    selected chunk crosses PCIe) or "host-gather" (chunk ids copied to the host: synchronizes)."""

    def __init__(self, chunks: torch.Tensor) -> None:
        self.device = chunks.device
        self.host = to_host(chunks)
        self.view: torch.Tensor | None = self.host
        self.stream: torch.cuda.Stream | None = None
        self.kernel: Callable | None = None  # the Triton gather, when it can read the store
        if chunks.is_cuda:
            self.view = zero_copy_view(self.host, self.device)
            self.stream = side_stream(self.device)
            self.kernel = _triton_gather() if self.view is not None else None

    @property
    def mode(self) -> str:
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
        if self.stream is None:
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
