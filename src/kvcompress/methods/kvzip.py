"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction").

A context's cache is compressed once for any question to come. The model is asked to repeat the
context ("Repeat the previous context exactly.") and the context itself is fed as its answer
(teacher forcing), in chunks of ``chunk`` tokens; each later chunk is introduced as "Repeat the part
of the previous context exactly, starting with" plus the ``overlap`` tokens before it. A KV pair's
importance is the most attention any reconstruction query pays it: the maximum over the queries and
over the query heads of its KV head (Sec. 3.2). By default all layers' and heads' pairs are ranked
together, the paper's selection (``layers="global"``: ``budget`` is the average per KV head, each
head keeps its share, stored packed); ``layers="uniform"`` keeps each KV head's top ``budget``. The
reconstruction's own tokens are attended, never stored.

One choice differs from the paper's code: the attention scored is the one the model computes, a
softmax over the whole prompt and the reconstruction so far (the paper's unchunked definition; its
chunked code renormalises over the system prompt, the chunk and the repeat tokens only); a chunk
bounds the queries a step scores, not the keys. The global selection (``prompt.global_shares``) is
measured against per-layer budgets in docs/accuracy.md. As for SnapKV,
``clustering="spans"`` (the default) gives every token of a word or number its span's highest
score, so a value is kept whole; ``clustering="none"`` is the paper's per-token selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..tokens import span_max
from .base import Observation, default_of, param
from .prompt import PromptMethod

if TYPE_CHECKING:
    from .prompt import EvictionLayer

SCORE_ELEMENTS = 1 << 24  # float32 attention weights scored at once (64 MiB)
FIRST = "Repeat the previous context exactly."
LATER = "Repeat the part of the previous context exactly, starting with"


def reconstruction_scores(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, prompt: int, scaling: float) -> torch.Tensor:
    """The most attention any real query of this step pays each prompt position, over the query heads
    of each KV head: ``[b, kv_heads, prompt]`` float32.

    ``query [b, q_heads, new, d]`` are the step's queries, the newest of ``keys [b, kv_heads, prompt +
    new, d]``; ``valid [b, prompt + new]`` marks real tokens. A query sees every real prompt token and
    the real new tokens up to itself. Every KV head is scored at once, a block of queries at a time
    (bounded memory), each block's softmax computed in place: the scale folded into the queries, the
    causal mask only over the step's own tokens, and each query's weights over the prompt formed
    only to take their maximum."""
    batch, q_heads, new, dim = query.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    best = torch.zeros(batch, kv_heads, prompt, dtype=torch.float32, device=keys.device)
    rows = max(1, SCORE_ELEMENTS // (batch * q_heads * total))
    own = torch.arange(new, device=keys.device)
    padded = not bool(valid[:, :prompt].all())
    flat_keys = keys.float().transpose(-1, -2)
    for start in range(0, new, rows):
        end = min(new, start + rows)
        block = (query[:, :, start:end].float() * scaling).reshape(batch, kv_heads, -1, dim)  # a KV head's query heads stacked
        logits = (block @ flat_keys).view(batch, kv_heads, q_heads // kv_heads, end - start, total)
        unseen = ~((own[None, :] <= own[start:end, None])[None] & valid[:, None, prompt:])  # [b, block, new]
        logits[..., prompt:].masked_fill_(unseen[:, None, None], -torch.inf)
        if padded:
            logits[..., :prompt].masked_fill_(~valid[:, None, None, None, :prompt], -torch.inf)
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        real = valid[:, None, None, prompt + start : prompt + end, None]
        scale = logits.sum(dim=-1, keepdim=True).reciprocal_().mul_(real)  # 1 / each query's softmax sum; padding queries: 0
        best = torch.maximum(best, (logits[..., :prompt] * scale).amax(dim=(2, 3)))
    return best


@dataclass
class KVzip(PromptMethod):
    """Keep each KV head's ``budget`` prompt positions the model attends to most while repeating the prompt."""

    name: ClassVar[str] = "kvzip"
    layers: str = default_of(PromptMethod, "layers", "global")  # the paper's selection: every layer's and head's pairs ranked together
    chunk: int = param(2000, "prompt tokens repeated per step of the reconstruction (bounds the queries scored at once)", minimum=1)
    overlap: int = param(8, "tokens before a chunk repeated with the instruction that introduces it", minimum=0)
    clustering: str = param("spans", "spans: each word or number scored by its best token, kept whole; none: the paper's per-token scores", choices=("spans", "none"))

    def queries_needed(self) -> int:
        return 0

    def keep_counts(self, lengths: torch.Tensor) -> torch.Tensor:
        return self.token_budgets(lengths)

    def needs_tokens(self) -> bool:
        return self.clustering == "spans"

    def observation(self) -> Observation:
        return Observation(FIRST, LATER, self.chunk, self.overlap)

    def observe(self, seen: torch.Tensor | None, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, prompt: int, scaling: float) -> torch.Tensor:
        scores = reconstruction_scores(query, keys, valid, prompt, scaling)
        return scores if seen is None else torch.maximum(seen, scores)

    def layer_scores(self, layer: EvictionLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        if layer.observed is None:
            raise ValueError("KVzip scores from the prompt's reconstruction, which did not run: compress through kvcompress.generate or kvcompress.compress")
        if self.clustering == "none":
            return layer.observed
        if layer.spans is None:
            raise ValueError("KVzip(clustering='spans') needs the prompt's token ids; the model was called with embeddings only: use clustering='none'")
        return span_max(layer.observed, layer.spans)
