"""The only place that touches transformers internals: how a ``KVCompressCache`` plugs into a model.

kvcompress uses four public extension points:

* ``AttentionInterface``: an attention implementation named ``"kvcompress"`` (torch SDPA underneath).
  When the keys it receives come from a kvcompress cache layer, it builds the mask from the layer's
  own slot validity (compressed slots no longer line up with transformers' logical mask), lets the
  layer attend, then commits the step, which compresses the layer at the end of its prefill. For
  any other cache it is plain SDPA, so the model behaves as before.
* ``AttentionMaskInterface``: the same name gets SDPA's mask builder, so the padding (and sliding
  window) mask of the new tokens still reaches the attention function; a mask that would be large
  (a padded or sliding-window prefill) comes as a ``longprompt.LazyMask`` and the prefill attention
  runs in blocks of queries, each with its block of the mask.
* wrapping modules: each decoder layer's MLP runs long sequences in chunks (``longprompt.SequenceChunked``).
* a forward pre-hook on the model, which refuses inputs a cache cannot take (an empty prompt, a new
  prompt on a cache that already holds one) before they fail deep inside the model.

A cache layer announces itself in ``update`` (called by every attention module right before its
attention function); the attention function checks, by tensor identity, that the keys it got are
the ones that layer returned, and that the module is the one the cache was made for.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from transformers import AttentionInterface, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from ...cache.errors import CacheMisuseError, UnsupportedModelError
from ...cache.kv_cache import KVCompressCache, LayerFactory, cache_argument
from ...cache.layer import KVLayer, WindowLayer, take_announced
from ...cache.tokens import TokenSpans, spans_for
from ...storage import attention, kernel_choice
from ...storage.attention import dense_attention
from . import longprompt
from .longprompt import LazyMask, block_prefills, chunk_mlps, lazy_sdpa_mask
from .masks import Mask, ModelMasks

IMPLEMENTATION = "kvcompress"


def attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's attention modules, by layer index."""
    found = {
        m.layer_idx: m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "head_dim") and isinstance(m.layer_idx, int)
    }
    return [found[i] for i in sorted(found)]


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as the model's attention modules use it."""
    config = model.config.get_text_config()
    default = getattr(config, "sliding_window", None)
    return [getattr(module, "sliding_window", default) for module in attention_modules(model)]


def check_model(model: PreTrainedModel) -> None:
    """Raise ``UnsupportedModelError`` (naming the model and the setting) for what kvcompress cannot drive.

    Supported: any decoder whose attention dispatches through ``AttentionInterface`` with one cache
    layer per attention module, including sliding-window layers (kept as windows), logit
    soft-capping (Gemma 2) and models without RoPE. Refused: the variants below."""
    name = type(model).__name__
    config = model.config.get_text_config()
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"kvcompress: {name} does not dispatch attention through transformers' AttentionInterface; its attention "
            "layout is not supported"
        )
    modules = attention_modules(model)
    if len(modules) != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"kvcompress: {name} has {len(modules)} attention modules with a layer index for "
            f"{config.num_hidden_layers} layers; models with other layer kinds (linear attention, shared KV, ...) are "
            "not supported"
        )
    refusals = (
        (
            getattr(config, "attention_chunk_size", None) is not None,
            f"chunked attention (attention_chunk_size={getattr(config, 'attention_chunk_size', None)})",
        ),
        (getattr(config, "kv_lora_rank", None) is not None, "multi-head latent attention (kv_lora_rank)"),
    )
    for refused, what in refusals:
        if refused:
            raise UnsupportedModelError(f"kvcompress: {name} uses {what}, which kvcompress does not support")


def make_cache(
    method: LayerFactory, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | TokenSpans | None = None
) -> KVCompressCache:
    """A ``KVCompressCache`` applying ``method`` to ``model``: checks both, switches the model to the
    ``"kvcompress"`` attention implementation (idempotent) and builds one layer per model layer;
    sliding-window layers keep their window whatever the method. ``tokenizer`` gives the cache the
    prompt's word boundaries (``tokens.TokenSpans``); methods that need them load the model's own
    tokenizer from disk when it is not given."""
    attach(model)
    method.check_model(model)
    if has_sinks(model) and not method.attends_slots():
        raise UnsupportedModelError(
            "kvcompress: {model} uses learned attention sinks (a per-head logit in every softmax), which {method} "
            "cannot carry: its decoding steps attend gathered chunks or per-head segments; use a prompt method with "
            "{heads='uniform'} and {layers!n} other than 'global' (snapkv, streamingllm, h2o, expected, "
            "kvzip:layers=uniform) or full",
            model=type(model).__name__,
            method=method.describe(),
        )
    if tokenizer is None and method.needs_tokens():
        tokenizer = local_tokenizer(model, method)
    layers: list[KVLayer] = []
    for index, (module, window) in enumerate(zip(attention_modules(model), layer_windows(model))):
        layer = WindowLayer(index, window) if window is not None else method.make_layer(index, model)
        layer.attention_module, layer.sinks = weakref.ref(module), getattr(module, "sinks", None)
        head_dim = cast(int, module.head_dim)  # (a module attribute: typed as a tensor or module)
        layer.kv_codec = method.storage_codec(head_dim, model.dtype, turned=True if window is not None else None)
        layers.append(layer)
    return KVCompressCache(method, layers, model, spans=spans_for(tokenizer) if tokenizer is not None else None)


def has_sinks(model: PreTrainedModel) -> bool:
    """Whether the model's attention modules hold learned sink logits (gpt-oss's ``sinks``)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in attention_modules(model))


def local_tokenizer(model: PreTrainedModel, method: LayerFactory) -> PreTrainedTokenizerBase:
    """The model's tokenizer from its local folder or cache (never downloaded), for methods that need word
    boundaries."""
    source = getattr(model.config, "_name_or_path", "") or ""
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError):
        raise UnsupportedModelError(
            f"kvcompress: {method.describe()} needs the tokenizer to find word and number boundaries, and none was "
            f"found for model {source!r} on this machine; pass it: method.make_cache(model, tokenizer)"
        ) from None


def attach(model: PreTrainedModel) -> None:
    """Check ``model``, register the attention implementation and switch the model to it (idempotent).

    For caches that are not kvcompress caches it computes exactly what ``"sdpa"`` computes."""
    check_model(model)
    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, kvcompress_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, lazy_sdpa_mask)
    if model.config._attn_implementation != IMPLEMENTATION:
        model.set_attn_implementation(IMPLEMENTATION)
    block_prefills(model, longprompt.PREFILL_BLOCK)
    chunk_mlps(model, longprompt.MLP_CHUNK)
    if not getattr(model, "_kvcompress_input_check", False):
        model.register_forward_pre_hook(check_inputs, with_kwargs=True)
        model.register_forward_hook(end_call, with_kwargs=True)
        model._kvcompress_input_check = True  # type: ignore[assignment]  # (nn.Module types attributes as modules)


def _cache_of(args: tuple, kwargs: dict) -> KVCompressCache | None:
    cache = cache_argument(kwargs)
    return (
        cache if isinstance(cache, KVCompressCache) else next((a for a in args if isinstance(a, KVCompressCache)), None)
    )


def end_call(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """The model's call is over: its cache takes no more steps until the next call is checked (``check_inputs``),
    and layers that held their prompts only for every layer to be scored together compress."""
    cache = _cache_of(args, kwargs)
    if cache is not None and not torch.compiler.is_compiling():
        cache.call_checked = False
        cache.compress_waiting()


def check_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse, before the model runs, inputs a kvcompress cache cannot take; then let the cache take this call's
    steps (a model kvcompress never prepared calls no hook, and its first step is refused:
    ``KVCompressCache.update``)."""
    cache = _cache_of(args, kwargs)
    if cache is None or torch.compiler.is_compiling():  # a compiled step's loop checked before it
        return
    cache.call_checked = False
    cache.check_model(module, "make a cache for this model with method.make_cache(model)")
    _refuse_inputs(cache, args, kwargs)
    cache.call_checked = True


def _refuse_inputs(cache: KVCompressCache, args: tuple, kwargs: dict) -> None:
    """Inputs the cache cannot take, refused before the model runs: no tokens, a mask that does not cover the cached
    tokens, new tokens whose positions do not continue them (a new prompt on a used cache)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    new = ids.shape[-1] if ids is not None else embeds.shape[1] if embeds is not None else None
    if new == 0:
        seen = cache.get_seq_length()
        raise CacheMisuseError(
            "kvcompress: the input has no tokens"
            + (
                f"; this cache already holds {seen} tokens, and generate() feeds only tokens beyond them: a new prompt "
                "needs a new cache (method.make_cache(model))"
                if seen
                else " (an empty prompt)"
            )
        )
    mask = kwargs.get("attention_mask")
    seen = cache.get_seq_length()
    if not seen:
        cache.note_prompt(ids)
    if not seen or new is None:
        return
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] != seen + new:
        raise CacheMisuseError(
            f"kvcompress: this cache already holds {seen} tokens, so the attention mask must cover them plus the {new} "
            f"new ones ({seen + new} columns) but it has {mask.shape[-1]}; to continue, pass the whole mask; a new "
            "prompt needs a new cache (method.make_cache(model))"
        )
    positions = kwargs.get("position_ids")
    if new > 1 and positions is not None:  # several new tokens: a new turn, or a new prompt by mistake
        rows = positions.shape[-2] if positions.dim() > 1 else 1
        padded = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        real = padded[:, :seen].sum(-1) if padded is not None else torch.full((rows,), seen, device=positions.device)
        new_real = padded[:, -new:].sum(-1) if padded is not None else torch.full_like(real, new)
        last = positions[..., -1].reshape(-1, real.shape[0]).amax(0) if positions.dim() > 2 else positions[:, -1]
        # one check per turn, not per step
        if bool(((new_real > 0) & (last.to(real.device) != real + new_real - 1)).any()):
            raise CacheMisuseError(
                f"kvcompress: this cache already holds {seen} tokens but the {new} new tokens do not continue them "
                f"(their positions end at {last.tolist()}); generate() with a used cache feeds only the tokens beyond "
                "what it holds, so a new prompt needs a new cache (method.make_cache(model)); to continue a "
                "conversation, pass all of it"
            )


def _layer_for(module: torch.nn.Module, key: torch.Tensor) -> KVLayer | None:
    """The kvcompress cache layer this attention call works for, or None for any other cache."""
    layer, keys = take_announced()
    if layer is None:
        return None
    if keys is not key or getattr(module, "layer_idx", layer.layer_idx) != layer.layer_idx:
        raise UnsupportedModelError(
            f"kvcompress: {type(module).__name__} passed attention keys that are not the ones its cache layer "
            "returned; this attention layout is not supported"
        )
    if layer.attention_module is not None and layer.attention_module() is not module:
        layer.open_step = None
        raise CacheMisuseError(
            f"kvcompress: this cache was made for another model (layer {layer.layer_idx} belongs to a different "
            "attention module); make a cache for this model with method.make_cache(model)"
        )
    return layer


def kvcompress_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a kvcompress cache layer by the step its ``update`` took (cache/steps.py), which then commits,
    or plain SDPA otherwise."""
    layer = _layer_for(module, key)
    sinks = kwargs.pop("s_aux", None)  # learned sink logits (gpt-oss): one more term in each softmax's denominator
    if layer is None:
        return _other_cache(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, sinks, **kwargs
        )
    expected = layer.window if isinstance(layer, WindowLayer) else None
    if sliding_window != expected:
        raise UnsupportedModelError(
            f"kvcompress: layer {layer.layer_idx} attends with sliding_window={sliding_window} but its cache layer was "
            f"built for {expected}; this model's per-layer attention pattern is not supported"
        )
    new, scaling = ModelMasks.of(attention_mask, query.shape[-2], sliding_window), _scale(scaling, query)
    step = layer.open_step
    if step is None:  # (update opens one right before its attention: a model calling attention without it)
        raise UnsupportedModelError(f"kvcompress: layer {layer.layer_idx}'s attention ran with no update before it")
    out, lse = step.attend(layer, query, key, value, new, scaling, softcap, sinks)
    layer.commit(query, new.valid, scaling, lse)
    return out.transpose(1, 2).contiguous(), None


def _other_cache(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Mask,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for any other cache: SDPA as the model's own, with the same math where SDPA has no term for a
    learned sink or soft-capping."""
    if isinstance(attention_mask, LazyMask):
        attention_mask = attention_mask.materialize()
    if sinks is not None:  # the same math as the model's own eager attention
        out, lse = ModelMasks(attention_mask, query.shape[-2], sliding_window).causal_with_lse(
            query, key, value, _scale(scaling, query), softcap
        )
        return attention.with_sinks(out, lse, sinks).transpose(1, 2).contiguous(), None
    if softcap is not None:  # SDPA has no soft-capping: the same math, spelled out
        mask = None if attention_mask is None else attention_mask.bool()
        out = dense_attention(query, key, value, mask, _scale(scaling, query), softcap)
        return out.transpose(1, 2).contiguous(), None
    with kernel_choice.chosen_kernels(query, key, attention_mask):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )


def _scale(scaling: float | None, query: torch.Tensor) -> float:
    """The attention's scale: the module's, or SDPA's default ``1 / sqrt(head_dim)``."""
    return scaling if scaling is not None else query.shape[-1] ** -0.5
