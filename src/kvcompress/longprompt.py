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

from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.masking_utils import and_masks, causal_mask_function, padding_mask_function, prepare_padding_mask, sdpa_mask

MLP_CHUNK = 8192  # tokens an MLP processes at once during a long prefill
MASK_LIMIT = 1 << 24  # masks with more elements than this stay lazy (16M booleans)
BLOCK_ELEMENTS = 1 << 26  # mask elements built per block of queries (64M booleans)


class SequenceChunked(torch.nn.Module):
    """A per-token module (a decoder layer's MLP) run over long sequences in chunks of ``tokens``."""

    def __init__(self, inner: torch.nn.Module, tokens: int) -> None:
        super().__init__()
        self.inner = inner
        self.tokens = tokens
        self.register_state_dict_post_hook(_drop_inner_prefix)
        self.register_load_state_dict_pre_hook(_add_inner_prefix)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if hidden_states.dim() < 3 or hidden_states.shape[-2] <= self.tokens:
            return self.inner(hidden_states, *args, **kwargs)
        return torch.cat([self.inner(part, *args, **kwargs) for part in hidden_states.split(self.tokens, dim=-2)], dim=-2)


def _drop_inner_prefix(module: torch.nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state if k.startswith(prefix + "inner.")]:
        state[prefix + key[len(prefix + "inner.") :]] = state.pop(key)


def _add_inner_prefix(module: torch.nn.Module, state: dict, prefix: str, *args: Any) -> None:
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + "inner.")]:
        state[prefix + "inner." + key[len(prefix) :]] = state.pop(key)


def chunk_mlps(model: torch.nn.Module, tokens: int) -> int:
    """Wrap every decoder layer's dense MLP (an ``mlp`` next to a ``self_attn``) in ``SequenceChunked``;
    mixture-of-experts blocks (which return router logits too) are left as they are. Idempotent;
    returns how many are wrapped."""
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
        return self.rule(batch, torch.zeros(1, 1, dtype=torch.long, device=self.device), queries[None, :], keys[None, :]).expand(self.batch_size, q_len)

    def materialize(self) -> torch.Tensor:
        return self.block(0, self.q_length, 0, self.kv_length)


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
    options = dict(q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                   allow_is_causal_skip=allow_is_causal_skip, use_vmap=use_vmap, device=device, **kwargs)
    if use_vmap or isinstance(q_offset, torch.Tensor) or q_length * kv_length <= MASK_LIMIT:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, **options)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    plain = padding is None or bool(padding[:, kv_offset : kv_offset + kv_length].all())
    if allow_is_causal_skip and plain and local_size is None and q_offset == 0 and q_length == kv_length:
        return None  # causal over everything: SDPA's is_causal, nothing to build
    rule = mask_function if padding is None else and_masks(mask_function, padding_mask_function(padding))
    return LazyMask(batch_size, q_length, kv_length, q_offset, kv_offset, rule, torch.device(device))
