"""Small shape helpers shared by the cache, the offload store and the methods, and the clock every timing reads.

Shapes: keys/values ``[batch, kv_heads, slots, head_dim]``, queries ``[batch, q_heads, seq, head_dim]``,
per-token validity ``[batch, seq]`` (False = padding), per-head token indices ``[batch, kv_heads, n]``.
"""

from __future__ import annotations

import time

import torch


def prompt_positions(valid: torch.Tensor) -> torch.Tensor:
    """Each slot's position inside its row's real prompt ``[batch, slots]``; -1 for padding."""
    return (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)


def gather_tokens(tensor: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tensor [b, h, s, d]`` at per-head token indices ``[b, h, n]`` -> ``[b, h, n, d]``."""
    return tensor.gather(2, tokens[..., None].expand(-1, -1, -1, tensor.shape[-1]).to(tensor.device))


def gather_rows(tensor: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tensor [b, s]`` (one value per token, shared by all heads) at ``tokens [b, h, n]`` -> ``[b, h, n]``."""
    return tensor[:, None, :].expand(-1, tokens.shape[1], -1).gather(2, tokens)


def chunk_tokens(chunks: torch.Tensor, chunk: int) -> torch.Tensor:
    """Token indices ``[b, h, n * chunk]`` of chunk indices ``[b, h, n]``."""
    offsets = torch.arange(chunk, device=chunks.device)
    return (chunks[..., None] * chunk + offsets).flatten(-2)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host-memory copy, pinned when it comes from a GPU (so the GPU can read it directly)."""
    if not tensor.is_cuda:
        return tensor.contiguous()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


def nbytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors (None ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def right_aligned(
    context: torch.Tensor, new: torch.Tensor, pads: list[int], dim: int, fill: float | bool = 0
) -> torch.Tensor:
    """``context`` then ``new`` along ``dim`` (batch first), each row's context moved ``pads[row]`` slots
    later, over the padding that leads ``new`` (left-padded), and ``fill`` before it: every row's tokens
    then end together, as one left-padded prompt's do. ``context`` may hold one row for every row of ``new``."""
    context = context.expand(new.shape[0], *context.shape[1:]) if context.shape[0] != new.shape[0] else context
    joined = torch.cat([context.to(new.device, non_blocking=True), new], dim=dim)
    width = context.shape[dim]
    for row, pad in enumerate(pads):
        if pad:
            joined[row].narrow(dim - 1, pad, width).copy_(context[row])
            joined[row].narrow(dim - 1, 0, pad).fill_(fill)
    return joined


def synced_clock(device: torch.device | None) -> float:
    """The clock once ``device`` has done its queued work (a GPU's kernels run after the host returns; None: no
    device yet, nothing queued)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
