"""Rotary position embedding helpers for methods that rebuild or un-rotate keys (ShadowKV).

They follow the rotate-half convention (``x * cos + rotate_half(x) * sin``) on the first
``cos.shape[-1]`` dimensions (partial rotary, e.g. Phi-3, passes the rest through), and take
``cos``/``sin`` from the model's own rotary module, so RoPE scaling variants (linear, dynamic,
llama3, yarn with its attention factor) and per-layer-type rotary (Gemma 3) use the model's code.
``check_rope`` verifies that against the model's own ``apply_rotary_pos_emb`` before a method relies on it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel


class Rotary:
    """cos/sin for a layer from the model's rotary module (with the layer's type where it takes one)."""

    def __init__(self, module: torch.nn.Module, layer_type: str | None) -> None:
        self.module = module
        takes_type = "layer_type" in inspect.signature(module.forward).parameters
        self.extra = {"layer_type": layer_type} if takes_type else {}

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` of any shape ``[b, ...]``, shaped ``[b, ..., rotary_dim]``."""
        flat = positions.reshape(positions.shape[0], -1)
        cos, sin = self.module(like, flat, **self.extra)
        shape = (*positions.shape, cos.shape[-1])
        return cos.reshape(shape).to(like.dtype), sin.reshape(shape).to(like.dtype)

    def frequencies(self) -> tuple[torch.Tensor, float] | None:
        """The module's current inverse frequencies ``[rotary_dim / 2]`` (float32) and cos/sin scale,
        or None when it keeps them elsewhere. A module may update them for the length it last saw
        (dynamic RoPE): read after a prefill, they are the prefill's."""
        prefix = f"{self.extra['layer_type']}_" if self.extra else ""
        inv_freq = getattr(self.module, f"{prefix}inv_freq", None)
        scale = getattr(self.module, f"{prefix}attention_scaling", None)
        if not isinstance(inv_freq, torch.Tensor) or scale is None:
            return None
        return inv_freq.float(), float(scale)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., rotary_dim]`` of ``positions`` as transformers' rotary modules compute them
    (the angle ``position * inv_freq`` in float32, each frequency twice, times ``scale``)."""
    angle = positions[..., None].float() * inv_freq
    angle = torch.cat([angle, angle], dim=-1)
    return (angle.cos() * scale).to(dtype), (angle.sin() * scale).to(dtype)


def rotary_for(model: PreTrainedModel, layer_idx: int) -> Rotary | None:
    """The rotary embedding that layer ``layer_idx`` of ``model`` uses, or None without RoPE."""
    modules = [m for m in model.modules() if "Rotary" in type(m).__name__ and hasattr(m, "forward")]
    if len(modules) != 1:
        return None
    return Rotary(modules[0], layer_type(model.config, layer_idx))


def rotary_from_config(config: PretrainedConfig, layer_idx: int) -> Rotary | None:
    """The rotary embedding layer ``layer_idx`` of a model with ``config`` uses, built from transformers' own
    rotary class for the model type, for code that sees the model's keys but not the model (vLLM's attention
    backend); None where transformers has no single such class for it."""
    text = config.get_text_config()
    kind = text.model_type.replace("-", "_")
    try:
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    except ImportError:
        return None
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and c.__module__ == module.__name__ and c.__name__.endswith("RotaryEmbedding")
    ]
    if len(classes) != 1:
        return None
    return Rotary(classes[0](text), layer_type(config, layer_idx))


def layer_type(config: PretrainedConfig, layer_idx: int) -> str | None:
    """The type of layer ``layer_idx`` (``sliding_attention``, ...) where the config gives types, which a
    rotary module may take (Gemma 3: a rotary per type)."""
    types = getattr(config.get_text_config(), "layer_types", None)
    return types[layer_idx] if types else None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., seq, d]``) by its positions' angles; cos/sin broadcast against ``x``."""
    rot = cos.shape[-1]
    turned = x[..., :rot] * cos + rotate_half(x[..., :rot]) * sin
    return turned if rot == x.shape[-1] else torch.cat([turned, x[..., rot:]], dim=-1)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo ``apply_rope`` exactly (up to rounding): rotate back and remove any scaling of cos/sin."""
    rot = cos.shape[-1]
    part = x[..., :rot]
    back = (part * cos - rotate_half(part) * sin) / (cos * cos + sin * sin)
    return back if rot == x.shape[-1] else torch.cat([back, x[..., rot:]], dim=-1)


def check_rope(model: PreTrainedModel, layer_idx: int, head_dim: int) -> str | None:
    """None if ``apply_rope`` reproduces the model's own rotary embedding for layer ``layer_idx``,
    else why not (no rotary module, no ``apply_rotary_pos_emb`` to compare with, or a mismatch)."""
    rotary = rotary_for(model, layer_idx)
    if rotary is None:
        return "it has no single rotary-embedding module (no RoPE, or several)"
    attention = next(
        m for m in model.modules() if getattr(m, "layer_idx", None) == layer_idx and hasattr(m, "head_dim")
    )
    return rope_problem(
        rotary,
        getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None),
        head_dim,
        next(model.parameters()).device,
    )


def check_rope_config(config: PretrainedConfig, layer_idx: int) -> str | None:
    """``check_rope`` for a model known only by its ``config`` (vLLM's server): transformers' own rotary class and
    ``apply_rotary_pos_emb`` for its model type, compared on the CPU."""
    text = config.get_text_config()
    rotary = rotary_from_config(config, layer_idx)
    if rotary is None:
        return "transformers has no single rotary class for it (no RoPE, or several)"
    kind = text.model_type.replace("-", "_")
    apply = getattr(
        importlib.import_module(f"transformers.models.{kind}.modeling_{kind}"), "apply_rotary_pos_emb", None
    )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return rope_problem(rotary, apply, head_dim, torch.device("cpu"))


def rope_problem(rotary: Rotary, apply: Any, head_dim: int, device: torch.device) -> str | None:
    """None if ``apply_rope`` with ``rotary``'s cos/sin gives what the model's ``apply_rotary_pos_emb`` (``apply``)
    gives, and cos/sin can be rebuilt from its frequencies; else why not."""
    if apply is None:
        return "its attention module has no apply_rotary_pos_emb to compare with"
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 5, head_dim, generator=generator).to(device, torch.float32)
    positions = torch.tensor([[0, 1, 7, 300, 4000]], device=device)
    cos, sin = rotary.cos_sin(positions, keys)
    try:
        expected = apply(keys, keys, cos.float(), sin.float())[1]
    except (TypeError, RuntimeError) as error:
        return f"its apply_rotary_pos_emb could not be called the usual way ({error})"
    if not torch.allclose(apply_rope(keys, cos[:, None].float(), sin[:, None].float()), expected, atol=1e-4, rtol=1e-4):
        return "its rotary embedding is not the rotate-half form kvcompress can invert"
    frequencies = rotary.frequencies()
    if frequencies is None:
        return "its rotary module keeps no inv_freq / attention_scaling to rotate rebuilt keys with"
    again = rope_cos_sin(positions, *frequencies, torch.float32)
    if not all(torch.allclose(ours, theirs.float(), atol=1e-5, rtol=1e-5) for ours, theirs in zip(again, (cos, sin))):
        return "its rotary module's cos/sin are not cos/sin(position * inv_freq) * attention_scaling"
    return None
