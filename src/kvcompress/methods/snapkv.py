"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

At the end of prefill, in every layer, the last ``window`` prompt tokens (the observation window)
vote with their attention on the earlier positions (the prefix). Votes are summed over the window
queries, clustered with a 1-D pooling over positions, averaged over the query heads that share a
KV head (GQA), and each KV head keeps its top ``budget - window`` prefix positions plus the whole
window (Sec. 4, Listing 1). Decoding then runs on this constant-size prompt cache.

Clustering. The paper clusters with the pooling alone: a kept position keeps ``kernel // 2``
neighbours on each side. When the tokenizer splits a value into many tokens (every digit of a
number, for Qwen, Mistral, Llama 2, SmolLM2), the votes peak on the key phrase before the value and
the pooling keeps only its first digits ("481" for "4817"). The default ``clustering="spans"``
pools as the paper does, then gives every token of a word or number the highest pooled score in
it (``tokens.span_max``), so a value is kept whole or not at all; ``clustering="pool"`` is the
paper's Listing 1 exactly (docs/accuracy.md measures both).

Votes. The paper sums each prefix position's attention over the window's queries. ``votes="max"``
takes each position's largest attention from any one window query instead: a question's generic words
("What is the code of the") spread their attention over every sentence that shares them, and their
sum can outvote the one sentence the question's distinctive words pick; a maximum keeps that peak
(docs/accuracy.md: on the embedded model, per question over a stored context, 0.92 / 0.94 of the full
cache's score at budgets 64 / 256 against the sum's 0.77 / 0.88 in the same run). It is the default because it wins
by agreement with the full cache on both real models and both wordings (SmolLM2 0.936 against 0.916, Gemma 3 270M
0.871 against 0.631, RULER's wording 0.899 against 0.876, all at 1/16); ``votes="sum"`` is the paper's.

Window. Over a stored context (a question asked of a document prefilled once), ``question_window`` stops the
window at the context's end: only the tokens after it vote and are kept whole (the question, its separator and the
template's end; in a conversation, every turn since the context), at most ``window`` of them. The context's last
tokens are then scored as any other instead of voting for the context's end and taking budget (docs/accuracy.md,
"A window from the question"). A conversation's turns since the context are longer than the window, so there it is
the last ``window`` tokens as before: a window of the newest message alone would let the earlier answers go.

Pooling. The paper's experiments pool the votes with a maximum, its tutorial with an average, and it reports no
significant difference (Sec. 5.2). With maximum votes the average is the default since 11-28: a position's score is
then its neighbourhood's mean vote, so one query's spike on a lone token counts less than a phrase the question's
words agree on. By agreement at 1/16 on Gemma 3 270M (one KV head for four query heads) it gains +0.053 per request
and +0.022 per conversation turn over a stored context; on SmolLM2 it moves no track beyond +-0.006
(docs/accuracy.md, "Average pooling").

Defaults otherwise follow the paper's LongBench setting (window 32, kernel 7, budget 1024, Sec. 5.3); its
needle-in-a-haystack setting is window 16, kernel 5 (Sec. 5.1.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from ..cache.policy import ScoredLayer
from ..cache.tokens import span_max
from ..storage.attention import grouped_logits, key_probabilities
from .base import check_reserved
from .bounded import HeldTokens
from .fields import param, require
from .prompt import PromptMethod

if TYPE_CHECKING:
    from .bounded import BoundedPolicy

POOLINGS = ("max", "avg")
CLUSTERINGS = ("spans", "pool")
VOTES = ("sum", "max")
VOTING_BYTES = 2 << 20  # the most float32 window attention ``window_votes`` holds at once (about a core's L2)


def window_attention(
    query_window: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, heads: slice | None = None
) -> torch.Tensor:
    """Attention of the window queries over all prompt keys, float32 ``[batch, q_heads, window, seq]``.

    Causal inside the window; padding keys (``valid`` False) get no weight; a learned sink (gpt-oss)
    takes its share of each row (``attention.key_probabilities``; ``heads``: which query heads these are)."""
    window, seq = query_window.shape[-2], keys.shape[-2]
    logits = grouped_logits(query_window, keys, scaling)
    lowest = torch.finfo(torch.float32).min
    if not bool(valid.all()):  # (a prompt without padding, as a served one: a pass over the logits saved)
        logits.masked_fill_(~valid[:, None, None, :], lowest)
    later = torch.ones(window, window, dtype=torch.bool, device=keys.device).triu(1)  # keys after each query
    logits[..., seq - window :].masked_fill_(later, lowest)  # (every key before the window precedes every query)
    return key_probabilities(logits, heads)


def prefix_votes(attention: torch.Tensor, votes: str = "sum", voters: torch.Tensor | None = None) -> torch.Tensor:
    """The window's attention on each prefix position ``[batch, q_heads, seq - window]``: summed over the window's
    queries (the paper), or the largest of them (``votes="max"``). ``voters [batch]``: only each row's last
    ``voters`` queries vote, on every position before them (``[batch, q_heads, seq]``, zero from each row's
    first voter on)."""
    window, seq = attention.shape[-2:]
    if voters is None:
        prefix = attention[..., : seq - window]
    elif bool((voters >= window).all()):  # every query votes (a served question): no mask, a pass over them saved
        prefix = attention
    else:
        voting = torch.arange(window, device=attention.device) >= window - voters[:, None]  # [b, window]
        prefix = attention * voting[:, None, :, None]
    voted = prefix.sum(dim=-2) if votes == "sum" else prefix.amax(dim=-2)
    return voted if voters is None else voted.masked_fill(voter_positions(voters, seq)[:, None], 0.0)


def voter_positions(voters: torch.Tensor, seq: int) -> torch.Tensor:
    """``[batch, seq]``: True at each row's last ``voters`` positions (its window, kept whole)."""
    return torch.arange(seq, device=voters.device) >= seq - voters[:, None]


def window_votes(
    query_window: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    votes: str = "sum",
    voters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``prefix_votes(window_attention(...), votes, voters)``, as many KV heads (and their query heads) at a time as
    keep the float32 attention held at once under ``VOTING_BYTES``: a long prompt's heads one by one (its attention
    bounded, and each head's read back from the cache its product wrote it to: on SmolLM2 at 7,500 tokens, all three
    at once took 3.9 ms a layer against 3.1), a short one's in one pass (at 2,000 tokens 0.9 ms against 1.15: three
    passes' calls cost more than their softmax). A window wider than a head's dimension keeps one head at a time
    whatever the length: all heads' attention would then outgrow the prompt's own hidden states."""
    batch, kv_heads, seq = keys.shape[0], keys.shape[1], keys.shape[2]
    group, rows, dim = query_window.shape[1] // kv_heads, query_window.shape[2], query_window.shape[3]
    per_head = 4 * batch * group * rows * seq
    step = 1 if rows > dim else max(1, min(kv_heads, VOTING_BYTES // max(per_head, 1)))
    parts = [
        prefix_votes(
            window_attention(
                query_window[:, h * group : (h + step) * group],
                keys[:, h : h + step],
                valid,
                scaling,
                slice(h * group, (h + step) * group),
            ),
            votes,
            voters,
        )
        for h in range(0, kv_heads, step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def pool_votes(votes: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling over positions (kernel odd, stride 1, padding ``kernel // 2``): the clustering
    step that keeps the neighbours of a selected position (Sec. 4.3)."""
    if kernel == 1:
        return votes
    flat = votes.reshape(-1, 1, votes.shape[-1])
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2).view_as(votes)


def average_over_groups(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Mean over the query heads of each KV head: ``[b, q_heads, s] -> [b, kv_heads, s]``."""
    batch, q_heads, seq = scores.shape
    return scores.view(batch, kv_heads, q_heads // kv_heads, seq).mean(dim=2)


def snapkv_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    window: int,
    kernel: int,
    pooling: str,
    votes: str = "sum",
    voters: torch.Tensor | None = None,
) -> torch.Tensor:
    """SnapKV importance ``[batch, kv_heads, seq]``: pooled window votes on the prefix, ``+inf`` on
    the window so it is always kept. ``voters [batch]`` (at most ``window``): each row's window is its last
    ``voters`` tokens instead (the rest of the last ``window`` are its prefix, voted on like any), and only the last
    ``voters.max()`` queries are read (a served question computes only its own)."""
    rows = window if voters is None else max(int(voters.max()), 1)  # (the window's other queries vote for nothing)
    voted = window_votes(query[..., -rows:, :], keys, valid, scaling, votes, voters)
    prefix = average_over_groups(pool_votes(voted, kernel, pooling), keys.shape[1])
    if voters is not None:  # (the pooling saw zeros past each row's prefix, as its padding would be)
        return prefix.masked_fill(voter_positions(voters, keys.shape[-2])[:, None], math.inf)
    always = torch.full((*prefix.shape[:2], window), math.inf, device=prefix.device)
    return torch.cat([prefix, always], dim=-1)


@dataclass
class SnapKV(PromptMethod):
    """Keep each KV head's top ``budget - window`` prompt positions (by window votes) plus the window.

    ``budget`` counts the window; with ``ratio`` each prompt keeps ``ceil(ratio * length)`` tokens
    (at least the window). A prompt no longer than its budget is left untouched."""

    name: ClassVar[str] = "snapkv"
    not_served: ClassVar[str | None] = None  # vLLM serves it (docs/vllm.md)
    unrecorded_meant: ClassVar[dict[str, Any]] = {"votes": "sum", "question_window": False}  # defaults before 11-28
    window: int = param(32, "observation window: the last prompt tokens that vote (always kept)", minimum=1)
    kernel: int = param(7, "pooling kernel over positions, odd (1 = no pooling)", minimum=1)
    pooling: str = param(
        "avg",
        "pooling of the votes over each position's kernel neighbours: avg (the default since "
        "11-28) or max (the paper's experiments)",
        choices=POOLINGS,
    )
    clustering: str = param(
        "spans",
        "spans: pooled votes shared by each word or number, kept whole; pool: the paper's pooling alone",
        choices=CLUSTERINGS,
    )
    votes: str = param(
        "max",
        "max: a position's largest attention from any window query; sum: summed over the window (the paper)",
        choices=VOTES,
    )
    question_window: bool = param(
        True,
        "over a stored context: only the tokens after it (a question, a conversation's turns) vote and are kept "
        "as the window, at most window of them; the context's last tokens are scored as any other",
    )

    def validate(self) -> None:
        super().validate()
        require(
            self.kernel % 2 == 1,
            "{owner}: {kernel=} is invalid; it must be a positive odd integer (1 = no pooling)",
            owner="SnapKV",
            kernel=self.kernel,
        )
        if self.ratio is None:
            check_reserved("SnapKV", self.budget_tokens, "window", self.window, "observation window")

    def reserved_tokens(self) -> int:
        return self.window

    def queries_needed(self, asked: int | None = None) -> int:
        """The window; where the question's tokens are known (``asked``) and vote alone, only those of them."""
        return self.window if asked is None or not self.question_window else min(self.window, asked)

    def needs_tokens(self) -> bool:
        return self.clustering == "spans"

    def layer_scores(self, layer: ScoredLayer, query: torch.Tensor | None, scaling: float) -> torch.Tensor:
        asked = layer.asked if self.question_window else None  # (after a stored context, or a served question)
        return self.scores(
            query,
            layer.keys,
            layer.slot_validity(),
            scaling,
            layer.spans,
            None if asked is None else asked.clamp(max=self.window),
        )

    def scores(
        self,
        query: torch.Tensor | None,
        keys: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        spans: torch.Tensor | None = None,
        voters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        voting = self.window if voters is None else int(voters.max())
        if query is None or query.shape[-2] < voting:
            raise ValueError(
                f"SnapKV: window={self.window} needs the last {self.window} prefill queries but got "
                f"{0 if query is None else query.shape[-2]} "
                "(pass kvcompress.prefill(..., query_window=...) at least as large as the largest window)"
            )
        scores = snapkv_scores(query, keys, valid, scaling, self.window, self.kernel, self.pooling, self.votes, voters)
        if self.clustering == "pool":
            return scores
        if spans is None:
            raise ValueError(
                "SnapKV(clustering='spans') needs the prompt's token ids; the model was called with embeddings only: "
                "use clustering='pool'"
            )
        return span_max(scores, spans)

    @property
    def decode_window_tokens(self) -> int:
        return self.decode_window if self.decode_window is not None else self.window

    def decode_scores(
        self, policy: BoundedPolicy, held: HeldTokens, query: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """The paper's selection with the last steps as its observation window: their pooled votes on every held
        token before them (answer tokens have no recorded word spans, so the pooling clusters them alone)."""
        return snapkv_scores(
            query, held.keys, held.valid, scaling, query.shape[-2], self.kernel, self.pooling, self.votes
        )
