"""A layer's prompt, from its prefill to its compression: blocks of a long prompt, an observation pass the
compression waits for, a prefill record, a stored context continued; then each later step committed.

Mixed into ``KVLayer`` (layer.py), whose ``__init__`` declares the state these methods read; what the layer
holds while its prompt comes in is its ``intake`` (intake.py).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .errors import CacheMisuseError
from .intake import StoredPrompt


class PromptLifecycle:
    """The prompt's way through a layer: ``commit`` after each step's attention, ``_end_prefill`` once the
    whole prompt is held, then the method's ``compress`` (timed), at once or after an observation pass."""

    def expect_prompt(self, total: int) -> None:
        """The prompt will arrive in blocks, ``total`` tokens in all (``longprompt.BlockedPrefill``):
        each block is written into one buffer, and the layer compresses after the last."""
        self.intake.total = total

    @property
    def is_prefill(self) -> bool:
        """True while the layer holds only its first fill (the prompt), before ``compress``."""
        return not self.prefilled

    @property
    def observing(self) -> bool:
        """True between the prefill and the end of its observation pass (``compress`` waits for it)."""
        return self.intake.deferred is not None

    def commit(self, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float, lse: torch.Tensor | None = None) -> None:
        """Record which new tokens are real (``new_valid [b, q]``; None: all); after the first fill, let the method
        compress. ``lse``: an observation pass's log-normalisers (``KVLayer.observe``)."""
        self.awaiting_commit = False
        if self.observing:
            keys, self.intake.passing = self.intake.passing[0], None
            new = query.shape[-2]
            valid = torch.cat([self.slot_validity(), new_valid if new_valid is not None else keys.new_ones(keys.shape[0], new, dtype=torch.bool)], dim=-1)
            self.observe(query, keys, valid, scaling, lse, self.intake.context)
            return
        if not torch.compiler.is_compiling():  # a compiled step's loop moves them after the step (cache.advance)
            self.advance(query.shape[-2])
        if self.is_prefill and self.intake.stored is not None:  # the joined prompt: the context's queries and validity too
            query, new_valid = self.intake.joined_queries(query, self.queries_needed()), self.intake.joined_valid
            new = self.keys.shape[-2] - self.intake.stored.keys.shape[-2]
            positions = self.intake.joined_positions(new)
            if positions is not None:  # a thinned context: its slots are not its tokens in order, each head its own
                self.slots.positions = positions
                self.spans = None if self.spans is None else self.intake.joined_spans(self.spans, positions, new)
            self.intake.stored = self.intake.joined_valid = None
        if self.is_prefill and self.intake.in_blocks:  # a prompt in blocks: compressed after its last
            self.intake.keep_block(query, new_valid, self.used, self.queries_needed())
            if self.used < self.intake.total:
                return
            query, new_valid = self.intake.whole_prompt()
        if self.is_prefill:
            self._end_prefill(query, new_valid, scaling)
            return
        if new_valid is not None:  # written without asking the device whether all are real: that would synchronize
            self.slots.mark_padding(new_valid)
        if self.intake.extends:  # a window continuing a stored context: this step is the rest of its prompt
            self.prefill_len += query.shape[-2]
            self.prompt_tokens = self.prompt_tokens + (query.shape[-2] if new_valid is None else new_valid.sum(-1))
            self.intake.extends = False
        self.after_step(query, scaling)
        self.slots.close_step(query.shape[-2])

    def _end_prefill(self, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float) -> None:
        if new_valid is not None and not bool(new_valid.all()):
            if bool((new_valid[:, :-1] & ~new_valid[:, 1:]).any()):
                raise ValueError(
                    "kvcompress needs left-padded batches (padding before each prompt, as tokenizer.padding_side='left' "
                    "gives); this batch has padding after real tokens"
                )
            self.slots.valid = new_valid
        self.prefill_len, self.prefilled = self.keys.shape[-2], True
        self.prompt_tokens = self.slot_validity().sum(dim=-1)
        self.intake.record(query, scaling)
        if self.intake.observes:
            self.intake.deferred = (query, scaling)
            return
        self.timed_compress(query, scaling)

    def timed_compress(self, query: torch.Tensor, scaling: float) -> None:
        _sync(self.keys)
        start = time.perf_counter()
        self.compress(query, scaling)
        _sync(self.keys)
        self.compress_s += time.perf_counter() - start
        if self.intake.record_window is False:
            self.spans = None  # read by compress only (a prefill record keeps them for the methods it makes)

    def end_observation(self) -> None:
        """The observation pass is over: compress as the prefill would have."""
        if self.observing:
            self.timed_compress(*self.intake.take_deferred())

    def load_prefill(self, source: PromptLifecycle) -> None:
        """Fill this empty layer with a prompt recorded by ``source`` (an uncompressed layer that kept
        its last queries), then apply the method as if the prefill had run here."""
        if source.intake.recorded is None:
            raise CacheMisuseError("kvcompress: the prefill record has no queries for this layer")
        self.lazy_initialization(source.keys, source.values)
        self.slots.set(source.keys[:, :, : source.prefill_len], source.values[:, :, : source.prefill_len])
        self.slots.seen = source.prefill_len
        self.spans = source.spans
        query, scaling = source.intake.recorded
        self._end_prefill(query, None if source.valid is None else source.valid[:, : source.prefill_len], scaling)

    def stored_prompt(self) -> StoredPrompt | None:
        """This layer's prompt as a later prompt may continue it, read and never written (a question over
        a stored context); None where its storage cannot be read as one (chunks in a store, packed segments)."""
        held = self.slots.stored() if self.prefilled and self.cursor is None else None
        if held is None:
            return None
        queries, scaling = self.intake.recorded if self.intake.recorded is not None else (None, None)
        return StoredPrompt(*held, self.prompt_tokens, queries, scaling)

    def continue_prompt(self, source: PromptLifecycle, rows: torch.Tensor, pads: list[int], spans: torch.Tensor | None) -> None:
        """This fresh layer's prompt continues ``source``'s (rows ``rows`` of it, one per row of the new prompt,
        whose tokens are led by ``pads`` padding slots): the prefill attends to the stored tokens first and
        the method then compresses the joined prompt; ``source`` is read, never written. ``spans``: the
        joined prompt's word spans ``[b, width]`` (its tokens, rows right-aligned); over a thinned context
        each head's slots take their tokens' spans (``intake.joined_spans``)."""
        stored = source.stored_prompt()
        if stored is None:
            raise CacheMisuseError(
                f"kvcompress: layer {source.layer_idx} of this context ({type(source).__name__}) holds its prompt in a form a question cannot "
                "be prefilled over; compress the context with a method that keeps its tokens (kvc.FullKV(), or a prompt method with "
                "heads='uniform' and layers='uniform')"
            )
        picked = StoredPrompt(*(t.index_select(0, rows.to(t.device)) if isinstance(t, torch.Tensor) else t for t in stored))
        self.intake.continues(picked, pads)
        self.slots.seen, self.slots.used = source.seen_tokens, stored.keys.shape[-2]  # the logical length continued; the context's slots
        self.spans = spans

    def move(self, place: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
        """This layer's tensors through ``place`` (onto ``device``): a layer at rest whose storage a later
        prompt can read (``stored_prompt``), or a window."""
        if not self.is_sliding and self.stored_prompt() is None:
            raise CacheMisuseError(f"kvcompress: layer {self.layer_idx} ({type(self).__name__}) cannot be moved; only a stored context's layers can")
        self._batch_apply(place)
        if self.intake.recorded is not None:
            self.intake.recorded = (place(self.intake.recorded[0]), self.intake.recorded[1])
        self.device = device

    def batch_prompt_tokens(self) -> torch.Tensor:
        """Real prompt tokens of every row of the batch: a cache prefilled for a group of a batch's
        rows compresses them into the shapes the whole batch would take, so the groups can be joined."""
        return self.prompt_tokens if self.intake.batch_lengths is None else self.intake.batch_lengths


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
