"""The measurements SnapKV and ShadowKV are built on (their Sec. 3), as functions of attention maps and keys.

SnapKV (the LaTeX source's Sec. 3): the observation window's queries vote for the prefix positions
they attend to; each head's top ``p`` (5%) of the prefix by votes is its selection, ``vote_mask``. A
generated token's attention above ``theta`` (0.05) on a prefix position marks it significant,
``significant``. The hit rate ``H`` is the share of significant positions the selection holds,
``hit_rate``: high along the generation, lower between two question-answer pairs of one document.

ShadowKV (Sec. 3): ``relative_spectrum`` (singular values over the largest: pre-RoPE keys decay
fastest, Fig. 1a); the similarity of two rank-``r`` subspaces ``D(H1, H2) = <H1, H2>_F / r`` of the
projections ``H = Psi Psi^T`` onto the top right singular vectors of two key matrices,
``subspace_similarity`` (1 for one subspace, 0 for orthogonal ones, Fig. 1b); per chunk of post-RoPE
keys the minimum cosine similarity to the chunk's mean, ``methods.shadowkv.chunk_min_cosine`` (Fig. 3b),
and ``outlier_fraction`` of chunks below a threshold; ``reuse_fraction``, the share of a step's selected
chunks the step before also selected (Fig. 3c).
"""

from __future__ import annotations

import math

import torch


def vote_mask(window_attention: torch.Tensor, share: float = 0.05) -> torch.Tensor:
    """Each head's selection ``[..., heads, prefix]`` bool: the top ``ceil(share * prefix)`` positions by the
    votes the window's queries cast, ``window_attention [..., heads, window, prefix]`` summed over the window."""
    votes = window_attention.float().sum(dim=-2)
    count = max(1, math.ceil(share * votes.shape[-1]))
    chosen = votes.topk(count, dim=-1).indices
    return torch.zeros_like(votes, dtype=torch.bool).scatter_(-1, chosen, True)


def significant(attention: torch.Tensor, theta: float = 0.05) -> torch.Tensor:
    """Positions a query attends to above ``theta`` (``attention [..., prefix]``, one row per query and head)."""
    return attention > theta


def hit_rate(significant_mask: torch.Tensor, selection: torch.Tensor) -> float | None:
    """``H``: the significant positions (``[..., prefix]``) the selection (same shape, or broadcast) holds,
    over all significant positions; None where nothing is significant."""
    total = int(significant_mask.sum())
    if total == 0:
        return None
    return float((significant_mask & selection).sum()) / total


def relative_spectrum(matrix: torch.Tensor) -> torch.Tensor:
    """Singular values of ``matrix [n, d]`` over the largest (descending, in [0, 1])."""
    values = torch.linalg.svdvals(matrix.float())
    return values / values[0] if values[0] > 0 else values


def top_subspace(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """``Psi [d, rank]``: the top ``rank`` right singular vectors of ``matrix [n, d]`` (orthonormal columns)."""
    return torch.linalg.svd(matrix.float(), full_matrices=False).Vh[:rank].T


def subspace_similarity(first: torch.Tensor, second: torch.Tensor) -> float:
    """``D(H1, H2) = <H1, H2>_F / r`` for the projections ``H = Psi Psi^T`` of two ``[d, r]`` orthonormal bases:
    ``||Psi1^T Psi2||_F^2 / r``, in [0, 1] (1: one subspace, 0: orthogonal subspaces)."""
    rank = first.shape[-1]
    return float((first.T @ second).square().sum()) / rank


def outlier_fraction(min_cosine: torch.Tensor, threshold: float) -> float:
    """The share of chunks whose keys' minimum cosine similarity to their mean is under ``threshold``."""
    return float((min_cosine < threshold).float().mean())


def reuse_fraction(before: torch.Tensor, now: torch.Tensor) -> float:
    """The share of the chunks selected now (ids ``[..., k]``) that the step before also selected (same heads)."""
    again = (now[..., :, None] == before[..., None, :]).any(dim=-1)
    return float(again.float().mean())
