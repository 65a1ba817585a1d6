"""ShadowKV (Sun et al., 2024, "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference").

Nothing is dropped. At the end of prefill, per layer (Algorithm 1):

* the pre-RoPE keys of the prompt get a rank-``r`` SVD over all KV heads together
  (``[seq, kv_heads * head_dim] ~ A @ B``, ``A`` is ``seq x r``, ``B`` is ``r x kv_heads*head_dim``);
* the post-RoPE keys are cut into chunks of ``chunk`` tokens; each chunk's mean is its landmark;
* per KV head, the ``outliers`` chunks whose keys are least similar to their mean (lowest minimum
  cosine similarity) keep their exact keys and values in a dense static cache and are never selected;
* the last ``local_chunks`` chunks plus the tail that does not fill a chunk stay dense;
* the values of all chunks move to the offload store (CPU memory; pinned when the model is on a GPU).

At every decoding step, per layer (Algorithm 2): the queries score the landmarks (softmax over
chunks in float32, summed over query positions, max over the query heads of each KV head), the
top ``sparse_budget / chunk`` chunks per KV head are selected, their keys are rebuilt from ``A @ B``
and rotated at their original positions, their values fetched, and attention runs exactly over
[selected chunks; outliers; local + generated tokens]. The values of chunks selected again at the
next step come from the previous step's buffer instead of the store (temporal locality, Sec. 3.2 /
Fig. 3c). Keys are rebuilt for every selected chunk: shapes stay fixed, so on a GPU no step waits
for the host, and the value gather (the PCIe-bound part) runs on a side stream meanwhile
(``offload.ChunkStore``).

Defaults follow the paper (chunk 8, rank 160 for 8 KV heads x 128 dims = 15.625% of
``kv_heads * head_dim``, 48 outlier chunks at 128K tokens = ~0.3% of chunks, sparse budget 2048
tokens = 1.56% of 128K). ``local_chunks=4`` (32 recent tokens) is this library's choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cache import CompressedLayer, attend_selected, gather_tokens, prompt_positions
from ..offload import ChunkStore, chunk_tokens
from ..rope import apply_rope, cos_sin, invert_rope, rotary_module
from .base import InvalidParameterError, Method, check_positive_int, require

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RANK_FRACTION = 160 / (8 * 128)
OUTLIER_FRACTION = 48 / (128 * 1024 // 8)


def low_rank_factors(pre_rope_keys: torch.Tensor, valid: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` truncated SVD of each row's keys ``[b, kv_heads, s, d]`` viewed as ``[s, kv_heads*d]``.

    Returns ``A [b, s, rank]`` (left singular vectors times singular values) and
    ``B [b, rank, kv_heads, d]``. The right singular vectors are the top eigenvectors of the small
    ``[kv_heads*d, kv_heads*d]`` Gram matrix, which gives the same factors as a full SVD of the
    ``s``-row matrix at a fraction of its cost for long prompts. Padding rows are zeroed so they
    do not shape the subspace."""
    batch, heads, seq, dim = pre_rope_keys.shape
    matrix = pre_rope_keys.float().permute(0, 2, 1, 3).reshape(batch, seq, heads * dim) * valid[..., None]
    _, vectors = torch.linalg.eigh((matrix.mT @ matrix).double())
    basis = vectors[..., -rank:].flip(-1).float()  # eigh sorts ascending; keep the largest, largest first
    return matrix @ basis, basis.mT.reshape(batch, rank, heads, dim)


def rebuild_keys(a_rows: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys ``[b, kv_heads, n, d]`` from per-head gathered rows of A ``[b, kv_heads, n, r]``."""
    return torch.einsum("bhnr,brhd->bhnd", a_rows, b)


def chunk_landmarks(keys: torch.Tensor, valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean of each chunk's real post-RoPE keys ``[b, kv_heads, n_chunks, d]`` (zeros for all-padding chunks)."""
    batch, heads, seq, dim = keys.shape
    weight = valid.view(batch, 1, seq // chunk, chunk, 1).to(keys.dtype)
    total = (keys.view(batch, heads, seq // chunk, chunk, dim) * weight).sum(dim=3)
    return total / weight.sum(dim=3).clamp(min=1)


def chunk_min_cosine(keys: torch.Tensor, landmarks: torch.Tensor, valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """Lowest cosine similarity between a chunk's real keys and its landmark, ``[b, kv_heads, n_chunks]``."""
    batch, heads, seq, dim = keys.shape
    cosine = torch.nn.functional.cosine_similarity(keys.view(batch, heads, seq // chunk, chunk, dim), landmarks[..., None, :], dim=-1)
    return cosine.masked_fill(~valid.view(batch, 1, seq // chunk, chunk), math.inf).amin(dim=-1)


def select_outliers(min_cosine: torch.Tensor, count: int, eligible: torch.Tensor) -> torch.Tensor:
    """The ``count`` eligible chunks with the lowest minimum cosine similarity, ``[b, kv_heads, count]`` ascending."""
    score = (-min_cosine).masked_fill(~eligible, -math.inf)
    return score.topk(count, dim=-1).indices.sort(dim=-1).values


def landmark_scores(query: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, scaling: float) -> torch.Tensor:
    """Chunk scores per KV head ``[b, kv_heads, n_chunks]`` (Algorithm 2, lines 2-4): softmax over chunks of
    each query head and position, summed over positions, max over the query heads of a KV group."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, n_chunks = landmarks.shape[1], landmarks.shape[2]
    grouped = query.float().reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)
    logits = (grouped @ landmarks.float().transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~selectable[:, :, None, :], -math.inf)
    probs = logits.softmax(dim=-1).nan_to_num(0.0)
    return probs.view(batch, kv_heads, q_heads // kv_heads, q_len, n_chunks).sum(dim=3).amax(dim=2)


def match_previous(selected: torch.Tensor, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each selected chunk ``[b, h, k]``: was it selected last step (``hit``) and at which slot (``slot``)."""
    if previous is None or previous.shape != selected.shape:
        return torch.zeros_like(selected, dtype=torch.bool), torch.zeros_like(selected)
    same = selected[..., :, None] == previous[..., None, :]
    return same.any(dim=-1), same.int().argmax(dim=-1)


@dataclass
class ShadowKV(Method):
    """Low-rank pre-RoPE keys + offloaded values + landmark-selected sparse attention at every step.

    ``sparse_budget``: tokens attended per KV head per step from the selected chunks (outliers and
    local tokens come on top); ``sparse_ratio`` (0, 1], when set, replaces it by a fraction of the
    prompt (the paper's 1.56% is 0.0156). ``rank`` None: 15.625% of ``kv_heads * head_dim``.
    ``outliers`` None: ~0.3% of the chunks (48 at 128K tokens), at least 1."""

    name: ClassVar[str] = "shadowkv"
    sparse_budget: int = 2048
    sparse_ratio: float | None = None
    chunk: int = 8
    rank: int | None = None
    outliers: int | None = None
    local_chunks: int = 4

    def validate(self) -> None:
        check_positive_int("ShadowKV", "chunk", self.chunk)
        check_positive_int("ShadowKV", "local_chunks", self.local_chunks, minimum=0)
        if self.rank is not None:
            check_positive_int("ShadowKV", "rank", self.rank)
        if self.outliers is not None:
            check_positive_int("ShadowKV", "outliers", self.outliers, minimum=0)
        if self.sparse_ratio is not None:
            require(
                isinstance(self.sparse_ratio, (int, float)) and not isinstance(self.sparse_ratio, bool) and 0 < self.sparse_ratio <= 1,
                f"ShadowKV: sparse_ratio={self.sparse_ratio!r} is outside the valid range (0, 1]",
            )
            return
        check_positive_int("ShadowKV", "sparse_budget", self.sparse_budget)
        require(
            self.sparse_budget >= self.chunk,
            f"ShadowKV: sparse_budget={self.sparse_budget} is smaller than one chunk (chunk={self.chunk}); "
            f"valid: sparse_budget >= {self.chunk}",
        )

    def check_model(self, model: PreTrainedModel) -> None:
        config = model.config.get_text_config()
        width = config.num_key_value_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        if self.rank is not None and self.rank > width:
            raise InvalidParameterError(
                f"ShadowKV: rank={self.rank} exceeds kv_heads * head_dim = {width} of this model; valid: 1 to {width}"
            )

    def make_layer(self, layer_idx: int, model: PreTrainedModel) -> ShadowKVLayer:
        return ShadowKVLayer(self, layer_idx, rotary_module(model))

    def resolved_rank(self, width: int) -> int:
        return self.rank if self.rank is not None else math.ceil(RANK_FRACTION * width)

    def outlier_count(self, n_chunks: int) -> int:
        return self.outliers if self.outliers is not None else max(1, round(OUTLIER_FRACTION * n_chunks))

    def chunks_per_step(self, prompt_tokens: int) -> int:
        tokens = math.ceil(self.sparse_ratio * prompt_tokens) if self.sparse_ratio is not None else self.sparse_budget
        return max(1, tokens // self.chunk)

    def describe(self) -> str:
        budget = f"sparse_ratio={self.sparse_ratio}" if self.sparse_ratio is not None else f"sparse_budget={self.sparse_budget}"
        return f"shadowkv({budget}, chunk={self.chunk}, rank={self.rank or 'auto'}, outliers={self.outliers if self.outliers is not None else 'auto'})"


class ShadowKVLayer(CompressedLayer):
    """One layer of a ShadowKV cache. ``keys``/``values`` hold the dense part: outlier chunks, local
    tokens and everything appended after the prompt."""

    method: ShadowKV

    def __init__(self, method: ShadowKV, layer_idx: int, rotary: torch.nn.Module) -> None:
        super().__init__(method, layer_idx)
        self.rotary = rotary
        self.factor_a: torch.Tensor | None = None  # [b, region, r]
        self.factor_b: torch.Tensor | None = None  # [b, r, kv_heads, d]
        self.landmarks: torch.Tensor | None = None  # [b, kv_heads, n_chunks, d]
        self.selectable: torch.Tensor | None = None  # [b, kv_heads, n_chunks]
        self.region_positions: torch.Tensor | None = None  # [b, region] RoPE positions
        self.region_valid: torch.Tensor | None = None  # [b, region]
        self.store: ChunkStore | None = None  # values [b, kv_heads, n_chunks, chunk, d] off the device
        self.selected: torch.Tensor | None = None  # chunks of the reuse buffer [b, kv_heads, k]
        self.buffer_values: torch.Tensor | None = None  # their values [b, kv_heads, k * chunk, d]
        self.chunks_per_step = 0
        self.steps = self.lookups = 0
        self.hits: torch.Tensor | int = 0  # a device scalar once decoding runs

    def _compress_prompt(self, query: torch.Tensor, scaling: float) -> None:
        method, c = self.method, self.method.chunk
        valid = self.slot_validity()
        batch, heads, seq, dim = self.keys.shape
        n_chunks = max(0, (seq - method.local_chunks * c) // c)
        n_outliers = min(method.outlier_count(n_chunks), n_chunks)
        if n_chunks - n_outliers <= 0:
            return
        region = n_chunks * c
        row_position = prompt_positions(valid)  # -1 for padding
        positions = row_position.clamp(min=0)
        cos, sin = cos_sin(self.rotary, positions, self.keys)
        pre_rope = invert_rope(self.keys, cos[:, None], sin[:, None])
        factor_a, factor_b = low_rank_factors(pre_rope, valid, method.resolved_rank(heads * dim))
        keys, values, region_valid = self.keys[:, :, :region], self.values[:, :, :region], valid[:, :region]
        landmarks = chunk_landmarks(keys, region_valid, c)
        chunk_valid = region_valid.view(batch, 1, n_chunks, c)
        outliers = select_outliers(chunk_min_cosine(keys, landmarks, region_valid, c), n_outliers, chunk_valid.all(-1))
        selectable = chunk_valid.any(-1).expand(-1, heads, -1).clone()
        selectable.scatter_(-1, outliers, False)
        outlier_tokens = chunk_tokens(outliers, c)

        self.positions = torch.cat(
            [row_position[:, None, :region].expand(-1, heads, -1).gather(2, outlier_tokens), row_position[:, None, region:].expand(-1, heads, -1)], dim=-1
        )
        self.keys = torch.cat([gather_tokens(keys, outlier_tokens), self.keys[:, :, region:]], dim=2)
        self.values = torch.cat([gather_tokens(values, outlier_tokens), self.values[:, :, region:]], dim=2)
        dense_valid = torch.cat([torch.ones(batch, outlier_tokens.shape[-1], dtype=torch.bool, device=valid.device), valid[:, region:]], dim=-1)
        self.valid = None if bool(dense_valid.all()) else dense_valid

        self.store = ChunkStore(values.reshape(batch, heads, n_chunks, c, dim))
        self.factor_a, self.factor_b = factor_a[:, :region].to(self.keys.dtype), factor_b.to(self.keys.dtype)
        self.landmarks, self.selectable = landmarks, selectable
        self.region_positions = positions[:, :region]
        self.region_valid = None if bool(region_valid.all()) else region_valid
        self.chunks_per_step = min(method.chunks_per_step(int(self.prompt_tokens.max())), n_chunks)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        if self.factor_a is None:
            return super().attend(query, keys, values, mask, scaling)
        scores = landmark_scores(query, self.landmarks, self.selectable, scaling)
        chosen = scores.topk(self.chunks_per_step, dim=-1).indices.sort(dim=-1).values
        sparse_keys, sparse_values = self._fetch(chosen)
        tokens = chunk_tokens(chosen, self.method.chunk)
        sparse_valid = self.selectable.gather(2, chosen).repeat_interleave(self.method.chunk, dim=-1)
        if self.region_valid is not None:
            sparse_valid &= self.region_valid[:, None, :].expand(-1, tokens.shape[1], -1).gather(2, tokens)
        return attend_selected(query, (sparse_keys, sparse_values, sparse_valid), keys, values, mask, scaling)

    def _fetch(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rebuilt, rotated) and values of the chosen chunks. The values are gathered from the
        offload store (chunks chosen last step too: from the previous buffer) on a side stream while
        the keys are rebuilt. Shapes are fixed and the hit count stays on the device, so a step
        never waits for the GPU."""
        hit, slot = match_previous(chosen, self.selected)
        self.steps += 1
        self.lookups += chosen.numel()
        self.hits = self.hits + hit.sum()
        values, keys = self.store.fetch(chosen, hit, slot, self.buffer_values, overlap=lambda: self.rebuild_keys(chosen))
        self.selected, self.buffer_values = chosen, values
        return keys, values

    def rebuild_keys(self, chunks: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys of ``chunks [b, h, m]``, rebuilt from the low-rank factors and rotated at their original positions."""
        heads = chunks.shape[1]
        tokens = chunk_tokens(chunks, self.method.chunk)
        a_rows = gather_tokens(self.factor_a[:, None].expand(-1, heads, -1, -1), tokens)
        positions = self.region_positions[:, None, :].expand(-1, heads, -1).gather(2, tokens)
        cos, sin = cos_sin(self.rotary, positions, self.factor_a)
        return apply_rope(rebuild_keys(a_rows, self.factor_b), cos, sin)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.factor_a is not None:
            raise NotImplementedError("ShadowKV caches cannot be reordered after prefill (beam search is unsupported)")
        super().batch_select_indices(indices)

    def device_tensors(self) -> list[torch.Tensor]:
        held = [*self.slot_tensors(), self.valid, self.positions, self.factor_a, self.factor_b, self.landmarks, self.selectable]
        held += [self.region_positions, self.region_valid, self.selected, self.buffer_values]
        return [t for t in held if t is not None]

    def bytes_read_per_step(self) -> int:
        """Dense slots, the selected chunks' keys and values (same size), and the landmarks scored every step."""
        read = [self.keys, self.values, self.buffer_values, self.buffer_values, self.landmarks]
        return sum(t.numel() * t.element_size() for t in read if t is not None)

    def value_bytes_fetched(self) -> int:
        """Bytes read from the offload store so far (hits count only where the store reads them again)."""
        if self.store is None or not self.lookups:
            return 0
        misses = self.lookups - (0 if self.store.reads_hits() else int(self.hits))
        return misses * self.store.chunk_bytes

    def tensor_bytes(self) -> int:
        """Bytes kept on the compute device between steps (the offload store is reported separately)."""
        return sum(t.numel() * t.element_size() for t in self.device_tensors())

    def offloaded_bytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    def extra_stats(self, layers: list[CompressedLayer]) -> dict:
        lookups = sum(layer.lookups for layer in layers)
        steps = max(layer.steps for layer in layers)
        return {
            "device_bytes": sum(layer.tensor_bytes() for layer in layers),
            "offloaded_bytes": sum(layer.offloaded_bytes() for layer in layers),
            "rank": None if self.factor_b is None else self.factor_b.shape[1],
            "chunk": self.method.chunk,
            "selected_tokens_per_step": self.chunks_per_step * self.method.chunk,
            "chunk_hit_rate": int(sum(layer.hits for layer in layers)) / lookups if lookups else None,
            "value_fetch": self.store.mode if self.store is not None else None,
            "value_bytes_fetched_per_step": sum(layer.value_bytes_fetched() for layer in layers) / steps if steps else None,
        }
