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

The attention scored is the one the model computes over the prompt and the reconstruction so far,
renormalised without the chat template's opening (its system prompt and header) beyond the prompt's
first ``sinks`` tokens, as the paper's code does; those opening tokens score 0, the last kept. One
choice differs from the paper's chunked code, which also leaves the other chunks out of each
softmax: a chunk bounds the queries a step scores, not the keys. The global selection
(``prompt.global_shares``) is measured against per-layer budgets in docs/accuracy.md. As for SnapKV,
``clustering="spans"`` (the default) gives every token of a word or number its span's highest
score, so a value is kept whole; ``clustering="none"`` is the paper's per-token selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cache.policy import ScoredLayer
from ..cache.tokens import span_max
from ..storage.tensors import prompt_positions
from .base import Observation
from .fields import default_of, param
from .prompt import PromptMethod

if TYPE_CHECKING:
    pass

SCORE_ELEMENTS = 1 << 20  # float32 logits scored at once (4 MiB: a block that stays in cache is 3x faster on CPU)
FIRST = "Repeat the previous context exactly."
LATER = "Repeat the part of the previous context exactly, starting with"


def reconstruction_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    prompt: int,
    scaling: float,
    lse: torch.Tensor,
    counted: torch.Tensor,
) -> torch.Tensor:
    """The most attention any real query of this step pays each counted prompt position, over the
    query heads of each KV head: ``[b, kv_heads, prompt]`` float32, 0 where not counted.

    ``query [b, q_heads, new, d]`` are the step's queries, the newest of ``keys [b, kv_heads, prompt +
    new, d]``; ``valid [b, prompt + new]`` marks real tokens; ``lse [b, q_heads, new]`` is each query's
    log-normaliser, from the attention the pass computed; ``counted [b, prompt]``: the real prompt
    positions scored and kept in each query's softmax (the context and its sinks). A weight is
    ``exp(scaling q.k - lse')``, ``lse'`` the normaliser without the positions not counted, and exp is
    increasing, so no softmax is taken: the largest ``scaling q.k - lse'`` over the queries and query
    heads is found a block of queries at a time (all KV heads at once, ``-lse`` folded into the
    product as a last dimension), and only the maxima are exponentiated."""
    batch, q_heads, new, dim = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    best = torch.full((batch * kv_heads, prompt), -torch.inf, dtype=torch.float32, device=keys.device)
    prompt_keys = keys[:, :, :prompt].float().transpose(-1, -2).reshape(batch * kv_heads, dim, prompt)
    # a row of ones meets -lse
    prompt_keys = torch.cat([prompt_keys, prompt_keys.new_ones(batch * kv_heads, 1, prompt)], dim=1)
    offset = -lse.masked_fill(~valid[:, None, prompt:], torch.inf)  # -lse, and -inf for padding queries
    dropped = valid[:, :prompt] & ~counted  # attended by the pass, left out of its softmax here
    # they open the prompt: its first columns
    width = int(dropped.nonzero()[:, 1].max()) + 1 if bool(dropped.any()) else 0
    left_out = dropped[:, None, :width].expand(-1, kv_heads, -1).reshape(batch * kv_heads, 1, width)
    rows = max(1, SCORE_ELEMENTS // (batch * q_heads * prompt))
    for start in range(0, new, rows):
        end = min(new, start + rows)
        block = torch.cat([query[:, :, start:end].float() * scaling, offset[:, :, start:end, None]], dim=-1)
        # a KV head's query heads stacked
        logits = torch.bmm(block.reshape(batch * kv_heads, group * (end - start), dim + 1), prompt_keys)
        if width:  # renormalise without them: lse' = lse + log(1 - their share of the softmax)
            share = logits[..., :width].masked_fill(~left_out, -torch.inf).logsumexp(dim=-1, keepdim=True)
            logits -= torch.log1p(-share.exp().clamp(max=1 - 1e-6))
        best = torch.maximum(best, logits.amax(dim=1))
    best = best.view(batch, kv_heads, prompt).exp_()
    return best.masked_fill_(~counted[:, None, :], 0.0)


@dataclass
class KVzip(PromptMethod):
    """Keep each KV head's ``budget`` prompt positions the model attends to most while repeating the prompt."""

    name: ClassVar[str] = "kvzip"
    not_served: ClassVar[str | None] = (
        "it scores from an observation pass (the model repeating the prompt) that vLLM does not run"
    )
    # the paper's selection: every layer's and head's pairs ranked together
    layers: str = default_of(PromptMethod, "layers", "global")
    chunk: int = param(
        2000, "prompt tokens repeated per step of the reconstruction (bounds the queries scored at once)", minimum=1
    )
    overlap: int = param(8, "tokens before a chunk repeated with the instruction that introduces it", minimum=0)
    sinks: int = param(
        4,
        "the prompt's first tokens scored with the context; the rest of a chat template's opening is left out of the "
        "scores (kept last)",
        minimum=0,
    )
    clustering: str = param(
        "spans",
        "spans: each word or number scored by its best token, kept whole; none: the paper's per-token scores",
        choices=("spans", "none"),
    )

    def queries_needed(self, asked: int | None = None) -> int:
        return 0

    def needs_tokens(self) -> bool:
        return self.clustering == "spans"

    def observation(self) -> Observation:
        return Observation(FIRST, LATER, self.chunk, self.overlap)

    def observe(
        self,
        seen: torch.Tensor | None,
        query: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        prompt: int,
        scaling: float,
        lse: torch.Tensor,
        context: torch.Tensor,
    ) -> torch.Tensor:
        real = valid[:, :prompt]
        counted = real & (context | (prompt_positions(real) < self.sinks))  # the context, and the prompt's first tokens
        scores = reconstruction_scores(query, keys, valid, prompt, scaling, lse, counted)
        return scores if seen is None else torch.maximum(seen, scores)

    def layer_scores(self, layer: ScoredLayer, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        seen = None if layer.observation is None else layer.observation.seen
        if seen is None:
            raise ValueError(
                "KVzip scores from the prompt's reconstruction, which did not run: compress through "
                "kvcompress.generate or kvcompress.compress"
            )
        if self.clustering == "none":
            return seen
        if layer.spans is None:
            raise ValueError(
                "KVzip(clustering='spans') needs the prompt's token ids; the model was called with "
                "embeddings only: use clustering='none'"
            )
        return span_max(seen, layer.spans)
