"""Long prompts with bounded memory: nothing in a prefill grows with prompt x prompt, prompt x
intermediate size or prompt x vocabulary.

* ``SequenceChunked`` wraps a decoder layer's MLP: a long sequence goes through it in chunks of
  ``tokens`` (the MLP is per token, so this is the same computation), so its intermediate tensors
  are ``tokens x intermediate`` instead of ``prompt x intermediate``. Its state-dict names and
  attributes stay those of the wrapped module.
* ``LazyMask`` stands for transformers' 4-D boolean mask when it would be large (a padded batch, a
  sliding window): the rule is kept (the 2-D padding, the offsets, the mask function) and blocks of
  it are built on demand, so a padded prefill never holds a ``prompt x prompt`` mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    padding_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

from ...cache.kv_cache import KVCompressCache, cache_argument

PREFILL_BLOCK = 8192  # prompt positions a decoder layer processes at once during a long prefill (BlockedPrefill)
MLP_CHUNK = 8192  # tokens an MLP processes at once during a long prefill
MASK_LIMIT = 1 << 24  # masks with more elements than this stay lazy (16M booleans)
BLOCK_ELEMENTS = 1 << 26  # mask elements built per block of queries (64M booleans)


class Wrapper(torch.nn.Module):
    """A module around another, invisible from outside: state-dict names and attributes stay the inner module's."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_state_dict_post_hook(_drop_inner_prefix)
        self.register_load_state_dict_pre_hook(_add_inner_prefix)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


class SequenceChunked(Wrapper):
    """A per-token module (a decoder layer's MLP) run over long sequences in chunks of ``tokens``."""

    def __init__(self, inner: torch.nn.Module, tokens: int) -> None:
        super().__init__(inner)
        self.tokens = tokens

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if hidden_states.dim() < 3 or hidden_states.shape[-2] <= self.tokens:
            return self.inner(hidden_states, *args, **kwargs)
        return torch.cat(
            [self.inner(part, *args, **kwargs) for part in hidden_states.split(self.tokens, dim=-2)], dim=-2
        )


class BlockedPrefill(Wrapper):
    """A decoder layer that runs a long prompt, a kvcompress cache's first fill, ``tokens`` positions at
    a time. A decoder layer works on each position alone except in its attention, which is causal: so
    each block, attending to the cache's keys so far, gives exactly its part of the layer's output,
    written over its own input (no later block reads an earlier position's hidden state): the prompt
    is held as one hidden-sized tensor, and the queries, rotated queries, attention output and MLP
    activations of one block only. The cache layer is told the prompt's length first
    (``KVLayer.expect_blocks``), so it writes each block's keys and values into one buffer and compresses
    after the last block. Only where no one else can see the hidden states: the model embedded the
    prompt itself, nothing is recorded (no hooks), no gradient. Anything else (a short input, another
    cache, decoding) passes through unchanged."""

    def __init__(self, inner: torch.nn.Module, layer_idx: int, tokens: int) -> None:
        super().__init__(inner)
        self.layer_idx, self.tokens = layer_idx, tokens
        self.signature = inspect.signature(inner.forward)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        bound = self.signature.bind(*args, **kwargs)
        arguments = {**bound.arguments, **bound.arguments.get("kwargs", {})}
        hidden, cache = next(iter(bound.arguments.values())), cache_argument(arguments)
        layer = cache.layers[self.layer_idx] if isinstance(cache, KVCompressCache) else None
        unseen = (
            cache is not None
            and getattr(cache, "embeds_itself", False)
            and not self.observed()
            and not torch.is_grad_enabled()
        )
        length = hidden.shape[1] if hidden.dim() == 3 else 0
        if layer is None or length <= self.tokens or not unseen or not layer.expect_blocks(length):
            return self.inner(*args, **kwargs)
        for start in range(0, length, self.tokens):
            end = min(length, start + self.tokens)
            block = self.signature.bind(*args, **kwargs)
            for name in list(block.arguments):
                block.arguments[name] = block_of(name, block.arguments[name], start, end, length)
            hidden[:, start:end] = self.inner(*block.args, **block.kwargs)
        return hidden

    def observed(self) -> bool:
        """Whether hooks watch this layer (recording hidden states, say), which blocks would cut up."""
        return any(m._forward_hooks or m._forward_pre_hooks for m in (self, self.inner)) or bool(
            torch.nn.modules.module._global_forward_hooks
        )


def block_of(name: str, value: Any, start: int, end: int, length: int) -> Any:
    """The part of a decoder layer's argument ``name`` that positions ``[start, end)`` of a
    ``length``-position prompt need: their hidden states, positions and rotary angles, and their rows
    of the mask over the keys up to ``end`` (causal: no later key is needed)."""
    if name == "kwargs":
        return {key: block_of(key, item, start, end, length) for key, item in value.items()}
    if name == "attention_mask":
        if isinstance(value, LazyMask):
            return LazyMask(
                value.batch_size, end - start, end, value.q_offset + start, value.kv_offset, value.rule, value.device
            )
        return value[:, :, start:end, :end] if isinstance(value, torch.Tensor) and value.dim() == 4 else value
    if isinstance(value, tuple):
        return tuple(block_of(name, item, start, end, length) for item in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-2] == length and name != "position_ids":
        return value[..., start:end, :]  # hidden states, rotary angles: [..., positions, features]
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == length:
        return value[..., start:end]  # position ids
    return value


def block_prefills(model: torch.nn.Module, tokens: int) -> int:
    """Wrap every decoder layer (the module right above an attention module with a ``layer_idx``)
    in ``BlockedPrefill``. Idempotent; returns how many are wrapped."""
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BlockedPrefill):
                child.tokens = tokens
                wrapped += 1
                continue
            attention = next(
                (
                    m
                    for m in child.children()
                    if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "head_dim")
                ),
                None,
            )
            if attention is not None and not isinstance(parent, BlockedPrefill):
                setattr(parent, name, BlockedPrefill(child, cast(int, attention.layer_idx), tokens))
                wrapped += 1
    return wrapped


def _drop_inner_prefix(module: torch.nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state if k.startswith(prefix + "inner.")]:
        state[prefix + key[len(prefix + "inner.") :]] = state.pop(key)


def _add_inner_prefix(module: torch.nn.Module, state: dict, prefix: str, *args: Any) -> None:
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + "inner.")]:
        state[prefix + "inner." + key[len(prefix) :]] = state.pop(key)


# the base model's last per-token module, as families name it
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "norm_f")


def chunk_mlps(model: torch.nn.Module, tokens: int) -> int:
    """Wrap every decoder layer's dense MLP (an ``mlp`` next to a ``self_attn``), and the final norm
    after the decoder layers, in ``SequenceChunked``; mixture-of-experts blocks (which return router
    logits too) are left as they are. Idempotent; returns how many MLPs are wrapped."""
    for base in model.modules():
        if any(
            isinstance(child, torch.nn.ModuleList) and len(child) and isinstance(child[0], BlockedPrefill)
            for child in base.children()
        ):
            for name in FINAL_NORMS:
                norm = getattr(base, name, None)
                if isinstance(norm, SequenceChunked):
                    norm.tokens = tokens
                elif isinstance(norm, torch.nn.Module):
                    setattr(base, name, SequenceChunked(norm, tokens))
    wrapped = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(layer, "self_attn"):
            continue
        if isinstance(mlp, SequenceChunked):
            mlp.tokens = tokens
        elif not any(word in type(mlp).__name__.lower() for word in ("moe", "sparse", "expert")):
            layer.mlp = SequenceChunked(mlp, tokens)
        else:
            continue
        wrapped += 1
    return wrapped


@dataclass
class LazyMask:
    """transformers' causal mask for a long input, as its rule: ``block`` builds any part of it."""

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    rule: Callable  # (batch_idx, head_idx, q_idx, kv_idx) -> bool, padding included
    device: torch.device

    def block(self, q_start: int, q_end: int, kv_start: int, kv_end: int) -> torch.Tensor:
        """``[batch, 1, q_end - q_start, kv_end - kv_start]`` of the mask."""
        arange = lambda a, b, offset: torch.arange(a, b, device=self.device) + offset  # noqa: E731
        rows = self.rule(
            torch.arange(self.batch_size, device=self.device)[:, None, None, None],
            torch.zeros(1, 1, 1, 1, dtype=torch.long, device=self.device),
            arange(q_start, q_end, self.q_offset)[None, None, :, None],
            arange(kv_start, kv_end, self.kv_offset)[None, None, None, :],
        )
        return rows.expand(self.batch_size, 1, q_end - q_start, kv_end - kv_start)

    def diagonal(self, q_len: int) -> torch.Tensor:
        """``[batch, q_len]``: the last ``q_len`` queries against their own key (real tokens see themselves)."""
        queries = torch.arange(self.q_length - q_len, self.q_length, device=self.device) + self.q_offset
        keys = torch.arange(self.kv_length - q_len, self.kv_length, device=self.device) + self.kv_offset
        batch = torch.arange(self.batch_size, device=self.device)[:, None]
        return self.rule(
            batch, torch.zeros(1, 1, dtype=torch.long, device=self.device), queries[None, :], keys[None, :]
        ).expand(self.batch_size, q_len)

    def materialize(self) -> torch.Tensor:
        return self.block(0, self.q_length, 0, self.kv_length)


def continued_mask(valid: torch.Tensor, q_len: int) -> LazyMask | None:
    """The mask of a prompt's last ``q_len`` slots over ``valid [b, slots]``, a prompt continuing a stored
    context whose rows are right-aligned (``tensors.right_aligned``): causal by slot, padding masked; None
    where that is plain causal (no padding)."""
    if bool(valid.all()):
        return None
    batch, slots = valid.shape
    rule = and_masks(causal_mask_function, padding_mask_function(valid))
    return LazyMask(batch, q_len, slots, slots - q_len, 0, rule, valid.device)


def lazy_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | LazyMask | None:
    """SDPA's mask builder, except that a mask of more than ``MASK_LIMIT`` elements comes back as a
    ``LazyMask`` (no mask at all where plain causal attention is right, as SDPA's builder does)."""
    mask_function = mask_function or causal_mask_function
    options = dict(
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        use_vmap=use_vmap,
        device=device,
        **kwargs,
    )
    if use_vmap or isinstance(q_offset, torch.Tensor) or q_length * kv_length <= MASK_LIMIT:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, **options)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    plain = padding is None or bool(padding[:, kv_offset : kv_offset + kv_length].all())
    if allow_is_causal_skip and plain and local_size is None and q_offset == 0 and q_length == kv_length:
        return None  # causal over everything: SDPA's is_causal, nothing to build
    rule = mask_function if padding is None else and_masks(mask_function, padding_mask_function(padding))
    return LazyMask(batch_size, q_length, kv_length, q_offset, kv_offset, rule, torch.device(device))
