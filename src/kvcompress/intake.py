"""A layer's intake of its prompt: what it holds while the prompt comes in, before the method compresses.

Apart from the layer's storage and its method's policy: a prompt arriving in blocks
(``longprompt.BlockedPrefill``: each block's real tokens, and of its queries those ``compress`` and a
prefill record need), the last prefill queries a record keeps (``KVCompressCache.record_prefill``),
the observation pass compression may wait for (KVzip: the model repeating the prompt; its steps'
keys and values are attended with the prompt, never stored), and the whole batch's prompt lengths
when the layer holds a group of its rows. None of it outlives the prompt's compression, and none of
it is saved: a layer is saved at rest.
"""

from __future__ import annotations

import torch


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

    def take_deferred(self) -> tuple[torch.Tensor, float]:
        """The prefill queries and scaling compression waited with, forgotten here."""
        deferred, self.deferred = self.deferred, None
        return deferred
