"""Attention over cache slots: exact SDPA with GQA (``dense_attention``), with the kernel chosen per phase
(kernel_choice.py) or a decoding step's own (decode_kernel.py), the grouped logits every scorer needs, attention with
its log-normalisers and a model's learned sinks.

Query head ``h`` reads KV head ``h // (q_heads // kv_heads)`` (the usual GQA grouping), so a KV
head is never repeated in memory: when the mask differs per KV head (or a single query attends to a
cache), the queries of a group are stacked as one head's queries instead. On a CPU, 8-, 6- and 4-bit and float8
coded slots are always read as stored by ``cpu_kernels``' kernel where it is built (``reads_codes``); on CUDA a step
hands the split kernel its codes (``hands_codes``).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from .codec import codec_of_code
from .decode_kernel import TRITON_BITS, decode_attention, reads_codes, stack_groups
from .kernel_choice import candidates, choose_backends, default_backend, kernel_context, phase_of


def grouped_logits(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * q . k`` in float32, ``[b, q_heads, q, s]``, for ``query [b, q_heads, q, d]`` and
    ``keys [b, kv_heads, s, d]`` (any per-KV-head vectors: keys, chunk landmarks, projections)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, seq = keys.shape[1], keys.shape[2]
    stacked = query.float().reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)
    return (stacked @ keys.float().transpose(-1, -2)).view(batch, q_heads, q_len, seq).mul_(scaling)


def sdpa(
    phase: str,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the kernels chosen for ``phase`` (see ``phase_of``).
    Where PyTorch would pick the fastest one anyway, no context is entered (it costs ~20 us a call)."""
    chosen = choose_backends(phase, query, keys, mask, is_causal, enable_gqa)
    if chosen[0] == "triton":  # a decoding step, its queries stacked per KV head (dense_attention)
        return decode_attention(
            query, keys, values, mask, query.shape[-1] ** -0.5 if scaling is None else scaling, 0, 0
        )
    compiling = torch.compiler.is_compiling()
    if not compiling and chosen[0] == default_backend(query, keys, values, mask, is_causal, scaling, enable_gqa):
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa
        )
    with kernel_context(chosen):
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa
        )


def group_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """A mask ``[b, 1 | kv_heads, q, s]`` for stacked queries ``[b, kv_heads, group * q, s]`` (one query: a
    broadcast)."""
    if mask.shape[2] == 1:
        return mask
    batch, heads, q_len, seq = mask.shape
    return mask[:, :, None].expand(batch, heads, group, q_len, seq).reshape(batch, heads, group * q_len, seq)


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    coded: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """Exact attention ``[b, q_heads, q, d]``. ``mask`` is boolean, ``[b, 1 | kv_heads, q, s]``, or
    SDPA's lower-right causal bias; None means causal over the last ``q`` slots (or no mask for one
    query). ``softcap`` (Gemma 2): logits become ``softcap * tanh(logits / softcap)`` before the softmax.
    ``coded``: the same slots as stored, integer-coded rows and their key and value bits
    (``codec.coded_rows``), which a decoding step reads without decoding where ``decode_attention``'s kernel is
    the one chosen, or on a CPU where its kernel is built (``keys``/``values``: decoded, or the same coded rows where
    the caller handed them on undecoded, ``hands_codes``: then decoded here if SDPA's kernel is the choice)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, seq = keys.shape[1], keys.shape[-2]
    if mask is None and 1 < q_len and (q_len != seq or softcap is not None):
        mask = causal_slot_mask(q_len, seq, keys.device)
    if softcap is not None:
        logits = grouped_logits(query, keys, scaling)
        logits = softcap * torch.tanh(logits / softcap)
        if mask is not None:
            hidden = ~group_mask(mask, q_heads // kv_heads)
            logits = logits.view(batch, kv_heads, -1, seq).masked_fill(hidden, torch.finfo(torch.float32).min)
        probs = logits.view(batch, kv_heads, -1, seq).softmax(dim=-1)
        return (probs @ values.float()).view(batch, q_heads, q_len, -1).to(query.dtype)
    phase = phase_of(q_len, seq)
    if isinstance(mask, CausalBias):  # the newest q of the slots, causal, without building the mask
        if q_heads != kv_heads and not query.is_cpu:
            # PyTorch's fused kernels take a lower-right bias only for equal head counts; with GQA it falls back
            # to the math kernel and a q x s float32 score tensor (16 GiB per 4K block over 32K keys on the 8B
            # shape: the 11-26 H100 run's out-of-memory). The KV heads are repeated instead, for this call only
            # (group x the keys and values seen: 512 MiB at 32K on the 8B shape)
            keys, values = (t.repeat_interleave(q_heads // kv_heads, dim=1) for t in (keys, values))
        return sdpa(phase, query, keys, values, mask, scaling, enable_gqa=q_heads != keys.shape[1])
    # stacked: KV read once per KV head, a per-head mask as is
    if q_len == 1 or (mask is not None and mask.shape[1] > 1):
        mask = None if mask is None else group_mask(mask, q_heads // kv_heads)
        stacked = stack_groups(query, kv_heads)
        stored = coded if phase == "decode" else None
        if stored is not None and (
            reads_codes(query)
            or (
                set(stored[2:]) <= set(TRITON_BITS)
                and choose_backends(phase, stacked, keys, mask, False, False)[0] == "triton"
            )
        ):
            out = decode_attention(stacked, *stored[:2], mask, scaling, *stored[2:])
        else:
            if coded is not None and keys.dtype != query.dtype:  # handed as codes (hands_codes) and SDPA won
                keys, values = (
                    codec_of_code(bits, dim, query.dtype).decode(rows) for rows, bits in zip(coded[:2], coded[2:])
                )
            out = sdpa(phase, stacked, keys, values, mask, scaling)
        # a fused kernel's output may be laid out [b, group * q, kv_heads, d] (CUDA's efficient kernel): no view
        return out.reshape(batch, q_heads, q_len, dim)
    return sdpa(phase, query, keys, values, mask, scaling, is_causal=mask is None, enable_gqa=q_heads != kv_heads)


def hands_codes(query: torch.Tensor, key_bits: int, value_bits: int) -> bool:
    """Whether a decoding step on ``query``'s device hands its slots' codes to ``dense_attention`` undecoded
    (``Slots.reads_codes``): where a kernel reads them all (``reads_codes``), and where the split kernel runs and
    reads these codes, the likely choice of a long cache (``dense_attention`` decodes them for SDPA's kernels when
    one of them wins). Decoding first, the 4-bit full cache's step spent ~40 ms at 32K on the H200 (11-28) making a
    copy the split kernel then never read."""
    return reads_codes(query) or (
        {key_bits, value_bits} <= set(TRITON_BITS)
        and "triton" in candidates("decode", query.device.type, query.shape[-1])
    )


def attention_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``[b, q_heads, q, d]`` and each query's log-normaliser (the log of its softmax's
    sum) ``[b, q_heads, q]`` float32, for a boolean ``mask [b | 1, 1, q, s]``: an observation pass's
    attention, whose normalisers a method scores with. On a CPU, SDPA's own flash kernel returns both
    (the KV heads repeated for it: a few MiB, where the mask repeated per query head would be far more);
    elsewhere, or with soft-capping, the logits are spelled out."""
    if query.device.type != "cpu" or softcap is not None:
        return spelled_out_with_lse(query, keys, values, mask, scaling, softcap)
    group = query.shape[1] // keys.shape[1]
    bias = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, -torch.inf)
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, keys, values, 0.0, False, attn_mask=bias, scale=scaling)


def spelled_out_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` from the logits in float32 (any device, soft-capping included; ``mask`` None: every
    slot seen)."""
    batch, q_heads, q_len, dim = query.shape
    group = q_heads // keys.shape[1]
    logits = grouped_logits(query, keys, scaling).view(batch, keys.shape[1], group * q_len, -1)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if mask is not None:
        logits.masked_fill_(~group_mask(mask, group), -torch.inf)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    out = logits.sub_(lse).exp_() @ values.float()
    return out.view(batch, q_heads, q_len, dim).to(query.dtype), lse.view(batch, q_heads, q_len)


def after_prompt_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` on a CPU for queries that are the newest of ``keys`` and see every older
    key (no padding): two flash calls, the older keys unmasked and the new ones causal, merged by their
    log-normalisers (each call is faster than one call with a mask: 0.11 s against 0.18 s for 2K
    queries over 4K keys, 9 heads, on 2 cores; 3.4 s against 5.3 s for 8K over 16K on one). The older
    keys are read once per KV head (a GQA group's queries stacked as one head's: no mask to shift);
    only the new keys are repeated per query head, for the causal call."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    old_out, old_lse = flash(
        stack_groups(query, kv_heads), keys[:, :, :-q_len], values[:, :, :-q_len], 0.0, False, scale=scaling
    )
    old_out, old_lse = old_out.reshape(batch, q_heads, q_len, dim), old_lse.reshape(batch, q_heads, q_len)
    new_keys, new_values = (t[:, :, -q_len:].repeat_interleave(q_heads // kv_heads, dim=1) for t in (keys, values))
    new_out, new_lse = flash(query, new_keys, new_values, 0.0, True, scale=scaling)
    lse = torch.logaddexp(old_lse, new_lse)
    out = old_out.float() * (old_lse - lse).exp_()[..., None] + new_out.float() * (new_lse - lse).exp_()[..., None]
    return out.to(query.dtype), lse


def causal_slot_mask(q_len: int, slots: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q_len, slots]``: the newest ``q_len`` slots are the queries, each sees itself and all before."""
    return torch.ones(q_len, slots, dtype=torch.bool, device=device).tril(slots - q_len)[None, None]


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out [b, q_heads, q, d]`` whose softmax also has a learned sink logit per query head
    (``sinks [q_heads]``, gpt-oss) in its denominator, with no value: each query's row scaled by
    ``exp(lse) / (exp(lse) + exp(sink))``, from its log-normaliser over the keys ``lse [b, q_heads, q]``."""
    return (out.float() * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None]).to(out.dtype)


def sink_normaliser(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The log-normaliser ``[b, q_heads, q]`` of a softmax over the keys and the learned sink."""
    return torch.logaddexp(lse, sinks.float()[None, :, None])


_SCORING_SINKS: ContextVar[torch.Tensor | None] = ContextVar("kvcompress_scoring_sinks", default=None)


@contextlib.contextmanager
def scoring_sinks(sinks: torch.Tensor | None):
    """While a layer's method scores its prompt: the layer's learned sink logits ``[q_heads]`` (None: none),
    which ``key_probabilities`` gives their share of each softmax, as the model's attention does."""
    token = _SCORING_SINKS.set(sinks)
    try:
        yield
    finally:
        _SCORING_SINKS.reset(token)


def key_probabilities(logits: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """A scorer's attention probabilities: the softmax of ``logits [b, h, q, s]`` over the keys and, where the
    layer being scored has learned sinks (``scoring_sinks``; ``heads``: which query heads ``h`` are), each
    row's sink in the denominator, so a query's weights sum to what the model gives the keys."""
    probs = logits.softmax(dim=-1)
    sinks = _SCORING_SINKS.get()
    if sinks is None:
        return probs
    sink = (sinks if heads is None else sinks[heads]).float()
    return probs * torch.sigmoid(logits.logsumexp(dim=-1) - sink[None, :, None])[..., None]
