"""The only place that touches transformers internals.

kvcompress plugs in through two public extension points:

* ``AttentionInterface``: an attention implementation named ``"kvcompress"`` (torch SDPA underneath).
  When the keys it receives come from a ``KVCompressCache`` layer, it builds the mask from the
  cache's own slot validity (compressed slots no longer line up with transformers' logical mask),
  runs attention, then hands the post-RoPE queries to the layer, which compresses itself at the end
  of prefill. For any other cache it is plain SDPA, so the model behaves as before.
* ``AttentionMaskInterface``: the same name is given SDPA's mask builder, so the padding mask for
  the new tokens still reaches the attention function.

The cache layer announces itself in ``update`` (called by every attention module right before its
attention function) and the attention function checks, by tensor identity, that the keys it got
are the ones that layer returned.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .cache import CompressedLayer, UnsupportedModelError, take_announced

IMPLEMENTATION = "kvcompress"


def _layer_for(module: torch.nn.Module, key: torch.Tensor) -> CompressedLayer | None:
    """The kvcompress cache layer this attention call works for, or None for any other cache."""
    layer, keys = take_announced()
    if layer is None:
        return None
    if keys is not key or getattr(module, "layer_idx", layer.layer_idx) != layer.layer_idx:
        raise UnsupportedModelError(
            f"kvcompress: {type(module).__name__} passed attention keys that are not the ones its cache layer "
            "returned; this attention layout is not supported"
        )
    return layer


def new_token_validity(attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """``[batch, q_len]`` bool: which new tokens are real, read from the last query row of the
    boolean 4-D mask (with left padding the last token of every row is real)."""
    if attention_mask is None:
        return None
    return attention_mask[:, 0, -1, -q_len:].bool()


def build_mask(layer: CompressedLayer, attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
    """Boolean mask ``[batch, 1, q_len, kv_len]`` over the layer's slots, or None when plain causal
    attention over everything is right. Every query may at least see itself, so padding queries
    never produce NaNs."""
    old = kv_len - q_len
    if attention_mask is None and layer.valid is None and (q_len == 1 or old == 0):
        return None
    device = layer.keys.device
    batch = layer.keys.shape[0]
    if attention_mask is not None:
        new = attention_mask[:, :, :, -q_len:].bool()
    else:
        new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()[None, None].expand(batch, 1, -1, -1)
    new = new | torch.eye(q_len, dtype=torch.bool, device=device)
    past = layer.slot_validity()[:, :old][:, None, None, :].expand(-1, 1, q_len, -1)
    return torch.cat([past, new.expand(batch, 1, -1, -1)], dim=-1)


def kvcompress_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA over a kvcompress cache layer (then let the layer compress), or plain SDPA otherwise."""
    layer = _layer_for(module, key)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q_len = query.shape[-2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.attend(query, key, value, build_mask(layer, attention_mask, q_len, key.shape[-2]), scaling)
    layer.commit(query, new_token_validity(attention_mask, q_len), scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, kvcompress_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def check_model(model: PreTrainedModel) -> None:
    """Raise ``UnsupportedModelError`` (naming the class) for models kvcompress cannot drive."""
    name = type(model).__name__
    if not any("Rotary" in type(m).__name__ for m in model.modules()):
        raise UnsupportedModelError(
            f"kvcompress: {name} has no rotary position embedding; supported models use RoPE attention "
            "(Llama, Mistral, Qwen2, ... causal LMs)"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"kvcompress: {name} does not dispatch attention through transformers' AttentionInterface; "
            "its attention layout is not supported"
        )
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim")]
    if len(attention) != model.config.get_text_config().num_hidden_layers:
        raise UnsupportedModelError(
            f"kvcompress: {name} has {len(attention)} attention modules with a layer index for "
            f"{model.config.get_text_config().num_hidden_layers} layers; unsupported attention layout"
        )


def attach(model: PreTrainedModel) -> None:
    """Check ``model`` and switch it to the ``"kvcompress"`` attention implementation (idempotent).

    For caches that are not kvcompress caches it computes exactly what ``"sdpa"`` computes."""
    check_model(model)
    _register()
    if model.config._attn_implementation != IMPLEMENTATION:
        model.set_attn_implementation(IMPLEMENTATION)
