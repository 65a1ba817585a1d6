"""A decoding step's attention over slots as a storage holds them (``decode_attention``, one fused op): a GQA group's
query heads stacked as one head's rows (``stack_groups``), 8-, 6- and 4-bit or float8 coded rows read as they are where
a kernel reads them (Triton's on CUDA, ``TRITON_BITS``; ``cpu_kernels``' on a CPU, ``reads_codes``), decoded first
otherwise."""

from __future__ import annotations

import torch

from .codec import codec_of_code
from .cpu_kernels import cpu_kernel, has_cpu_kernel
from .ops import fused


def stack_groups(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, q_heads, q, d]`` -> ``[b, kv_heads, group * q, d]``: a KV head's query heads as one head's queries."""
    batch, q_heads, q_len, dim = query.shape
    return query.reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)


def _decoded_like(query: torch.Tensor, *args) -> torch.Tensor:
    return query.new_empty(query.shape)


TRITON_BITS = (4, 6, 8)  # the codes the Triton kernel reads (float8 rows: decoded first on CUDA)


@fused("decode_attention", mutates_args=(), fake=_decoded_like)
def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
    key_bits: int,
    value_bits: int,
) -> torch.Tensor:
    """A decoding step's attention ``[b, kv_heads, rows, d]``: ``query [b, kv_heads, rows, d]`` (a GQA group's
    query heads stacked as rows) over ``keys``/``values [b, kv_heads, s, ...]`` as a storage holds them: at the
    model's precision (bits 0) or as rows of an 8-, 6- (keys) or 4-bit ``codec.IntCodec`` or of float8
    (``key_bits``, ``value_bits``: the codecs' ``kernel_code``; the Triton kernel reads ``TRITON_BITS``);
    ``visible [b, 1 | kv_heads, 1, s]`` bool (None: every slot). On CUDA one Triton kernel, split along the slots,
    reads the rows as they are (``kernels.decode_attention_triton``); on a CPU, coded rows are read as they are by
    ``cpu_kernels``' kernel where it is built; otherwise they are decoded first."""
    kernel = cpu_kernel() if query.is_cpu and key_bits and value_bits else None
    if kernel is not None:
        return kernel.coded_decode_attention(query, keys, values, visible, scaling, key_bits, value_bits)
    dim = query.shape[-1]
    keys, values = (
        rows if bits == 0 else codec_of_code(bits, dim, query.dtype).decode(rows)
        for rows, bits in ((keys, key_bits), (values, value_bits))
    )
    logits = (query.float() @ keys.float().transpose(-1, -2)) * scaling
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    return (logits.softmax(dim=-1) @ values.float()).to(query.dtype)


def reads_codes(query: torch.Tensor) -> bool:
    """Whether a decoding step on ``query``'s device reads integer-coded slots without decoding them whatever the
    kernel choice: on a CPU where ``cpu_kernels``' kernel is built (decoding first is never faster there)."""
    return query.is_cpu and has_cpu_kernel()
