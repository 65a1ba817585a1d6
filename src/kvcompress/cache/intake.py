"""The ways a layer's prompt comes in, each a small object that ends in one whole-prompt record.

Whatever the way, compression reads the same thing: the prompt's keys and values in the layer's storage and a
``PromptRecord`` (the queries the method reads, which slots are real tokens, where a thinned context's slots sit,
their word spans). The ways:

* ``OneForward``: the whole prompt in one forward, held as the prefill computed it;
* ``InBlocks``: a long prompt in blocks (``longprompt.BlockedPrefill``), written into one buffer, each block's real
  tokens and the last queries compression needs kept until the last block;
* ``OverStored``: a prompt continuing a stored context (a question over a document prefilled once: a
  ``StoredPrompt``, read, never written); the context's slots come first, each row moved so its tokens end with
  the question's (``tensors.right_aligned``), and the record is the joined prompt's;
* ``recorded_prompt``: a prefill record (an uncompressed layer that kept its last queries) copied in whole;
* ``ObservationPass``: not a way in but a detour after one (KVzip: the model repeating the prompt); its steps'
  keys and values are attended with the prompt, never stored, and compression waits with the record.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch

from ..storage.dense import DenseSlots
from ..storage.tensors import right_aligned
from .errors import CacheMisuseError


class PromptRecord(NamedTuple):
    """The whole prompt as compression reads it (its keys and values are the layer's slots): the prefill's last
    queries the method or a record reads ``[b, q_heads, m, d]``, each slot's validity ``[b, slots]`` (None: all
    real), the scaling, the slots' prompt positions ``[b, h, slots]`` where they are not the tokens in order (a
    thinned context; None otherwise), their word spans where the way in changed them (None: as held), and the tokens
    each row added after a stored context ``[b]`` (a question and what followed; None: the prompt continues none)."""

    query: torch.Tensor | None
    valid: torch.Tensor | None
    scaling: float
    positions: torch.Tensor | None = None
    spans: torch.Tensor | None = None
    asked: torch.Tensor | None = None


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


def left_padded(valid: torch.Tensor) -> torch.Tensor:
    """``valid [b, slots]``, refused where a row has padding after its real tokens."""
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError(
            "kvcompress needs left-padded batches (padding before each prompt, as tokenizer.padding_side='left' "
            "gives); this batch has padding after real tokens"
        )
    return valid


def queries_to_keep(needed: int | None, record: int | None | bool) -> int | None:
    """The last prefill queries a prompt must keep for its method (``needed``) and a record (``record``; False:
    none asked): the larger, None meaning all of them."""
    wanted = [needed, 0 if record is False else record]
    return None if None in wanted else max(w for w in wanted if w is not None)


class Intake:
    """One way a prompt comes in: ``take`` stores a forward's keys and values and returns what its prefill
    attention reads; ``commit`` returns the whole prompt's record once its last token has come (None before).
    ``joined_valid``: the slots' validity where transformers' mask does not describe them (None: it does)."""

    joined_valid: torch.Tensor | None = None

    def take(self, slots: DenseSlots, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def commit(
        self, slots: DenseSlots, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float, keep: int | None
    ) -> PromptRecord | None:
        """After the forward's attention (the storage's lengths moved past it): ``keep`` is how many of the last
        queries compression and a record read (None: all)."""
        raise NotImplementedError


class OneForward(Intake):
    """The whole prompt in one forward, held as computed (not copied)."""

    def take(self, slots: DenseSlots, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots.hold(keys, values)
        view = slots.view()
        return view.keys, view.values

    def commit(
        self, slots: DenseSlots, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float, keep: int | None
    ) -> PromptRecord:
        return PromptRecord(query, new_valid, scaling)


class InBlocks(Intake):
    """A prompt of ``total`` tokens arriving in blocks, each written into one buffer; its real tokens and the last
    queries compression reads are kept block by block."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.valid: torch.Tensor | None = None  # [b, total]: real tokens, block by block (None: all so far)
        self.queries: torch.Tensor | None = None  # the last queries kept, block by block

    def take(self, slots: DenseSlots, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = slots.used + keys.shape[-2]  # the blocks so far (the lengths move when the step commits)
        slots.write_block(keys, values, self.total)
        view = slots.view()
        return view.keys[:, :, :end], view.values[:, :, :end]

    def commit(
        self, slots: DenseSlots, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float, keep: int | None
    ) -> PromptRecord | None:
        end = slots.used
        if new_valid is not None:
            if self.valid is None:
                self.valid = torch.ones(new_valid.shape[0], self.total, dtype=torch.bool, device=new_valid.device)
            self.valid[:, end - query.shape[-2] : end] = new_valid
        if keep != 0:
            queries = query if self.queries is None else torch.cat([self.queries, query], dim=-2)
            self.queries = queries if keep is None else queries[..., -keep:, :]
        return PromptRecord(self.queries, self.valid, scaling) if end >= self.total else None


class OverStored(Intake):
    """A prompt continuing ``stored`` (one row per row of the new prompt, or one for all), whose rows' new tokens
    are led by ``pads`` padding slots: the context's slots, then the prompt's, every row ending together."""

    def __init__(self, stored: StoredPrompt, pads: list[int], spans: torch.Tensor | None) -> None:
        self.stored, self.pads, self.spans = stored, pads, spans

    def take(self, slots: DenseSlots, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stored = self.stored
        context_valid = stored.valid
        if context_valid is None:
            context_valid = torch.ones(stored.keys.shape[0], stored.keys.shape[-2], dtype=torch.bool)
        new_valid = torch.ones(keys.shape[0], keys.shape[-2], dtype=torch.bool, device=keys.device)
        self.joined_valid = right_aligned(context_valid, new_valid, self.pads, 1, False)
        slots.hold(right_aligned(stored.keys, keys, self.pads, 2), right_aligned(stored.values, values, self.pads, 2))
        view = slots.view()
        return view.keys, view.values

    def commit(
        self, slots: DenseSlots, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float, keep: int | None
    ) -> PromptRecord:
        new = slots.view().keys.shape[-2] - self.stored.keys.shape[-2]
        positions = self.joined_positions(new)
        spans = None if positions is None or self.spans is None else self.joined_spans(self.spans, positions, new)
        return PromptRecord(
            self.joined_queries(query, keep),
            self.joined_valid,
            scaling,
            positions,
            spans,
            self.asked_tokens(new, query.device),
        )

    def asked_tokens(self, new: int, device: torch.device) -> torch.Tensor:
        """``[b]``: each row's real tokens among the ``new`` slots after the stored context (its pads lead them)."""
        return torch.tensor([new - pad for pad in self.pads], device=device)

    def joined_positions(self, new: int) -> torch.Tensor | None:
        """Prompt positions ``[b, h, context + new slots]`` where the context's slots are not its tokens in
        order (a thinned context), None where they are."""
        stored = self.stored
        if stored.positions is None:
            return None
        joined_valid = cast(torch.Tensor, self.joined_valid)  # take set it
        batch, heads = joined_valid.shape[0], stored.positions.shape[1]
        device = joined_valid.device
        counts = self.asked_tokens(new, device)
        steps = torch.arange(new, device=device) - (new - counts[:, None])  # [b, new]: 0 at each row's first real token
        tokens = stored.tokens.to(device).expand(batch)
        positions = (tokens[:, None] + steps).masked_fill(steps < 0, -1)[:, None, :].expand(batch, heads, new)
        return right_aligned(stored.positions, positions, self.pads, 2, -1)

    def joined_spans(self, spans: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor:
        """Per-head word spans ``[b, h, context + new slots]`` of a thinned context's slots (at ``positions``,
        per head), from the joined prompt's spans ``spans [b, width]`` (its tokens, rows right-aligned);
        a filler slot is a span of its own."""
        width = spans.shape[-1]
        counts = self.asked_tokens(new, spans.device)
        lead = width - (self.stored.tokens.to(spans.device).expand(counts.shape[0]) + counts)  # each row's padding
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
            kept_what = (
                f"this method scores with {wanted}, and the stored context kept its last {kept} (the "
                f"question has {fewest} tokens)"
            )
            raise CacheMisuseError(
                f"kvcompress: {kept_what}; compress the context with kvc.compress(..., query_window=None) to keep them "
                "all, or a larger query_window",
                cli=f"{kept_what}; store the document with `kvcompress compress --method full --query-window all` to "
                "keep them all, or a larger --query-window",
            )
        if stored.queries is None:
            return query if needed is None else query[..., -needed:, :]
        joined = right_aligned(stored.queries, query, self.pads, 2)
        return joined[..., -(stored.keys.shape[-2] + new) :, :] if needed is None else joined[..., -needed:, :]


def recorded_prompt(source: Any, slots: DenseSlots) -> PromptRecord:
    """A prefill record's prompt (``source``: an uncompressed layer that kept its last queries) copied into
    ``slots``, and its record."""
    if source.queries is None:
        raise CacheMisuseError("kvcompress: the prefill record has no queries for this layer")
    prompt = slice(0, source.prefill_len)
    slots.set(source.keys[:, :, prompt], source.values[:, :, prompt])
    slots.seen = source.prefill_len
    held = source.slots.view(decoded=False).valid
    valid = None if held is None else held[:, prompt]
    return PromptRecord(source.queries, valid, source.query_scaling)


class ObservationPass:
    """The detour a method with an observation pass takes after its prompt (KVzip): the prompt's record waits
    (``record``) while each of the pass's steps attends the prompt's ``prompt_len`` slots and its own keys, never
    stored; ``context`` marks the prompt slots the pass repeats, ``seen`` is what the method kept of it so far."""

    def __init__(self, record: PromptRecord, prompt_len: int) -> None:
        self.record, self.prompt_len = record, prompt_len
        self.context: torch.Tensor | None = None  # [b, prompt slots], set when the pass begins
        self.seen: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None  # a step's keys (the prompt's, then its own), until it commits

    def take(
        self, held: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's keys and values (``held``: the layer's slots), then the step's own."""
        prompt = slice(0, self.prompt_len)
        joined = (torch.cat([held[0][:, :, prompt], keys], dim=-2), torch.cat([held[1][:, :, prompt], values], dim=-2))
        self.keys = joined[0]
        return joined

    def step(
        self, query: torch.Tensor, new_valid: torch.Tensor | None, prompt_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's keys and the validity of prompt and step ``[b, prompt + new]`` (the step is forgotten)."""
        keys, self.keys = cast(torch.Tensor, self.keys), None  # take set them
        new = new_valid if new_valid is not None else keys.new_ones(keys.shape[0], query.shape[-2], dtype=torch.bool)
        return keys, torch.cat([prompt_valid, new], dim=-1)
