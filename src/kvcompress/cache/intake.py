"""A layer's intake of its prompt: what it holds while the prompt comes in, before the method compresses.

Apart from the layer's storage and its method's policy: a prompt arriving in blocks
(``longprompt.BlockedPrefill``: each block's real tokens, and of its queries those ``compress`` and a
prefill record need), the last prefill queries a record keeps (``KVCompressCache.record_prefill``),
the observation pass compression may wait for (KVzip: the model repeating the prompt; its steps'
keys and values are attended with the prompt, never stored), and the whole batch's prompt lengths
when the layer holds a group of its rows, and a stored context the prompt continues (a question over
a document prefilled once: ``StoredPrompt``, read, never written; the context's slots come first, each
row moved so its tokens end with the question's, ``tensors.right_aligned``). None of it outlives the
prompt's compression, and only the recorded queries are saved (a stored context's, for the questions
asked of it later: docs/file-format.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..storage.tensors import right_aligned


class StoredPrompt(NamedTuple):
    """A layer's prompt as a later prompt continues it: its slots' keys and values ``[b, h, n, d]``, their
    validity ``[b, n]`` (None: all real), prompt positions ``[b, h, n]`` (None: the slots are the prompt's
    tokens in order), its real tokens ``[b]``, and the last prefill queries it kept ``[b, q_heads, m, d]``
    (None: none) with their scaling."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor | None
    positions: torch.Tensor | None
    tokens: torch.Tensor
    queries: torch.Tensor | None
    scaling: float | None


class PromptIntake:
    """One layer's intake state (see the module docstring); the layer holds one."""

    def __init__(self) -> None:
        self.total: int | None = None  # a prompt arriving in blocks: its length
        self.block_valid: torch.Tensor | None = None  # [b, total]: its real tokens, block by block
        self.block_queries: torch.Tensor | None = None  # the last prefill queries compress needs, block by block
        self.record_window: int | None | bool = False  # False: no record; None: every prefill query
        self.recorded: tuple[torch.Tensor, float] | None = None  # (last prefill queries, scaling)
        self.batch_lengths: torch.Tensor | None = None  # a group of a batch: every row's real prompt tokens (they set the shapes)
        self.observes = False  # compress waits for an observation pass (KVCompressCache.observe_first)
        self.deferred: tuple[torch.Tensor, float] | None = None  # (prefill queries, scaling) compress gets after the pass
        self.passing: tuple[torch.Tensor, torch.Tensor] | None = None  # an observation step's keys and values (prompt + its tokens)
        self.in_pass = False  # the observation pass is running (KVCompressCache.begin_observation)
        self.context: torch.Tensor | None = None  # [b, prompt slots]: what the pass repeats (after each row's opening)
        self.stored: StoredPrompt | None = None  # a stored context this prompt continues (rows already picked)
        self.pads: list[int] = []  # per row: the padding before the new prompt's tokens, which the context moves over
        self.joined_valid: torch.Tensor | None = None  # [b, context + new slots]: real tokens, once the new prompt came
        self.extends = False  # a stored window continued: the next step ends its prompt (WindowLayer.continue_prompt)

    @property
    def in_blocks(self) -> bool:
        """The prompt arrives in blocks (``expect_prompt``)."""
        return self.total is not None

    def keep_block(self, query: torch.Tensor, new_valid: torch.Tensor | None, end: int, needed: int | None) -> None:
        """A prompt block ending at slot ``end``: its tokens' validity ``new_valid [b, q]`` (None: all real)
        and, of its queries, the last ``needed`` (None: all) that ``compress`` or a record reads."""
        start = end - query.shape[-2]
        if new_valid is not None:
            if self.block_valid is None:
                self.block_valid = torch.ones(new_valid.shape[0], self.total, dtype=torch.bool, device=new_valid.device)
            self.block_valid[:, start:end] = new_valid
        needs = [needed, self.record_window if self.record_window is not False else 0]
        kept = None if None in needs else max(needs)
        if kept != 0:
            queries = query if self.block_queries is None else torch.cat([self.block_queries, query], dim=-2)
            self.block_queries = queries if kept is None else queries[..., -kept:, :]

    def whole_prompt(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last block has come: the queries kept and the prompt's validity (None: all real); the
        intake forgets the blocks."""
        query, valid = self.block_queries, self.block_valid
        self.total = self.block_queries = self.block_valid = None
        return query, valid

    def record(self, query: torch.Tensor, scaling: float) -> None:
        """Keep the prefill's last ``record_window`` queries, if a record was asked for."""
        if self.record_window is not False:
            self.recorded = (query if self.record_window is None else query[..., -self.record_window :, :], scaling)

    def continues(self, stored: StoredPrompt, pads: list[int]) -> None:
        """The prompt continues ``stored`` (one row per row of the new prompt, or one for all), whose
        rows' new tokens are led by ``pads`` padding slots."""
        self.stored, self.pads = stored, pads

    def joined(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored context's keys and values, then the new prompt's, rows right-aligned; its validity
        is kept (``joined_valid``)."""
        stored = self.stored
        context_valid = stored.valid if stored.valid is not None else torch.ones(stored.keys.shape[0], stored.keys.shape[-2], dtype=torch.bool)
        new_valid = torch.ones(keys.shape[0], keys.shape[-2], dtype=torch.bool, device=keys.device)
        self.joined_valid = right_aligned(context_valid, new_valid, self.pads, 1, False)
        return right_aligned(stored.keys, keys, self.pads, 2), right_aligned(stored.values, values, self.pads, 2)

    def joined_positions(self, new: int) -> torch.Tensor | None:
        """Prompt positions ``[b, h, context + new slots]`` where the context's slots are not its tokens in
        order (a thinned context), None where they are."""
        stored = self.stored
        if stored.positions is None:
            return None
        batch, heads = self.joined_valid.shape[0], stored.positions.shape[1]
        device = self.joined_valid.device
        counts = torch.tensor([new - pad for pad in self.pads], device=device)
        steps = torch.arange(new, device=device) - (new - counts[:, None])  # [b, new]: 0 at each row's first real token
        tokens = stored.tokens.to(device).expand(batch)
        positions = (tokens[:, None] + steps).masked_fill(steps < 0, -1)[:, None, :].expand(batch, heads, new)
        return right_aligned(stored.positions, positions, self.pads, 2, -1)

    def joined_spans(self, spans: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor:
        """Per-head word spans ``[b, h, context + new slots]`` of a thinned context's slots (at ``positions``,
        per head), from the joined prompt's spans ``spans [b, width]`` (its tokens, rows right-aligned);
        a filler slot is a span of its own."""
        width = spans.shape[-1]
        counts = torch.tensor([new - pad for pad in self.pads], device=spans.device)
        lead = width - (self.stored.tokens.to(spans.device).expand(counts.shape[0]) + counts)  # each row's padding in ``spans``
        columns = (lead[:, None, None] + positions).clamp(0, width - 1)
        per_head = spans[:, None, :].expand(-1, positions.shape[1], -1).gather(2, columns)
        filler = width + torch.arange(positions.shape[-1], device=spans.device)
        return torch.where(positions >= 0, per_head, filler)

    def joined_queries(self, query: torch.Tensor, needed: int | None) -> torch.Tensor:
        """The last ``needed`` (None: all) queries of the joined prompt: the context's kept ones, then
        the new prompt's ``query [b, q_heads, new, d]``, rows right-aligned; an error names what is missing."""
        stored, new = self.stored, query.shape[-2]
        if needed == 0:  # the method reads none
            return query
        kept = 0 if stored.queries is None else stored.queries.shape[-2]
        fewest = new - max(self.pads)
        if (needed is None and kept < stored.keys.shape[-2]) or (needed is not None and needed > kept + fewest):
            wanted = "every query of the context" if needed is None else f"the last {needed} queries"
            raise ValueError(
                f"kvcompress: this method scores with {wanted}, and the stored context kept its last {kept} (the question has {fewest} "
                "tokens); compress the context with kvc.compress(..., query_window=None) to keep them all, or a larger query_window"
            )
        if stored.queries is None:
            return query if needed is None else query[..., -needed:, :]
        joined = right_aligned(stored.queries, query, self.pads, 2)
        return joined[..., -(stored.keys.shape[-2] + new) :, :] if needed is None else joined[..., -needed:, :]  # a query per slot

    def take_deferred(self) -> tuple[torch.Tensor, float]:
        """The prefill queries and scaling compression waited with, forgotten here."""
        deferred, self.deferred = self.deferred, None
        return deferred
