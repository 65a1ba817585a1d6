"""The prompts a vLLM worker finishes in one step, scored and selected together: those that share a method become one
batch, right-aligned as the library's batches are (each prompt's padding before it, marked invalid), scored by the
method's own ``layer_scores`` and chosen by the library's ``select_kept``, one call each per layer rather than one per
request. Imports no vLLM: the worker (``vllm_plugin``) hands it tensors."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..integrations.transformers.rope import Rotary
from ..methods.base import Method
from ..methods.prompt import select_kept
from ..storage.attention import scoring_sinks
from .settings import PromptLayer


@dataclasses.dataclass
class Finishing:
    """One request's whole prompt in one layer at the end of its prefill: its keys and values ``[tokens, kv_heads,
    dim]``, the last queries its method reads ``[m, q_heads, dim]``, its word spans ``[1, tokens]`` (None: its
    method reads none), its tokens from where it says its question begins (None: it says nothing), and the tokens
    each KV head keeps."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    spans: torch.Tensor | None
    asked: int | None
    kept: int


def right_aligned(parts: list[torch.Tensor], length: int) -> torch.Tensor:
    """``[tokens, heads, dim]`` tensors as one ``[b, heads, length, dim]`` batch, each padded with zeros before it (one
    that needs no padding: a view, not a copy)."""
    if len(parts) == 1 and parts[0].shape[0] == length:
        return parts[0].transpose(0, 1)[None]
    return torch.stack([F.pad(part, (0, 0, 0, 0, length - part.shape[0], 0)).transpose(0, 1) for part in parts])


def kept_together(method: Method, prompts: list[Finishing], scaling: float, rotary: Rotary | None,
                  sinks: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each prompt's kept positions ``[kv_heads, kept]`` (ascending within each head), ``prompts`` (one method's, and
    all saying where their question begins or none) scored as one batch; ``sinks``: the layer's learned sinks, which
    take their share of the scorer's softmax as in the library."""
    width = max(prompt.keys.shape[0] for prompt in prompts)
    pads = torch.tensor([width - prompt.keys.shape[0] for prompt in prompts])
    valid = torch.arange(width)[None, :] >= pads[:, None]
    depth = max(prompt.queries.shape[0] for prompt in prompts)
    spans = None if prompts[0].spans is None else torch.cat(  # (span 0: the padding's own)
        [F.pad(prompt.spans + 1, (int(pad), 0)) for prompt, pad in zip(prompts, pads)])
    asked = None if prompts[0].asked is None else torch.tensor([prompt.asked for prompt in prompts])
    keys, values = (right_aligned([getattr(prompt, name) for prompt in prompts], width) for name in ("keys", "values"))
    layer = PromptLayer(keys, values, spans, rotary, asked, valid if bool(pads.any()) else None)
    with scoring_sinks(sinks):
        scores = method.layer_scores(layer, right_aligned([p.queries for p in prompts], depth), scaling)
    kept, _ = select_kept(scores, valid, torch.tensor([prompt.kept for prompt in prompts]))  # [b, kv_heads, n]
    return [kept[row, :, kept.shape[-1] - prompt.kept :] - pads[row] for row, prompt in enumerate(prompts)]
