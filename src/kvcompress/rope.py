"""Rotary position embedding helpers shared by methods that rebuild or un-rotate keys.

They follow the rotate-half convention of Llama, Mistral and Qwen2 (``x * cos + rotate_half(x) * sin``)
and take ``cos``/``sin`` from the model's own rotary module, so RoPE scaling variants (linear,
dynamic, llama3, yarn with its attention factor) are handled by the model's own code.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def rotary_module(model: PreTrainedModel) -> torch.nn.Module:
    """The model's rotary-embedding module (the one that turns position ids into cos/sin)."""
    for module in model.modules():
        if "Rotary" in type(module).__name__:
            return module
    raise ValueError(f"{type(model).__name__} has no rotary embedding module")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def cos_sin(rotary: torch.nn.Module, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for ``positions`` of any shape ``[b, ...]``, shaped ``[b, ..., head_dim]``."""
    flat = positions.reshape(positions.shape[0], -1)
    cos, sin = rotary(like, flat)
    shape = (*positions.shape, cos.shape[-1])
    return cos.reshape(shape).to(like.dtype), sin.reshape(shape).to(like.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., seq, d]``) by its positions' angles; cos/sin broadcast against ``x``."""
    return x * cos + rotate_half(x) * sin


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo ``apply_rope`` exactly (up to rounding): rotate back and remove any scaling of cos/sin."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
