"""The only place that touches transformers internals: how a ``KVCompressCache`` plugs into a model.

kvcompress uses three public extension points:

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

from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from ...cache.errors import CacheMisuseError, UnsupportedModelError
from ...cache.kv_cache import KVCompressCache, LayerFactory, cache_argument
from ...cache.layer import KVLayer, WindowLayer, give_codec, take_announced
from ...cache.tokens import TokenSpans, spans_for
from ...storage import attention
from ...storage.attention import dense_attention
from . import longprompt
from .longprompt import LazyMask, block_prefills, chunk_mlps, lazy_sdpa_mask

IMPLEMENTATION = "kvcompress"



def attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's attention modules, by layer index."""
    found = {
        m.layer_idx: m
        for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim") and isinstance(m.layer_idx, int)
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
            "not supported")
    refusals = (
        (getattr(config, "attention_chunk_size", None)
         is not None, f"chunked attention (attention_chunk_size={getattr(config, 'attention_chunk_size', None)})"),
        (getattr(config, "kv_lora_rank", None) is not None, "multi-head latent attention (kv_lora_rank)"),
    )
    for refused, what in refusals:
        if refused:
            raise UnsupportedModelError(f"kvcompress: {name} uses {what}, which kvcompress does not support")


def make_cache(method: LayerFactory, model: PreTrainedModel,
               tokenizer: PreTrainedTokenizerBase | TokenSpans | None = None) -> KVCompressCache:
    """A ``KVCompressCache`` applying ``method`` to ``model``: checks both, switches the model to the
    ``"kvcompress"`` attention implementation (idempotent) and builds one layer per model layer;
    sliding-window layers keep their window whatever the method. ``tokenizer`` gives the cache the
    prompt's word boundaries (``tokens.TokenSpans``); methods that need them load the model's own
    tokenizer from disk when it is not given."""
    attach(model)
    method.check_model(model)
    if has_sinks(model) and not method.attends_slots():
        raise UnsupportedModelError(
            f"kvcompress: {type(model).__name__} uses learned attention sinks (a per-head logit in every softmax), "
            f"which {method.describe()} cannot carry: its decoding steps attend gathered chunks or per-head segments; "
            "use a prompt method with heads='uniform' and layers other than 'global' (snapkv, streamingllm, h2o, "
            "expected, kvzip:layers=uniform) or full")
    if tokenizer is None and method.needs_tokens():
        tokenizer = local_tokenizer(model, method)
    layers: list[KVLayer] = []
    for index, (module, window) in enumerate(zip(attention_modules(model), layer_windows(model))):
        layer = WindowLayer(index, window) if window is not None else method.make_layer(index, model)
        layer.module_id, layer.sinks = id(module), getattr(module, "sinks", None)
        give_codec(layer, method.kv_codec(), module.head_dim, model.dtype)
        layers.append(layer)
    return KVCompressCache(method, layers, model, spans=spans_for(tokenizer) if tokenizer is not None else None)


def has_sinks(model: torch.nn.Module) -> bool:
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
            f"found for model {source!r} on this machine; pass it: method.make_cache(model, tokenizer)") from None


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
        model._kvcompress_input_check = True


def _cache_of(args: tuple, kwargs: dict) -> KVCompressCache | None:
    cache = cache_argument(kwargs)
    return cache if isinstance(cache, KVCompressCache) else next(
        (a for a in args if isinstance(a, KVCompressCache)), None)


def end_call(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """The model's call is over: its cache takes no more steps until the next call is checked (``check_inputs``)."""
    cache = _cache_of(args, kwargs)
    if cache is not None and not torch.compiler.is_compiling():
        cache.checked_call = None


def check_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse, before the model runs, inputs a kvcompress cache cannot take; then let the cache take this call's
    steps (a model kvcompress never prepared calls no hook, and its first step is refused:
    ``KVCompressCache.update``)."""
    cache = _cache_of(args, kwargs)
    if cache is None or torch.compiler.is_compiling():  # a compiled step's loop checked before it
        return
    cache.checked_call = None
    cache.check_model(module, "make a cache for this model with method.make_cache(model)")
    _refuse_inputs(cache, args, kwargs)
    cache.checked_call = id(module)


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
                "needs a new cache (method.make_cache(model))" if seen else " (an empty prompt)"
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
            "prompt needs a new cache (method.make_cache(model))")
    positions = kwargs.get("position_ids")
    if new > 1 and positions is not None:  # several new tokens: a new turn, or a new prompt by mistake
        rows = positions.shape[-2] if positions.dim() > 1 else 1
        padded = isinstance(mask, torch.Tensor) and mask.dim() == 2
        real = mask[:, :seen].sum(-1) if padded else torch.full((rows,), seen, device=positions.device)
        new_real = mask[:, -new:].sum(-1) if padded else torch.full_like(real, new)
        last = positions[..., -1].reshape(-1, real.shape[0]).amax(0) if positions.dim() > 2 else positions[:, -1]
        # one check per turn, not per step
        if bool(((new_real > 0) & (last.to(real.device) != real + new_real - 1)).any()):
            raise CacheMisuseError(
                f"kvcompress: this cache already holds {seen} tokens but the {new} new tokens do not continue them "
                f"(their positions end at {last.tolist()}); generate() with a used cache feeds only the tokens beyond "
                "what it holds, so a new prompt needs a new cache (method.make_cache(model)); to continue a "
                "conversation, pass all of it")


def _layer_for(module: torch.nn.Module, key: torch.Tensor) -> KVLayer | None:
    """The kvcompress cache layer this attention call works for, or None for any other cache."""
    layer, keys = take_announced()
    if layer is None:
        return None
    if keys is not key or getattr(module, "layer_idx", layer.layer_idx) != layer.layer_idx:
        raise UnsupportedModelError(
            f"kvcompress: {type(module).__name__} passed attention keys that are not the ones its cache layer "
            "returned; this attention layout is not supported")
    if layer.module_id is not None and layer.module_id != id(module):
        layer.step_open = False
        raise CacheMisuseError(
            f"kvcompress: this cache was made for another model (layer {layer.layer_idx} belongs to a different "
            "attention module); make a cache for this model with method.make_cache(model)")
    return layer


def new_token_validity(attention_mask: torch.Tensor | LazyMask | None, q_len: int) -> torch.Tensor | None:
    """``[batch, q_len]`` bool: which new tokens are real. A token sees itself unless it is padding,
    so this is the diagonal of the newest block of the boolean 4-D mask."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, LazyMask):
        return attention_mask.diagonal(q_len)
    if q_len == 1:  # [b, 1, 1, kv]: the last element
        real = attention_mask.view(-1, 1) if attention_mask.shape[-1] == 1 else attention_mask.flatten(1)[:, -1:]
    else:
        real = attention_mask[:, 0, -q_len:, -q_len:].diagonal(dim1=-2, dim2=-1)
    return real if real.dtype == torch.bool else real.bool()


def mask_block(attention_mask: torch.Tensor | LazyMask | None, q_len: int, kv_len: int, sliding_window: int | None,
               rows: tuple[int, int], columns: tuple[int, int]) -> torch.Tensor:
    """Boolean mask ``[batch | 1, 1, rows, columns]``: rows ``rows`` of the ``q_len`` new queries,
    which are the newest of ``kv_len`` keys, against keys ``columns`` (padding, causality, a sliding
    window), from transformers' mask (its newest rows and columns). Every query sees itself, so
    padding never gives NaNs."""
    (first, last), (start, end) = rows, columns
    device = attention_mask.device if attention_mask is not None else None
    query_index = torch.arange(first, last, device=device)[:, None] + (kv_len - q_len)
    key_index = torch.arange(start, end, device=device)[None, :]
    if isinstance(attention_mask, LazyMask):
        top, left = attention_mask.q_length - q_len, attention_mask.kv_length - kv_len
        block = attention_mask.block(top + first, top + last, left + start, left + end)
    elif attention_mask is not None:
        top, left = attention_mask.shape[2] - q_len, attention_mask.shape[3] - kv_len
        block = attention_mask[:, :, top + first : top + last, left + start : left + end].bool()
    else:
        block = (key_index <= query_index)[None, None]
        if sliding_window is not None:
            block = block & (key_index > query_index - sliding_window)[None, None]
    return block | (key_index == query_index).to(block.device)[None, None]


def new_block(attention_mask: torch.Tensor | LazyMask | None, q_len: int,
              sliding_window: int | None) -> torch.Tensor | None:
    """Boolean mask ``[batch, 1, q_len, q_len]`` of the new queries against the new tokens, from the
    newest block of transformers' mask; None when that is plain causal."""
    if attention_mask is None and (sliding_window is None or q_len <= sliding_window):
        return None
    return mask_block(attention_mask, q_len, q_len, sliding_window, (0, q_len), (0, q_len))


def attend_prompt(
    layer: KVLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | LazyMask | None, sliding_window: int | None, scaling: float, softcap: float | None
) -> torch.Tensor:
    """A prefill's attention: the new queries are the newest of the prompt's keys so far (the whole
    prompt, or a block of it: ``longprompt.BlockedPrefill``). Plain causal attention is one call
    (SDPA's causal kernel, or its lower-right causal bias for a block on a GPU; on a CPU, which would
    build that bias as a mask, two flash calls merged: ``attention.after_prompt_with_lse``); otherwise
    blocks of queries, each with its block of the mask over the keys it can see: no ``prompt x prompt``
    tensor is built."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if attention_mask is None and (sliding_window is None or kv_len <= sliding_window) and softcap is None:
        if q_len == kv_len:
            return layer.attend(query, key, value, None, scaling, softcap)
        if query.is_cuda:
            return layer.attend(query, key, value, causal_lower_right(q_len, kv_len), scaling, softcap)
        # a CPU kernel would build that bias as a q x kv mask, and a masked call is slower:
        if query.device.type == "cpu":
            # the older keys unmasked, the block causal
            return attention.after_prompt_with_lse(query, key, value, scaling)[0]
    out = torch.empty_like(query)
    blocks = mask_blocks(attention_mask, q_len, kv_len, key.shape[0], sliding_window, longprompt.BLOCK_ELEMENTS)
    for (first, last), (start, end), mask in blocks:
        out[:, :, first:last] = layer.attend(query[:, :, first:last], key[:, :, start:end], value[:, :, start:end],
                                             mask, scaling, softcap)
    return out


def attend_observed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | LazyMask | None,
    scaling: float, softcap: float | None, padded: bool, sliding_window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An observation pass's attention (its tokens just after the prompt's, attended, never stored) and
    each query's log-normaliser ``[b, q_heads, q]``, which the method scores with. Without padding or a window that cuts
    the keys, on a CPU, two unmasked flash calls; otherwise blocks of queries, each with its mask as a float bias (a
    quarter of the booleans a prefill's block may build)."""
    uncut = sliding_window is None or key.shape[-2] <= sliding_window
    if not padded and softcap is None and query.device.type == "cpu" and uncut:
        return attention.after_prompt_with_lse(query, key, value, scaling)
    return blocks_with_lse(query, key, value, attention_mask, sliding_window, scaling, softcap)


def blocks_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | LazyMask | None,
    sliding_window: int | None, scaling: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new queries' attention (the newest of the keys) and each query's log-normaliser, a block of
    queries at a time, each with its mask as a float bias (a quarter of the booleans a prefill's block may build)."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    out, lse = torch.empty_like(query), query.new_empty(query.shape[:-1], dtype=torch.float32)
    blocks = mask_blocks(attention_mask, q_len, kv_len, key.shape[0], sliding_window, longprompt.BLOCK_ELEMENTS // 4)
    for (first, last), (start, end), mask in blocks:
        out[:, :, first:last], lse[:, :, first:last] = attention.attention_with_lse(
            query[:, :, first:last], key[:, :, start:end], value[:, :, start:end], mask, scaling, softcap
        )
    return out, lse


def mask_blocks(attention_mask: torch.Tensor | LazyMask | None, q_len: int, kv_len: int, batch: int,
                sliding_window: int | None,
                elements: int) -> Iterator[tuple[tuple[int, int], tuple[int, int], torch.Tensor]]:
    """Blocks of the ``q_len`` new queries (the newest of ``kv_len`` keys), each with at most ``elements``
    mask elements: its rows, the keys its queries can see, and its boolean mask over them."""
    rows = max(1, elements // (batch * kv_len))
    for first in range(0, q_len, rows):
        last = min(q_len, first + rows)
        end = kv_len - q_len + last  # the keys up to the block's last query
        # older keys are out of every window
        start = max(0, kv_len - q_len + first - sliding_window + 1) if sliding_window is not None else 0
        yield (first, last), (start, end), mask_block(attention_mask, q_len, kv_len, sliding_window, (first, last),
                                                      (start, end))


def kvcompress_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None, **kwargs
) -> tuple[torch.Tensor, None]:
    """Attention over a kvcompress cache layer (then commit the step), or plain SDPA otherwise."""
    layer = _layer_for(module, key)
    sinks = kwargs.pop("s_aux", None)  # learned sink logits (gpt-oss): one more term in each softmax's denominator
    if layer is None and isinstance(attention_mask, LazyMask):
        attention_mask = attention_mask.materialize()  # another cache: SDPA as usual
    if layer is None and sinks is not None:  # the same math as the model's own eager attention
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out, lse = blocks_with_lse(query, key, value, attention_mask, sliding_window, scale, softcap)
        return attention.with_sinks(out, lse, sinks).transpose(1, 2).contiguous(), None
    if layer is None:
        if softcap is not None:  # SDPA has no soft-capping: the same math, spelled out
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            mask = None if attention_mask is None else attention_mask.bool()
            return dense_attention(query, key, value, mask, scale, softcap).transpose(1, 2).contiguous(), None
        with attention.chosen_kernels(query, key, attention_mask):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          sliding_window=sliding_window, **kwargs)
    expected = layer.window if isinstance(layer, WindowLayer) else None
    if sliding_window != expected:
        raise UnsupportedModelError(
            f"kvcompress: layer {layer.layer_idx} attends with sliding_window={sliding_window} but its cache layer was "
            f"built for {expected}; this model's per-layer attention pattern is not supported")
    q_len = query.shape[-2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    lse, new_valid = None, new_token_validity(attention_mask, q_len)
    if layer.observing:
        padded = new_valid is not None and not bool(new_valid.all()) or not bool(layer.slot_validity().all())
        out, lse = attend_observed(query, key, value, attention_mask, scaling, softcap, padded, sliding_window)
        if sinks is not None:
            out, lse = attention.with_sinks(out, lse, sinks), attention.sink_normaliser(lse, sinks)
    elif layer.is_prefill:  # the new tokens are the newest of the prompt's
        joined = layer.intake.joined_valid  # over a stored context: its slots, rows aligned, not transformers' columns
        if joined is not None:
            attention_mask = longprompt.continued_mask(joined, q_len)
        if sinks is not None:  # the same attention with each query's normaliser, for the sink's share
            out = attention.with_sinks(
                *blocks_with_lse(query, key, value, attention_mask, sliding_window, scaling, softcap), sinks)
        else:
            out = attend_prompt(layer, query, key, value, attention_mask, sliding_window, scaling, softcap)
    else:  # a later step over the layer's slots
        block = new_block(attention_mask, q_len, sliding_window) if q_len > 1 else None  # one query sees itself
        out = layer.attend_step(query, key, value, block, scaling, softcap, sinks)
    layer.commit(query, new_valid, scaling, lse)
    return out.transpose(1, 2).contiguous(), None
