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

import copy
import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import torch

from .codec import Codec, from_spec
from .ops import TRITON, fused  # with Triton, ops.fused runs the gather's kernel on CUDA
from .tensors import chunk_tokens, gather_tokens, to_host

T = TypeVar("T")


def zero_copy_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor aliasing pinned ``host`` memory (no copy), or None where that is unavailable.

    Built through ``__cuda_array_interface__`` over the raw bytes (it has no bfloat16 type code), then
    viewed back as the host dtype. One small read checks that the device really sees the host bytes."""
    if not host.is_pinned() or not host.is_contiguous() or host.numel() == 0:
        return None
    device = torch.device(device)
    if device.index is None:  # "cuda" means the current GPU; the view's device names its index
        device = torch.device(device.type, torch.cuda.current_device())
    raw = host.view(torch.uint8)
    interface = {
        "shape": tuple(raw.shape),
        "typestr": "|u1",
        "data": (raw.data_ptr(), False),
        "version": 2,
        "strides": None,
    }
    try:
        view = torch.as_tensor(SimpleNamespace(__cuda_array_interface__=interface, keep_alive=raw), device=device).view(
            host.dtype
        )
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


def reuse_previous(
    fetched: torch.Tensor, hit: torch.Tensor, slot: torch.Tensor, previous: torch.Tensor | None
) -> torch.Tensor:
    """``fetched [b, h, k * chunk, d]`` with each hit chunk taken from ``previous`` at its ``slot`` instead."""
    if previous is None:
        return fetched
    c = fetched.shape[2] // hit.shape[-1]
    reused = gather_tokens(previous, chunk_tokens(slot, c))
    return torch.where(hit.repeat_interleave(c, dim=-1)[..., None], reused, fetched)


def reuse(
    fetched: torch.Tensor,
    chunks: torch.Tensor,
    previous_chunks: torch.Tensor | None,
    previous: torch.Tensor | None,
    hits: torch.Tensor | None,
) -> torch.Tensor:
    """``fetched`` (the tokens of ``chunks [b, h, k]``) with the chunks last step also selected
    (``previous_chunks``, ascending) taken from its buffer ``previous``, counted in ``hits``."""
    if previous is None or previous_chunks is None or hits is None:  # all three, or none (the first step)
        return fetched
    hit, slot = match_previous(chunks, previous_chunks)
    hits.add_(hit.sum())
    return reuse_previous(fetched, hit, slot, previous)


def _gathered_like(store: torch.Tensor, chunks: torch.Tensor, *args) -> torch.Tensor:
    batch, heads, k = chunks.shape
    return store.new_empty(batch, heads, k * store.shape[-2], store.shape[-1], device=chunks.device)


@fused("gather_chunks", mutates_args=("hits",), fake=_gathered_like)
def gather_chunks(
    store: torch.Tensor,
    chunks: torch.Tensor,
    previous_chunks: torch.Tensor | None,
    previous: torch.Tensor | None,
    hits: torch.Tensor | None,
) -> torch.Tensor:
    """The tokens of ``chunks [b, h, k]`` from ``store [b, h, n_chunks, chunk, d]`` as ``[b, h, k *
    chunk, d]``; given last step's chunks ``previous_chunks [b, h, k]`` (ascending) and their tokens
    ``previous``, a chunk selected again is copied from there (counted in the scalar ``hits``)."""
    return reuse(fetch_chunks(store, chunks), chunks, previous_chunks, previous, hits)


class ChunkStore:
    """Chunks a decoding step gathers from, and the fastest way this machine has to gather them.

    ``mode`` says which: "device" (kept on the compute device), "cpu" (offloaded, model on the CPU),
    "zero-copy+triton" (GPU kernel reading pinned memory, hit chunks never cross PCIe), "zero-copy"
    (the same read with plain torch ops: every selected chunk crosses PCIe) or "host-gather" (chunk
    ids copied to the host: synchronizes).

    With a ``codec`` (codec.py) each of a token's ``dim``-channel vectors is stored as one coded row and decoded
    once gathered; a coded step reads every chunk it selects from the store (its caller passes no previous chunks:
    they are held decoded)."""

    def __init__(self, chunks: torch.Tensor, offload: bool, codec: Codec | None = None) -> None:
        self.device = chunks.device
        self.offloaded = offload
        self.codec = codec
        if codec is not None:
            lead, width = chunks.shape[:-1], chunks.shape[-1]
            chunks = codec.encode(chunks.reshape(*lead, width // codec.dim, codec.dim)).flatten(-2)
        self.host = to_host(chunks) if offload else chunks
        self.view: torch.Tensor | None = self.host
        self.stream: torch.cuda.Stream | None = None
        if offload and chunks.is_cuda:
            self._connect()

    def _connect(self) -> None:
        self.view = zero_copy_view(self.host, self.device)
        self.stream = side_stream(self.device)

    @property
    def mode(self) -> str:
        if not self.offloaded:
            return "device"
        if self.view is not None and self.stream is not None and TRITON:
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
        """Whether a chunk selected again is read from the store again (all modes but the Triton kernel's, and
        always from a coded store)."""
        return self.codec is not None or self.mode != "zero-copy+triton"

    def fetch(
        self,
        chunks: torch.Tensor,
        previous_chunks: torch.Tensor | None,
        previous: torch.Tensor | None,
        hits: torch.Tensor | None,
        overlap: Callable[[], T],
    ) -> tuple[torch.Tensor, T]:
        """Gather ``chunks [b, h, k]`` (see ``gather_chunks``; with ``previous``, chunks selected again
        come from it) on the side stream while ``overlap()`` runs on the current one; returns the
        gathered ``[b, h, k * chunk, d]`` and ``overlap()``'s result."""
        if self.stream is None or torch.compiler.is_compiling():  # a compiled step runs on one stream
            return self.decoded(self._gather(chunks, previous_chunks, previous, hits)), overlap()
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            gathered = self.decoded(self._gather(chunks, previous_chunks, previous, hits))
        result = overlap()
        main.wait_stream(self.stream)
        gathered.record_stream(main)
        return gathered, result

    def decoded(self, gathered: torch.Tensor) -> torch.Tensor:
        """Gathered tokens ``[..., parts * row_bytes]`` as their ``parts`` vectors side by side (plain: as they are)."""
        if self.codec is None:
            return gathered
        return self.codec.decode(gathered.unflatten(-1, (-1, self.codec.row_bytes))).flatten(-2)

    def _gather(
        self,
        chunks: torch.Tensor,
        previous_chunks: torch.Tensor | None,
        previous: torch.Tensor | None,
        hits: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.view is None:  # no zero-copy view: the chunk ids go to the host (a synchronisation)
            return reuse(
                fetch_chunks(self.host, chunks.cpu()).to(self.device, non_blocking=True),
                chunks,
                previous_chunks,
                previous,
                hits,
            )
        return gather_chunks(self.view, chunks, previous_chunks, previous, hits)

    def state_dict(self) -> dict[str, Any]:
        """The store as a saved file holds it (docs/file-format.md): its chunks and where they live."""
        return {
            "host": self.host,
            "offloaded": self.offloaded,
            "codec": None if self.codec is None else self.codec.spec(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> ChunkStore:
        """The store ``state_dict`` saved (its chunks in host memory), serving a model on ``device``."""
        store = cls.__new__(cls)
        store.host, store.offloaded = state["host"], state["offloaded"]
        store.codec = from_spec(state.get("codec"))
        store.restored(device)
        return store

    def restored(self, device: torch.device) -> None:
        """After loading ``host`` and ``offloaded`` from a file: serve a model on ``device``."""
        self.device = torch.device(device)
        if self.offloaded and self.device.type == "cuda":
            self.host = torch.empty(self.host.shape, dtype=self.host.dtype, pin_memory=True).copy_(self.host)
            self._connect()
        else:
            self.host = self.host if self.offloaded else self.host.to(self.device)
            self.view, self.stream = self.host, None

    @classmethod
    def concat(cls, stores: list[ChunkStore]) -> ChunkStore:
        """The rows of ``stores`` (groups of one batch, with the batch's chunk count) as one store."""
        first, hosts = stores[0], [store.host for store in stores]
        host = torch.empty(
            (sum(h.shape[0] for h in hosts), *hosts[0].shape[1:]),
            dtype=hosts[0].dtype,
            device=hosts[0].device,
            pin_memory=hosts[0].is_pinned(),
        )
        torch.cat(hosts, out=host)
        joined = copy.copy(first)
        joined.host = joined.view = host
        if first.offloaded and first.device.type == "cuda":
            joined._connect()
        return joined

    def batch_apply(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (beam reorder, repeat) to the stored rows, where they are."""
        host = apply(self.host)
        if self.host.is_pinned():  # stays pinned, without a trip through the GPU
            host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
        self.host = self.view = host
        if self.offloaded and self.device.type == "cuda":
            self._connect()


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU, shared by every store (layers run one after another)."""
    return torch.cuda.Stream(device)
