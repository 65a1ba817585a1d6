"""Which prompt positions each KV head keeps, and how a budget is shared, as functions of the scores alone: the
top-scoring positions per head (``select_kept``), a layer's share when every layer's scores are ranked together
(``global_shares``, KVzip's selection), PyramidKV's layer budgets (``pyramid_budgets``) and Ada-KV's allocation over
a layer's heads (``allocate_heads``). The policies in ``prompt`` apply them; serving calls ``select_kept`` too."""

from __future__ import annotations

import math

import torch


def select_kept(
    scores: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick, per row and KV head, the ``counts[row]`` highest-scoring real positions.

    Returns ``(indices, slot_valid)``: ``indices [batch, kv_heads, n]`` with ``n = width`` (default
    ``counts.max()``; a group of a batch takes the batch's),
    ascending within each head, and ``slot_valid [batch, n]``. Rows that keep fewer than ``n``
    tokens get filler slots at the front (pointing at padding or dropped positions) that
    ``slot_valid`` marks False, so every head of a batch stores the same number of slots.
    Ties go to the earlier position.
    """
    batch, heads, seq = scores.shape
    n = int(counts.max()) if width is None else width
    masked = scores.float().masked_fill(~valid[:, None, :], -math.inf)
    # The count-th highest score of each head, found by a partial sort (topk): every score above it is chosen, and of
    # the scores equal to it the earliest, as many as are left (what a stable full sort would choose, at a fraction
    # of its time: 8 x 3 x 2,000 scores in 5 ms against 34 ms here).
    limit = counts.clamp(max=seq)
    most = max(int(limit.max()), 1)
    top = masked.topk(min(most + 1, seq), dim=-1)
    every = bool((limit == n).all())  # every row keeps n: no filler
    full = torch.ones(batch, n, dtype=torch.bool, device=scores.device)
    if every and 0 < n < seq and bool((top.values[..., most - 1] > top.values[..., most]).all()):
        # No tie across any head's boundary: the partial sort's positions are the chosen ones (at 7,500 scores a
        # head, 0.1 ms against 0.35 for the general case).
        return top.indices[..., :most].sort(dim=-1).values, full
    threshold = top.values.gather(-1, (limit - 1).clamp(min=0)[:, None, None].expand(batch, heads, 1))
    above, tied = masked > threshold, masked == threshold
    room = limit[:, None, None] - above.sum(dim=-1, keepdim=True)
    chosen = (above | (tied & (tied.cumsum(dim=-1) <= room))) & (limit > 0)[:, None, None]
    if every:  # its chosen positions in order
        return chosen.nonzero()[:, 2].view(batch, heads, n), full
    positions = torch.arange(seq, device=scores.device)
    # Chosen positions sort after every filler candidate; among fillers the latest positions win.
    sort_key = torch.where(chosen, positions + seq, positions)
    picked = sort_key.topk(n, dim=-1).values.sort(dim=-1).values
    indices = torch.where(picked >= seq, picked - seq, picked)
    slot_valid = (picked >= seq)[:, 0, :]
    return indices, slot_valid


def global_shares(scores: list[torch.Tensor], valid: torch.Tensor, free: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's share of each row's budget when every layer's scores are ranked together: of the
    ``layers * heads * free[row]`` highest finite scores of a row over all layers ``scores [b, heads,
    seq]`` (real positions only; ``+inf``, pinned by the method, stays out), the fraction that falls
    in each layer, times the number of layers (1.0: the uniform share). Ties go to the lower layer,
    then the lower head and the earlier position. Returns a ``[b]`` float64 tensor per layer."""
    stacked = torch.stack([s.float() for s in scores])  # [layers, b, heads, seq]
    layers, batch, heads, seq = stacked.shape
    finite = stacked.masked_fill(~valid[None, :, None, :] | (stacked == math.inf), -math.inf)
    shares = torch.zeros(layers, batch, dtype=torch.float64, device=stacked.device)
    for row in range(batch):
        flat = finite[:, row].reshape(-1)
        room = min(layers * heads * int(free[row]), int((flat > -math.inf).sum()))
        if room == 0:
            shares[:, row] = 1.0
            continue
        winners = flat.argsort(descending=True, stable=True)[:room] // (heads * seq)
        shares[:, row] = torch.bincount(winners, minlength=layers).double() * layers / room
    return list(shares)


def pyramid_budgets(budget: int, layers: int, beta: float) -> list[int]:
    """PyramidKV's schedule: layer budgets falling linearly from ``2 * budget - budget / beta``
    (first layer) to ``budget / beta`` (last), summing to ``layers * budget`` exactly."""
    low = budget / beta
    high = 2 * budget - low
    raw = [high - (high - low) * i / max(1, layers - 1) for i in range(layers)]
    rounded = [max(1, int(x)) for x in raw]
    for i in sorted(range(layers), key=lambda i: rounded[i] - raw[i])[: layers * budget - sum(rounded)]:
        rounded[i] += 1  # hand the rounding remainder to the layers rounded down most
    return rounded


def allocate_heads(scores: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, floor: float) -> torch.Tensor:
    """Ada-KV's allocation over a layer's heads: ``[b, kv_heads, seq]`` bool, the positions kept.

    Positions scored ``+inf`` (SnapKV's window, sinks, recent tokens) are kept by every head and
    stay out of the sharing, as in Ada-KV, where the window is kept apart. The rest of a row's
    budget, ``free = counts[row] - pinned`` per head, is shared: the ``heads * free`` highest finite
    scores of all heads together give each head a count, which the safeguard mixes with the uniform
    share, ``floor * free + (1 - floor) * count`` (so every head keeps at least ``floor * free``),
    rounded by largest remainders (ties to the lower head) so the row's total stays the uniform
    budget's. Each head then keeps its own best. Ties go to the lower head, then the earlier position;
    padding is never kept."""
    batch, heads, seq = scores.shape
    masked = scores.float().masked_fill(~valid[:, None, :], -math.inf)
    pinned = masked == math.inf
    order = masked.argsort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(masked, dtype=torch.bool)
    for row in range(batch):
        always = int(pinned[row, 0].sum())
        free = max(0, int(counts[row]) - always)
        shared = masked[row].masked_fill(pinned[row], -math.inf).flatten()
        winners = shared.argsort(descending=True, stable=True)[: heads * free] // seq
        share = floor * free + (1 - floor) * torch.bincount(winners, minlength=heads).double()
        room = share.floor().long()
        fraction = (share - room).tolist()
        for head in sorted(range(heads), key=lambda h: -fraction[h])[: heads * free - int(room.sum())]:
            room[head] += 1
        for head in range(heads):
            keep[row, head, order[row, head, : always + int(room[head])]] = True
    return keep & valid[:, None, :]
