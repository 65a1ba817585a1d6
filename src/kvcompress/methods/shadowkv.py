"""ShadowKV (Sun et al., 2024, "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference").

Nothing is dropped. At the end of prefill, per layer (Algorithm 1):

* the pre-RoPE keys of the prompt get a rank-``r`` SVD over all KV heads together
  (``[seq, kv_heads * head_dim] ~ A @ B``, ``A`` is ``seq x r``, ``B`` is ``r x kv_heads*head_dim``);
* the post-RoPE keys are cut into chunks of ``chunk`` tokens; each chunk's mean is its landmark;
* per KV head, the ``outliers`` chunks whose keys are least similar to their mean (lowest minimum
  cosine similarity) keep their exact keys and values in the dense part and are never selected;
* the last ``local_chunks`` chunks plus the tail that does not fill a chunk stay dense;
* the values of all chunks move to the offload store (host memory; pinned when the model is on a GPU).

At every decoding step, per layer (Algorithm 2): the queries score the landmarks (softmax over
chunks in float32, summed over query positions, max over the query heads of each KV head), the
top ``budget / chunk`` chunks per KV head are selected, their keys are rebuilt from ``A @ B`` and
rotated at their original positions, their values fetched, and attention runs exactly over
[selected chunks; outliers; local + generated tokens]. The values of chunks selected again at the
next step come from the previous step's buffer instead of the store (temporal locality, Sec. 3.2 /
Fig. 3c). Keys are rebuilt for every selected chunk: shapes stay fixed, so on a GPU no step waits
for the host, and the value gather (the PCIe-bound part) runs on a side stream meanwhile
(``offload.ChunkStore``).

Defaults follow the paper (chunk 8, rank 160 for 8 KV heads x 128 dims = 15.625% of
``kv_heads * head_dim``, 48 outlier chunks at 128K tokens = ~0.3% of chunks, budget 2048
tokens = 1.56% of 128K). ``local_chunks=4`` (32 recent tokens) is this library's choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

from ..cache.held import hold
from ..cache.layer import KVLayer
from ..cache.policy import present
from ..integrations.transformers.rope import apply_rope, invert_rope, rope_cos_sin, rotary_for
from ..storage.ops import fused
from ..storage.tensors import chunk_tokens, gather_tokens, prompt_positions
from .base import model_head_dim, require_rope
from .fields import InvalidParameterError, param
from .sparse import SparseDecodePolicy, SparseMethod

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RANK_FRACTION = 160 / (8 * 128)  # the paper's rank for Llama-3.1-8B, as a fraction of kv_heads * head_dim
MAX_RANK_FRACTION = 0.5  # an error-chosen rank never exceeds half the key width (the factors would save little)
OUTLIER_FRACTION = 48 / (128 * 1024 // 8)


STREAM_TOKENS = 8192  # tokens whose pre-RoPE keys are formed at once while factorising (memory stays linear)


def stream_spans(length: int) -> list[tuple[int, int]]:
    """``[start, end)`` pieces of ``STREAM_TOKENS`` covering ``length`` tokens."""
    return [(start, min(length, start + STREAM_TOKENS)) for start in range(0, length, STREAM_TOKENS)]


def key_rows(pre_rope_keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Keys ``[b, kv_heads, s, d]`` as float32 rows ``[b, s, kv_heads*d]``, padding rows zeroed (they
    must not shape the subspace)."""
    batch, heads, seq, dim = pre_rope_keys.shape
    return pre_rope_keys.float().permute(0, 2, 1, 3).reshape(batch, seq, heads * dim) * valid[..., None]


OVERSAMPLE, SUBSPACE_ITERATIONS = 16, 4  # randomized subspace iteration (Halko, Martinsson and Tropp, 2011, Alg. 4.4)


def leading_eigenvectors(gram: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` leading eigenvectors ``[n, rank]`` of a symmetric positive semi-definite ``gram
    [n, n]`` (float64). Far below ``n``: randomized subspace iteration (a seeded ``n x (rank + 16)``
    sketch, 4 power iterations re-orthonormalized by QR, then the small Rayleigh-Ritz problem), a
    few products of the small matrix instead of its full eigendecomposition; otherwise ``eigh``."""
    n = gram.shape[-1]
    if rank + OVERSAMPLE >= 3 * n // 4:
        return torch.linalg.eigh(gram).eigenvectors.flip(-1)[:, :rank]
    sketch = torch.randn(n, rank + OVERSAMPLE, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(
        gram.device
    )
    basis = torch.linalg.qr(gram @ sketch).Q
    for _ in range(SUBSPACE_ITERATIONS):
        basis = torch.linalg.qr(gram @ basis).Q
    vectors = torch.linalg.eigh(basis.mT @ gram @ basis).eigenvectors.flip(-1)[:, :rank]
    return basis @ vectors


class Spectrum(NamedTuple):
    """Each row's pre-RoPE keys, summarized: ``gram [b, n, n]`` (float64) of the keys as they are,
    whose leading eigenvectors are the factors' basis, and ``centred [b, n, n]``, the Gram matrix of
    their deviations from the mean key, which is what attention tells apart: a component every key
    shares shifts every logit of a query alike."""

    gram: torch.Tensor
    centred: torch.Tensor

    @property
    def energy(self) -> torch.Tensor:
        """Squared singular values ``[b, n]`` of the keys as they are, largest first."""
        return torch.linalg.eigvalsh(self.gram).flip(-1).clamp(min=0)

    @property
    def spread(self) -> torch.Tensor:
        """Squared singular values ``[b, n]`` of the deviations from the mean, largest first (computed
        on demand: only a rank chosen by ``rank_error`` needs them)."""
        return torch.linalg.eigvalsh(self.centred).flip(-1).clamp(min=0)

    def basis(self, ranks: int | torch.Tensor) -> torch.Tensor:
        """The leading right singular vectors of each row's keys, ``[b, n, r]`` (one rank for all rows,
        or ``[b]``: a row with a smaller rank gets zero columns, so it is rebuilt exactly as it would
        be alone)."""
        per_row: list[int] = torch.as_tensor(ranks).expand(self.gram.shape[0]).tolist()
        width = max(per_row)
        columns = [
            torch.nn.functional.pad(leading_eigenvectors(gram, rank), (0, width - rank))
            for gram, rank in zip(self.gram, per_row)
        ]
        return torch.stack(columns).float()


def key_spectrum(chunks: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Spectrum:
    """The spectrum of each row's keys, given as chunks of (pre-RoPE keys ``[b, kv_heads, c, d]``,
    validity ``[b, c]``): the small Gram matrix, accumulated chunk by chunk, which has the same
    eigenvectors as the whole ``s``-row matrix's right singular vectors, at a fraction of the cost
    and without holding it in float32."""
    sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the Gram matrix, the rows' sum, their count
    for keys, valid in chunks:
        rows = key_rows(keys, valid).double()  # float32 products lose the small directions next to a large mean
        parts = (rows.mT @ rows, rows.sum(dim=1), valid.sum(dim=-1).double())
        sums = parts if sums is None else (sums[0] + parts[0], sums[1] + parts[1], sums[2] + parts[2])
    if sums is None:
        raise ValueError("key_spectrum: no chunks of keys")
    gram, total, count = sums
    mean = total / count.clamp(min=1)[:, None]
    return Spectrum(gram, gram - count[:, None, None] * mean[:, :, None] * mean[:, None, :])


def rank_for_error(energy: torch.Tensor, target: float, cap: int) -> torch.Tensor:
    """Per row, the smallest rank whose relative reconstruction error ``sqrt(dropped / total energy)``
    is at most ``target``, between 1 and ``cap``: ``energy [b, n]`` largest first -> ``[b]``."""
    left = (energy.sum(-1, keepdim=True) - energy.cumsum(-1)).clamp(min=0)  # energy left out at rank 1, 2, ...
    error = (left / energy.sum(-1, keepdim=True).clamp(min=1e-30)).sqrt()
    return ((error > target).sum(-1) + 1).clamp(1, cap)


def rebuild_keys(a_rows: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys ``[b, kv_heads, n, d]`` from per-head gathered rows of A ``[b, kv_heads, n, r]``."""
    return torch.einsum("bhnr,brhd->bhnd", a_rows, b)


def _keys_like(factor_a: torch.Tensor, factor_b: torch.Tensor, chunks: torch.Tensor, *args) -> torch.Tensor:
    return factor_a.new_empty(*chunks.shape[:2], chunks.shape[-1] * args[-1], factor_b.shape[-1])


@fused("rotated_keys", mutates_args=(), fake=_keys_like)
def rotated_keys(
    factor_a: torch.Tensor,
    factor_b: torch.Tensor,
    chunks: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    unit: int,
) -> torch.Tensor:
    """Post-RoPE keys ``[b, kv_heads, k * unit, d]`` of ``chunks [b, kv_heads, k]``: rebuilt from the
    factors (``A [b, region, r]``, ``B [b, r, kv_heads, d]``) and rotated at their positions (a region
    token's index is its position) with the model's frequencies ``inv_freq`` and ``scale``."""
    tokens = chunk_tokens(chunks, unit)
    a_rows = gather_tokens(factor_a[:, None].expand(-1, chunks.shape[1], -1, -1), tokens)
    cos, sin = rope_cos_sin(tokens, inv_freq, scale, factor_a.dtype)
    return apply_rope(rebuild_keys(a_rows, factor_b), cos, sin)


def chunk_landmarks(keys: torch.Tensor, valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean of each chunk's real post-RoPE keys ``[b, kv_heads, n_chunks, d]`` (zeros for all-padding chunks)."""
    batch, heads, seq, dim = keys.shape
    weight = valid.view(batch, 1, seq // chunk, chunk, 1).to(keys.dtype)
    total = (keys.view(batch, heads, seq // chunk, chunk, dim) * weight).sum(dim=3)
    return total / weight.sum(dim=3).clamp(min=1)


def chunk_min_cosine(keys: torch.Tensor, landmarks: torch.Tensor, valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """Lowest cosine similarity between a chunk's real keys and its landmark, ``[b, kv_heads, n_chunks]``."""
    batch, heads, seq, dim = keys.shape
    cosine = torch.nn.functional.cosine_similarity(
        keys.view(batch, heads, seq // chunk, chunk, dim), landmarks[..., None, :], dim=-1
    )
    return cosine.masked_fill(~valid.view(batch, 1, seq // chunk, chunk), math.inf).amin(dim=-1)


def select_outliers(
    min_cosine: torch.Tensor, counts: torch.Tensor, eligible: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, its ``counts[row]`` eligible chunks with the lowest minimum cosine similarity:
    ids ``[b, kv_heads, m]`` ascending (``m = width``, default ``counts.max()``) and which of them are
    real ``[b, m]`` (a row with fewer gets filler entries, never padding chunks marked real)."""
    m = int(counts.max()) if width is None else width
    score = (-min_cosine).masked_fill(~eligible, -math.inf)
    top = score.topk(m, dim=-1)
    real = torch.arange(m, device=score.device)[None, :] < counts[:, None]
    ids, order = top.indices.sort(dim=-1)
    return ids, real[:, None, :].expand_as(order).gather(-1, order)[:, 0]


def landmark_bias(selectable: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[b, kv_heads, 1, n_chunks]``: 0 for selectable chunks, -inf for the others (added to their logits)."""
    zeros = torch.zeros(selectable.shape, dtype=dtype, device=selectable.device)
    return zeros.masked_fill(~selectable, -math.inf)[:, :, None]


def landmark_scores(query: torch.Tensor, landmarks: torch.Tensor, bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """Chunk scores per KV head ``[b, kv_heads, n_chunks]`` (Algorithm 2, lines 2-4): softmax over the
    selectable chunks (``bias``, see ``landmark_bias``) of each query head and position, summed over
    positions, max over the query heads of a KV group. A head with no selectable chunk scores NaN."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, n_chunks = landmarks.shape[1], landmarks.shape[2]
    stacked = query.reshape(batch * kv_heads, -1, dim)
    logits = torch.baddbmm(
        bias.flatten(0, 1), stacked, landmarks.view(batch * kv_heads, n_chunks, dim).mT, alpha=scaling
    )
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    if q_len > 1:
        probs = probs.view(batch, kv_heads, q_heads // kv_heads, q_len, n_chunks).sum(dim=3)
    return probs.view(batch, kv_heads, q_heads // kv_heads, n_chunks).amax(dim=2)


@dataclass
class ShadowKV(SparseMethod):
    """Low-rank pre-RoPE keys + offloaded values + landmark-selected sparse attention at every step.

    ``budget``: tokens attended per KV head per step from the selected chunks (outliers and local
    tokens come on top); ``ratio``: a fraction of the prompt instead (the paper's 1.56% is 0.0156)."""

    name: ClassVar[str] = "shadowkv"
    not_served: ClassVar[str | None] = (
        "it changes every decoding step's attention (chunk selection), not which tokens a request keeps"
    )
    unit_setting: ClassVar[tuple[str, str]] = ("chunk", "chunk")
    default_budget: ClassVar[int] = 2048
    chunk: int = param(8, "tokens per chunk: the unit of selection", minimum=1)
    rank: int | None = param(
        None, "SVD rank of the pre-RoPE keys, the same for every layer (default: from rank_error)", minimum=1
    )
    rank_error: float | None = param(
        0.1,
        "when rank is None: each layer takes the smallest rank that rebuilds its pre-RoPE keys' deviations from their "
        "mean within this relative error, plus one for the mean (capped at half of kv_heads * head_dim); None with "
        "rank None: the paper's 15.625%",
        above=0,
        at_most=1,
    )
    outliers: int | None = param(
        None, "outlier chunks kept dense per KV head (default ~0.3% of the chunks, at least 1)", minimum=0
    )
    local_chunks: int = param(4, "most recent prompt chunks kept dense", minimum=0)

    def check_model(self, model: PreTrainedModel) -> None:
        require_rope(model, "ShadowKV")
        width = model.config.get_text_config().num_key_value_heads * model_head_dim(model)
        if self.rank is not None and self.rank > width:
            raise InvalidParameterError(
                "ShadowKV: {rank=} exceeds kv_heads * head_dim = {width} of this model; valid: 1 to {width}",
                rank=self.rank,
                width=width,
            )

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> KVLayer:
        layer = KVLayer(layer_idx, ShadowKVPolicy(self))
        layer.rotary = rotary_for(model, layer_idx)
        return layer

    def ranks(self, spectrum: Spectrum) -> int | torch.Tensor:
        """The rank of each row from its keys' spectrum: enough directions to rebuild the keys'
        deviations from their mean within ``rank_error``, plus one for the mean itself (capped)."""
        width = spectrum.gram.shape[-1]
        if self.rank is not None:
            return self.rank
        if self.rank_error is None:
            return math.ceil(RANK_FRACTION * width)
        cap = math.ceil(MAX_RANK_FRACTION * width)
        return (rank_for_error(spectrum.spread, self.rank_error, cap) + 1).clamp(max=cap)

    def outlier_counts(self, chunks: torch.Tensor) -> torch.Tensor:
        """Outlier chunks per row for ``chunks [b]`` selectable chunks (at most all of them)."""
        wanted = (
            torch.full_like(chunks, self.outliers)
            if self.outliers is not None
            else torch.round(OUTLIER_FRACTION * chunks).long().clamp(min=1)
        )
        return torch.minimum(wanted, chunks)


class ShadowKVPolicy(SparseDecodePolicy):
    """A ShadowKV cache's layer policy: values in the offload store, keys as low-rank factors; the
    dense part holds outlier chunks, local tokens and everything appended after the prompt."""

    SAVED_AS = "ShadowKVLayer"  # the layer kind files record (docs/file-format.md)

    method: ShadowKV
    # the selection index, read at every step; each group's rank comes from its keys: zero columns are exact
    factor_a: torch.Tensor | None = hold(rows=True, index=True, ragged=2)  # [b, region, r]
    factor_b: torch.Tensor | None = hold(rows=True, index=True, ragged=1)  # [b, r, kv_heads, d]
    landmarks: torch.Tensor | None = hold(rows=True, index=True)  # [b, kv_heads, n_chunks, d]
    bias: torch.Tensor | None = hold(rows=True, index=True)  # [b, kv_heads, 1, n_chunks]: see landmark_bias
    inv_freq: torch.Tensor | None = hold(index=True)  # the model's rotary frequencies after the prefill, their scale
    rope_scale: float = hold(default=1.0)

    def __init__(self, method: ShadowKV) -> None:
        super().__init__(method, unit=method.chunk, offload=True)

    def region_chunks(self, lengths: torch.Tensor) -> torch.Tensor:
        return torch.div(lengths - self.method.local_chunks * self.unit, self.unit, rounding_mode="floor")

    def pre_rope(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``keys [b, h, c, d]`` at ``positions [b, c]`` turned back into pre-RoPE keys."""
        cos, sin = self.layer.rotary.cos_sin(positions, keys)
        return invert_rope(keys, cos[:, None], sin[:, None])

    def prepare(
        self, keys: torch.Tensor, valid: torch.Tensor, chunks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = self.layer.keys
        heads, seq = prompt.shape[1], prompt.shape[-2]
        prompt_valid = self.layer.slot_validity()
        positions = prompt_positions(prompt_valid).clamp(min=0)
        spectrum = key_spectrum(
            (self.pre_rope(prompt[:, :, s:e], positions[:, s:e]), prompt_valid[:, s:e]) for s, e in stream_spans(seq)
        )
        basis = spectrum.basis(self.method.ranks(spectrum)).to(prompt.device)
        region = keys.shape[-2]
        # a region token's index is its position
        token = torch.arange(region, device=keys.device)[None, :].expand(keys.shape[0], -1)
        parts = [
            (key_rows(self.pre_rope(keys[:, :, s:e], token[:, s:e]), valid[:, s:e]) @ basis).to(prompt.dtype)
            for s, e in stream_spans(region)
        ]
        self.factor_a = torch.cat(parts, dim=1)
        self.factor_b = basis.mT.reshape(basis.shape[0], basis.shape[-1], heads, -1).to(prompt.dtype)
        self.landmarks = landmarks = chunk_landmarks(keys, valid, self.unit)
        eligible, batch_chunks = present(self.selectable, self.batch_chunks)  # whole real chunks; the batch's counts
        width = int(self.method.outlier_counts(batch_chunks).max())  # the batch's, for a group of its rows too
        return select_outliers(
            chunk_min_cosine(keys, landmarks, valid, self.unit), self.method.outlier_counts(chunks), eligible, width
        )

    def index_selection(self, scaling: float) -> None:
        selectable, landmarks = present(self.selectable, self.landmarks)
        self.bias = landmark_bias(selectable, landmarks.dtype)
        self.inv_freq, self.rope_scale = self.layer.rotary.frequencies()
        self.inv_freq = self.inv_freq.to(self.layer.keys.device)

    def chunk_scores(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        landmarks, bias = present(self.landmarks, self.bias)
        return landmark_scores(query, landmarks, bias, scaling)

    def stored_chunks(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        batch, heads, _, dim = values.shape
        return values.reshape(batch, heads, -1, self.unit, dim)

    def previous_chunks(self) -> torch.Tensor:
        return self.layer.values[:, :, : self.front]

    def rebuild_keys(self, chunks: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys of ``chunks [b, h, m]``, rebuilt from the low-rank factors and rotated at their original
        positions."""
        return rotated_keys(self.factor_a, self.factor_b, chunks, self.inv_freq, self.rope_scale, self.unit)

    def read_factor(self) -> float:
        return 2.0  # the selected chunks' values, and their keys rebuilt to the same size

    def info(self) -> dict[str, Any]:
        if self.factor_b is None:
            return {}
        return {**super().info(), "rank": self.factor_b.shape[1], "chunk": self.unit}
