"""Small shape helpers shared by the cache, the offload store and the methods.

Shapes: keys/values ``[batch, kv_heads, slots, head_dim]``, queries ``[batch, q_heads, seq, head_dim]``,
per-token validity ``[batch, seq]`` (False = padding), per-head token indices ``[batch, kv_heads, n]``.
"""

from __future__ import annotations

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
