"""The KV cache: layers that hold storage and apply a method through a small contract.

``KVCompressCache`` is a transformers ``Cache`` made of one ``KVLayer`` per model layer. A layer
holds its storage, a ``slots.Slots`` object (dense slots, a sliding window's ring, capped slots,
packed per-head segments: one class per layout, knowing no method), which keeps the keys and
values, their validity and positions, the lengths and the batch operations; the layer swaps it for
another layout where a method needs one (head-adaptive budgets pack after compression). It knows
nothing of any method: a method's layer subclasses it and overrides the contract:

* ``compress(query, scaling)``: called once, right after the prefill attention of this layer, while
  the layer holds the whole prompt; decide what to keep (``slots.keep``) or where to store it. A
  method that scores from an observation pass (KVzip: the model repeating the prompt) has it called
  after that pass instead, which ``observe`` watches: the pass's tokens are attended, never stored.
* ``attend(query, keys, values, mask, scaling, softcap)``: the attention of one step over this layer.
* ``after_step(query, scaling)``: called after every later step's tokens are stored.
* ``index_tensors()``: other device tensors it keeps (counted as memory).
* ``stats()``: counters of what the layer holds (bytes on the device, offloaded, read per step, ...),
  summed over layers; the method's ``summarize`` turns the totals into its own fields.
* ``fetch_overlap()``: for layers that read an offload store, the parts the speed benchmark times.
* ``info()``: facts about the layer (a rank, how values are fetched) that every layer should share.
* ``batch_tensors()``: names of its own tensors with a batch dimension (beam search reorders them).

What the layer holds while its prompt comes in (blocks, records, an observation pass) is its
``intake`` (intake.py); what a file saves is its ``state_dict`` (docs/file-format.md).

``get_seq_length`` is the *logical* length (prompt + appended tokens, padding included), so
transformers keeps assigning RoPE positions and slicing generate inputs from the true length.
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, NamedTuple, Protocol

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .intake import PromptIntake, StoredPrompt
from ..storage.slots import DenseSlots, RingSlots, Slots, held_state, inner, nested, on_device
from ..storage.slots import capacity_bucket, spare_slots  # noqa: F401 (where they lived before slots.py)
from ..storage.tensors import nbytes, prompt_positions, to_host
from .tokens import TokenSpans


class UnsupportedModelError(ValueError):
    """The model (or one of its settings) cannot be used with kvcompress."""


class CacheMisuseError(ValueError):
    """A cache was used for something it cannot hold (a second prompt, another model, ...)."""


_announced = threading.local()


def take_announced() -> tuple[KVLayer | None, torch.Tensor | None]:
    """The layer (and the keys it returned) whose ``update`` ran last in this thread, then forget it.

    Attention modules call ``cache.update`` right before their attention function, so this is how
    the attention function (integration.py) finds the cache layer it is working for."""
    layer, keys = getattr(_announced, "layer", None), getattr(_announced, "keys", None)
    _announced.layer = _announced.keys = None
    return layer, keys


class OverlapProbe(NamedTuple):
    """Parts of a decoding step the speed benchmark times: a read from an offload store alone, the
    work the step overlaps with it alone, and both as the step runs them (``concurrent``: on a side stream)."""

    fetch: Callable[[], Any]
    work: Callable[[], Any]
    both: Callable[[], Any]
    concurrent: bool


def _refuse_replacing(name: str) -> Callable[[KVLayer, Any], None]:
    def refuse(layer: KVLayer, value: Any) -> None:
        if value is not None:  # transformers' base class starts every layer with None
            raise CacheMisuseError(f"kvcompress: a layer's {name} are views of its storage (layer.slots)")
    return refuse


class KVLayer(DynamicLayer):
    """One layer of the cache: it holds its storage (``slots``, slots.py), and applies its method's
    policy through the contract a method's layer overrides (``compress``, ``attend``, ``after_step``,
    ``observe``); uncompressed unless a subclass overrides it.

    The prompt is held as the prefill computed it; from the first later step on, the slots live in
    buffers of a fixed capacity and a step writes at the storage's device-side position, so it reads
    no host value and keeps every shape: a decoding step is one capturable graph. The lengths live in
    the storage, the device-side position and validity the truth; their host mirrors describe the
    cache before the step until the step commits, then move in ``advance``: an eager step's ``commit``
    calls it first, a compiled decoding loop after the step's graph (``KVCompressCache.advance``)."""

    STATE: ClassVar[tuple[str, ...]] = ()  # a subclass's own saved entries (tensors or plain values), by attribute
    HELD: ClassVar[dict[str, Any]] = {}  # objects held beside the slots, saved under their name (state_dict)
    LAYOUTS: ClassVar[tuple[type[Slots], ...]] = ()  # storage a subclass may swap its slots for (saved under its NAME)

    # The storage as the layer's callers read it (SlotView: keys/values as attention gets them, validity, ...).
    keys = property(lambda self: self.slots.view().keys, _refuse_replacing("keys"))
    values = property(lambda self: self.slots.view().values, _refuse_replacing("values"))
    valid = property(lambda self: self.slots.view().valid)
    positions = property(lambda self: self.slots.view().positions)
    cursor = property(lambda self: self.slots.view().cursor)
    used = property(lambda self: self.slots.used)
    seen_tokens = property(lambda self: self.slots.seen)  # the logical length: every token fed, padding included

    def __init__(self, layer_idx: int, slots: DenseSlots | None = None) -> None:
        self.slots: Slots = DenseSlots() if slots is None else slots  # before the base class sets keys and values
        super().__init__()
        self.layer_idx = layer_idx
        self.module_id: int | None = None  # id() of the attention module this layer serves (make_cache sets it)
        self.dtype: torch.dtype | None = None  # of the keys and values, set with them (transformers' lazy_initialization)
        self.device: torch.device | None = None
        self.prefill_len: int | None = None  # slots of the first fill (the padded prompt), set after it
        self.prefilled = False  # prefill_len is set (a bool: a compiled step reads it, and an int would be guarded by value)
        self.prompt_tokens: torch.Tensor | None = None  # real prompt tokens per row, set after the prefill
        self.awaiting_commit = False
        self.compress_s = 0.0
        self.spans: torch.Tensor | None = None  # [batch, prompt slots]: word/number span of each prompt token, when known
        self.intake = PromptIntake()  # what the layer holds while its prompt comes in (intake.py)
        self.sinks: torch.Tensor | None = None  # [q_heads]: the attention module's learned sink logits (gpt-oss), set by make_cache

    # --- a step ------------------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.awaiting_commit:
            raise UnsupportedModelError(
                f"kvcompress: layer {self.layer_idx} was updated twice without its attention running through the "
                "'kvcompress' attention implementation; the model's attention layout is not supported "
                "(was attn_implementation changed after make_cache?)"
            )
        if self.is_initialized and self.keys.numel() and key_states.shape[0] != self.keys.shape[0]:
            raise CacheMisuseError(
                f"kvcompress: this cache holds a batch of {self.keys.shape[0]} rows but got {key_states.shape[0]}; "
                "make a new cache for a new batch"
            )
        if self.observing:  # an observation pass: its tokens are attended with the prompt, never stored
            if not self.intake.in_pass:
                raise CacheMisuseError(
                    "kvcompress: this cache's method compresses the prompt after an observation pass (KVzip: the model repeating "
                    "the prompt), and the model was called again before that pass ran; kvcompress.generate and kvcompress.compress "
                    "run it (model.generate() cannot): use them to prefill"
                )
            passing = tuple(torch.cat([t[:, :, : self.prefill_len], new], dim=-2) for t, new in ((self.keys, key_states), (self.values, value_states)))
            self.intake.passing = passing
            self.awaiting_commit = True
            _announced.layer, _announced.keys = self, passing[0]
            return passing
        new = key_states.shape[-2]
        if not self.prefilled:
            self.lazy_initialization(key_states, value_states)
            if self.intake.stored is not None:  # a prompt continuing a stored context: [context; prompt], rows aligned
                self.slots.hold(*self.intake.joined(key_states, value_states))
            elif self.intake.in_blocks:  # a block of a prompt: into the prompt's buffer
                self.slots.write_block(key_states, value_states, self.intake.total)
            else:  # the first fill is held as computed, not copied
                self.slots.hold(key_states, value_states)
        else:
            if not torch.compiler.is_compiling():  # a compiled step's loop reserved the room before it
                self.slots.make_room(new)
            self.slots.write(key_states, value_states)
        self.awaiting_commit = True
        if self.intake.in_blocks:  # the blocks so far (the lengths move when the step commits)
            keys, values = (t[:, :, : self.used + new] for t in (self.keys, self.values))
        else:
            keys, values = self.keys, self.values
        _announced.layer, _announced.keys = self, keys
        return keys, values

    def expect_prompt(self, total: int) -> None:
        """The prompt will arrive in blocks, ``total`` tokens in all (``longprompt.BlockedPrefill``):
        each block is written into one buffer, and the layer compresses after the last."""
        self.intake.total = total

    def queries_needed(self) -> int | None:
        """The last prefill queries ``compress`` reads (None: all of them). Default: none."""
        return 0

    def stored_prompt(self) -> StoredPrompt | None:
        """This layer's prompt as a later prompt may continue it, read and never written (a question over
        a stored context); None where its storage cannot be read as one (chunks in a store, packed segments)."""
        held = self.slots.stored() if self.prefilled and self.cursor is None else None
        if held is None:
            return None
        queries, scaling = self.intake.recorded if self.intake.recorded is not None else (None, None)
        return StoredPrompt(*held, self.prompt_tokens, queries, scaling)

    def move(self, place: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
        """This layer's tensors through ``place`` (onto ``device``): a layer at rest whose storage a later
        prompt can read (``stored_prompt``), or a window."""
        if not self.is_sliding and self.stored_prompt() is None:
            raise CacheMisuseError(f"kvcompress: layer {self.layer_idx} ({type(self).__name__}) cannot be moved; only a stored context's layers can")
        self._batch_apply(place)
        if self.intake.recorded is not None:
            self.intake.recorded = (place(self.intake.recorded[0]), self.intake.recorded[1])
        self.device = device

    def continue_prompt(self, source: KVLayer, rows: torch.Tensor, pads: list[int], spans: torch.Tensor | None) -> None:
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

    def advance(self, new: int) -> None:
        """The host mirrors after a step of ``new`` tokens (the storage's lengths)."""
        self.slots.advance(new)

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        """Room for ``tokens`` more tokens now (at least the usual spare room), so the steps that
        append them keep every shape; with ``buckets``, a capacity of ``capacity_bucket`` exactly."""
        self.slots.reserve(tokens, buckets)

    def slot_validity(self) -> torch.Tensor:
        """``[batch, slots]`` bool, True for real tokens."""
        return self.slots.slot_validity()

    def batch_prompt_tokens(self) -> torch.Tensor:
        """Real prompt tokens of every row of the batch: a cache prefilled for a group of a batch's
        rows compresses them into the shapes the whole batch would take, so the groups can be joined."""
        return self.prompt_tokens if self.intake.batch_lengths is None else self.intake.batch_lengths

    def visibility(self, new_block: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
        """Boolean mask ``[b, 1, q_len, slots]`` of what the new queries see, from the storage and
        ``new_block [b, 1, q_len, q_len]``, the new tokens among themselves (None: causal). None
        when plain causal attention over the slots is right (a prefill without padding)."""
        return new_block if self.is_prefill else self.slots.visibility(new_block, q_len)

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions held, ``[batch, kv_heads, prompt slots]`` ascending per head; -1 marks
        filler slots of rows (in a batch) that keep fewer tokens than the longest row."""
        return self.slots.kept_positions(self.prefill_len)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # transformers' mask covers logical positions; integration.py keeps only its newest columns.
        return self.seen_tokens + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvcompress caches cannot be cropped (assisted/speculative decoding is unsupported)")

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

    def load_prefill(self, source: KVLayer) -> None:
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

    # --- the contract a method's layer overrides ----------------------------------------------------

    def compress(self, query: torch.Tensor, scaling: float) -> None:
        """After the prefill (the layer holds the whole prompt): keep or store what the method needs.
        ``query``: the prefill's post-RoPE queries ``[b, q_heads, seq, d]``. Default: keep everything."""

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Attention of ``query`` over this layer (``keys``/``values`` as ``update`` returned them)."""
        return self.slots.attend(query, keys, values, mask, scaling, softcap)

    def after_step(self, query: torch.Tensor, scaling: float) -> None:
        """After a later step's tokens are stored (e.g. evict while decoding). Default: nothing."""

    def observe(
        self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, lse: torch.Tensor, context: torch.Tensor
    ) -> None:
        """A step of the observation pass: ``query [b, q_heads, new, d]`` attended ``keys`` (the prompt's
        ``prefill_len`` slots, then the step's own), ``valid [b, prefill_len + new]``; ``lse [b, q_heads, new]``
        is each query's log-normaliser (a weight is ``exp(scaling q.k - lse)``); ``context [b, prefill_len]``
        marks the prompt slots the pass repeats (after each row's opening). Default: nothing."""

    def stats(self) -> dict[str, Any]:
        """This layer's counters (the storage's bytes, the method's index), summed over layers by the cache."""
        stats = {**self.slots.memory(self.full_tokens()), "offloaded_bytes": 0}
        recorded = self.intake.recorded[0] if self.intake.recorded is not None else None  # a stored context's queries, its spans
        stats["index_bytes"] += nbytes(*self.index_tensors(), recorded, self.spans)
        return stats

    def info(self) -> dict[str, Any]:
        """Facts about this layer shown in the cache's stats (kept when every layer agrees)."""
        return {}

    def uncapturable(self) -> str | None:
        """Why this layer's decoding step cannot be one compiled graph (None: it can)."""
        return None

    def fetch_overlap(self) -> OverlapProbe | None:
        """For layers that read an offload store while decoding: the parts to time. Default: None."""
        return None

    def full_tokens(self) -> int:
        """Tokens per KV head an uncompressed cache would hold for this layer."""
        return self.seen_tokens

    def index_tensors(self) -> list[torch.Tensor]:
        """Other device tensors the method keeps for this layer (scores, landmarks, factors, ...)."""
        return []

    def batch_tensors(self) -> list[str]:
        """The layer's attributes holding a batch dimension first (beam search reorders them, with the storage)."""
        return ["prompt_tokens", "spans"]

    # --- the saved file (docs/file-format.md) ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This layer as a saved file holds it: tensors and plain values under their documented names
        (docs/file-format.md), which are the format, whatever the attributes are called: the storage's,
        then the layer's, then a subclass's. Only a layer at rest (a whole prompt, no step half done) is saved."""
        if not self.prefilled or self.awaiting_commit or self.observing:
            raise CacheMisuseError("kvcompress: a cache can be saved once its prompt is prefilled and compressed, not during a step")
        recorded = self.intake.recorded  # a stored context's last prefill queries, for the questions asked of it
        return {
            **self.slots.state_dict(),
            **{kind.NAME: None for kind in self.LAYOUTS if not isinstance(self.slots, kind)},
            "prompt_tokens": self.prompt_tokens, "spans": self.spans,
            "prefill_len": self.prefill_len, "compress_s": self.compress_s,
            "queries": recorded[0] if recorded else None, "query_scaling": recorded[1] if recorded else None,
            **{name: getattr(self, name) for name in self.STATE},
            **{key: value for name in self.HELD for key, value in nested(name, held_state(getattr(self, name))).items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Put ``state`` (``state_dict``'s entries, tensors in host memory) into this fresh layer on ``device``."""
        swapped = [kind for kind in self.LAYOUTS if inner(state, kind.NAME) is not None]
        if swapped:
            self.slots = swapped[0].from_state(state, device)
        else:
            self.slots.load_state_dict(state, device)
        self.prompt_tokens, self.spans = (on_device(state[name], device) for name in ("prompt_tokens", "spans"))
        self.prefill_len, self.compress_s = state["prefill_len"], state["compress_s"]
        queries = state.get("queries")  # absent from files written before stored contexts kept them
        self.intake.recorded = None if queries is None else (queries.to(device), state["query_scaling"])
        for name in self.STATE:
            setattr(self, name, on_device(state[name], device))
        for name, kind in self.HELD.items():
            held = inner(state, name)
            setattr(self, name, None if held is None else kind.from_state(held, device))
        self.prefilled = self.is_initialized = True
        self.dtype, self.device = self.keys.dtype, self.keys.device

    # --- batch operations (transformers' generate: beams, num_return_sequences) -----------------------

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_apply(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def concat(self, others: list[KVLayer]) -> None:
        """Append the rows of ``others`` (this layer in caches of other groups of one batch, prefilled
        and compressed with the batch's shapes, not decoded yet) to this layer's rows."""
        layers = [self, *others]
        if any(layer.cursor is not None or not layer.prefilled for layer in layers):
            raise CacheMisuseError("kvcompress: only caches holding a compressed prompt, not yet decoded, can be joined")
        self.slots = self.slots.joined([layer.slots for layer in others])
        ragged = self.ragged_dims()
        for name in self.batch_tensors():
            values = [getattr(layer, name) for layer in layers]
            if values[0] is None:
                continue
            joined = concat_rows(values, ragged.get(name)) if isinstance(values[0], torch.Tensor) else type(values[0]).concat(values)
            setattr(self, name, joined)
            for layer in others:
                setattr(layer, name, None)  # freed as the join goes, not held twice
        self.intake.batch_lengths = None
        self.compress_s += sum(layer.compress_s for layer in others)
        if all(layer.intake.recorded is not None for layer in layers):  # a stored context's queries, row by row
            self.intake.recorded = (torch.cat([layer.intake.recorded[0] for layer in layers]), self.intake.recorded[1])

    def ragged_dims(self) -> dict[str, int]:
        """Batch tensors whose size along one dimension depends on the data (a factor's rank): groups
        are padded with zeros at its end before they are joined."""
        return {}

    def _batch_apply(self, apply) -> None:
        if not self.is_initialized:
            return
        self.slots.batch_apply(apply)
        for name in self.batch_tensors():
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, apply(value))
            elif hasattr(value, "batch_apply"):
                value.batch_apply(apply)


class WindowLayer(KVLayer):
    """A sliding-window attention layer (Mistral, Gemma 2/3 local layers, ...): it keeps the last
    ``window - 1`` tokens, all the model ever attends to from the next token on, whatever the
    method (the method compresses the full-attention layers), in a ring (``slots.RingSlots``)."""

    is_sliding = True

    def __init__(self, layer_idx: int, window: int) -> None:
        super().__init__(layer_idx, RingSlots(window))
        self.window = window

    def compress(self, query: torch.Tensor, scaling: float) -> None:
        keep = min(self.used, self.window - 1)  # copied, so the prompt's KV is freed
        positions = self.kept_positions()[..., self.used - keep :].clone()
        valid = None if self.valid is None else self.valid[:, self.used - keep :].clone()
        window = slice(self.used - keep, self.used)
        self.slots.set(self.keys[:, :, window].clone(), self.values[:, :, window].clone(), valid, positions)

    def full_tokens(self) -> int:
        return min(self.seen_tokens, self.window - 1)

    def continue_prompt(self, source: KVLayer, rows: torch.Tensor, pads: list[int], spans: torch.Tensor | None) -> None:
        """A window is what this layer keeps whatever the method: a copy of the stored one (rows ``rows``),
        which the new prompt's tokens then go through as a later turn's do."""
        self.load_state_dict({name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in source.state_dict().items()}, rows.device)
        self.batch_select_indices(rows)
        self.intake.recorded, self.intake.extends = None, True

    def load_prefill(self, source: KVLayer) -> None:
        """The recorded window is already what this layer keeps (an observation pass then attends to it and
        stores none of its own tokens, as after a prefill: ``compress`` waits for the pass)."""
        self.lazy_initialization(source.keys, source.values)
        self.slots.set(source.keys, source.values, source.valid, source.positions)
        self.slots.seen, self.prefill_len = source.seen_tokens, source.prefill_len
        self.prompt_tokens, self.prefilled = source.prompt_tokens, True
        if self.intake.observes:
            self.intake.deferred = (source.keys.new_zeros(0), 1.0)  # compress (the window kept) reads no query


class LayerFactory(Protocol):
    """What a cache needs from a method (``methods.base.Method`` provides it)."""

    def check_model(self, model: Any) -> None: ...

    def make_layer(self, layer_idx: int, model: Any) -> KVLayer: ...

    def describe(self) -> str: ...

    def needs_tokens(self) -> bool: ...

    def summarize(self, totals: dict[str, Any]) -> dict[str, Any]: ...

    def observation(self) -> Any: ...

    def before_compress(self, layers: list[KVLayer]) -> None: ...


def cache_keyword(model: torch.nn.Module | None) -> str:
    """The name of the cache argument of ``model``'s forward: ``cache`` from transformers 5.24 on (which still
    takes ``past_key_values``, with a warning), ``past_key_values`` before."""
    takes = inspect.signature(model.forward).parameters if model is not None else {}
    return "cache" if "cache" in takes else "past_key_values"


def cache_argument(arguments: Mapping[str, Any]) -> Any:
    """The cache a model or one of its layers was called with (``arguments`` by name), under either name."""
    return arguments.get("cache", arguments.get("past_key_values"))


class KVCompressCache(Cache):
    """A ``Cache`` whose layers apply a method. Build it with ``method.make_cache(model)`` and pass it
    to ``model.generate(past_key_values=cache)`` or use ``kvcompress.generate``."""

    def __init__(self, method: LayerFactory, layers: list[KVLayer], model: torch.nn.Module | None = None, spans: TokenSpans | None = None) -> None:
        super().__init__(layers=layers)
        self.method = method
        self.model_id = id(model) if model is not None else None  # the model it was made for: integration.py refuses any other
        self.model = weakref.ref(model) if model is not None else lambda: None  # for a saved cache's fingerprint
        self.keyword = cache_keyword(model)  # the model's name for its cache argument
        self.span_table = spans  # the tokenizer's word boundaries, when known
        self.timings: dict[str, float | None] = {"prefill_s": None, "ttft_s": None, "decode_ms_per_token": None, "compile_s": None}
        self.embeds_itself = False  # the model embedded this cache's prompt itself (no one else holds its hidden states)
        self.observe_first = method.observation() is not None  # layers compress after an observation pass (end_observation)
        self.observe_s = 0.0  # time the observation pass took (part of compressing)
        for layer in layers:
            layer.intake.observes = self.observe_first

    def note_prompt(self, ids: torch.Tensor | None) -> None:
        """The prompt's token ids (None: the model got embeddings): every layer learns its spans, and
        whether the model embeds the prompt itself (then no one else holds its hidden states)."""
        spans = self.span_table.span_ids(ids) if ids is not None and self.span_table is not None else None
        self.embeds_itself = ids is not None
        for layer in self.layers:
            layer.spans = spans

    def record_prefill(self, window: int | None) -> None:
        """Keep each layer's last ``window`` prefill queries (None: all) for ``load_prefill``."""
        for layer in self.layers:
            layer.intake.record_window = window

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """LongTensor ``[batch, kv_heads, n_kept]``: original prompt positions kept by ``layer_idx``."""
        return self.layers[layer_idx].kept_positions()

    def continue_context(self, context: KVCompressCache, rows: torch.Tensor, pads: list[int], spans: torch.Tensor | None) -> None:
        """This fresh cache's prompt continues ``context``'s (a stored context, read and never written, e.g. a
        document prefilled once): rows ``rows`` of it, one per row of the new prompt (a question), whose tokens
        are led by ``pads`` padding slots; each layer's prefill attends to the context, then the method
        compresses the joined prompt. ``spans``: the joined prompt's word spans, rows right-aligned."""
        if context.model_id != self.model_id:
            raise CacheMisuseError("kvcompress: this context was stored for another model; ask it with the model that compressed it")
        for layer, source in zip(self.layers, context.layers):
            layer.continue_prompt(source, rows, pads, spans)

    def forget_records(self) -> None:
        """Drop what the layers recorded of their prefill for later prompts (queries, word spans)."""
        for layer in self.layers:
            layer.intake.recorded, layer.spans = None, None

    def storable(self) -> bool:
        """Whether a later prompt can continue this cache's prompt without writing to it (``continue_context``)."""
        return all(layer.is_sliding or layer.stored_prompt() is not None for layer in self.layers)

    def device_of(self) -> torch.device | None:
        """Where the layers' keys are (None: nothing held yet)."""
        held = next((layer.keys for layer in self.layers if layer.is_initialized and layer.keys is not None), None)
        return None if held is None else held.device

    def move(self, device: torch.device | str) -> None:
        """Every tensor of this cache's layers to ``device`` (host memory: pinned, so a GPU reads it fast);
        only for layers whose storage a later prompt can read (``stored_prompt``)."""
        device = torch.device(device)
        place = to_host if device.type == "cpu" else (lambda t: t.to(device))
        for layer in self.layers:
            layer.move(place, device)

    def note_batch(self, lengths: torch.Tensor) -> None:
        """This cache holds a group of a batch's rows, whose real prompt lengths are ``lengths``: its
        layers compress into the batch's shapes, so ``concat`` can join the groups."""
        for layer in self.layers:
            layer.intake.batch_lengths = lengths

    @classmethod
    def concat(cls, caches: list[KVCompressCache]) -> KVCompressCache:
        """The rows of ``caches`` (groups of one batch, in order, each prefilled after ``note_batch``)
        as one cache: the first, with the others' rows appended layer by layer."""
        first = caches[0]
        for index, layer in enumerate(first.layers):
            layer.concat([cache.layers[index] for cache in caches[1:]])
        return first

    def begin_observation(self, openings: torch.Tensor) -> None:
        """The observation pass starts: until ``end_observation`` the model's calls are its pieces, which
        repeat each row's prompt after its first ``openings [b]`` tokens (a chat template's opening, a BOS)."""
        for layer in self.layers:
            layer.intake.in_pass = layer.observing
            if layer.observing:
                layer.intake.context = prompt_positions(layer.slot_validity()) >= openings[:, None]

    def end_observation(self, seconds: float) -> None:
        """The observation pass (``seconds`` long) is over: the method sees every layer that waited
        for it (e.g. to share a budget across layers), then every layer compresses."""
        for layer in self.layers:
            layer.intake.in_pass = False
        start = time.perf_counter()
        # the method's own layers: a sliding-window layer keeps its window, whatever the method
        self.method.before_compress([layer for layer in self.layers if layer.observing and not layer.is_sliding])
        self.observe_s += seconds + time.perf_counter() - start
        for layer in self.layers:
            layer.end_observation()

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        """Room in every layer for ``tokens`` more tokens, so the steps that append them keep every
        shape (a compiled decoding step is one graph only while nothing is reallocated); with
        ``buckets``, capacities rounded to ``capacity_bucket``, so other requests reuse the graph."""
        for layer in self.layers:
            layer.reserve(tokens, buckets)

    def advance(self, new: int) -> None:
        """The host mirrors after a compiled step of ``new`` tokens (an eager step's ``commit`` moves them)."""
        for layer in self.layers:
            layer.advance(new)

    def stats(self) -> dict[str, Any]:
        """What is held versus what a full cache would hold, measured from the tensors, plus the
        method's own fields (from its layers' counters) and the last run's timings."""
        layers = [layer for layer in self.layers if layer.is_initialized and layer.prefilled]
        if not layers:
            return {"method": self.method.describe(), "prompt_tokens": 0, "new_tokens": 0}
        per_layer = [layer.stats() for layer in layers]
        totals = merge_counters(per_layer)
        facts = merge_facts([layer.info() for layer in layers])
        first = layers[0]
        prompt = first.prompt_tokens.tolist()
        full, kept = totals["kv_bytes_full"], totals["kv_bytes_kept"]
        device = kept + totals["spare_bytes"] + totals["index_bytes"]
        return {
            "method": self.method.describe(),
            "prompt_tokens": prompt[0] if len(prompt) == 1 else prompt,
            "new_tokens": first.seen_tokens - first.prefill_len,
            "kv_tokens_per_layer": [s["kv_tokens"] for s in per_layer],
            "kv_bytes_full": full,
            "kv_bytes_kept": kept,
            "kv_kept_fraction": kept / full if full else 1.0,
            "device_bytes": device,
            "device_fraction": device / full if full else 1.0,
            "spare_bytes": totals["spare_bytes"],
            "index_bytes": totals["index_bytes"],
            "offloaded_bytes": totals["offloaded_bytes"],
            "bytes_read_per_step": totals["bytes_read_per_step"],
            "compress_s": self.observe_s + sum(layer.compress_s for layer in layers),
            **facts,
            **self.method.summarize(totals),
            **self.timings,
        }


def concat_rows(tensors: list[torch.Tensor], ragged: int | None = None) -> torch.Tensor:
    """Tensors with the batch first, joined along it; with ``ragged``, each padded with zeros at the
    end of that dimension to the largest first."""
    if ragged is not None:
        size = max(t.shape[ragged] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - ragged) + (0, size - t.shape[ragged])) for t in tensors]
    return torch.cat(tensors, dim=0)


def merge_counters(per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    """Each counter summed over the layers that report it."""
    totals: dict[str, Any] = {}
    for stats in per_layer:
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value
    return totals


def merge_facts(per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    """Each fact as one value when the layers that report it agree, else the list of values."""
    facts: dict[str, Any] = {}
    for key in dict.fromkeys(k for info in per_layer for k in info):
        values = [info[key] for info in per_layer if key in info]
        facts[key] = values[0] if all(v == values[0] for v in values) else values
    return facts


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
