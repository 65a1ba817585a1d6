"""The KV cache: storage, and the small contract a method's layer implements.

``KVCompressCache`` is a transformers ``Cache`` made of one ``KVLayer`` per model layer. A
``KVLayer`` is storage: key/value slots ``[batch, kv_heads, slots, head_dim]`` in buffers with spare
room (decoding writes its token instead of copying the cache), per-row slot validity (batches mix
prompt lengths), the prompt positions its slots hold, and batch operations. It knows nothing of any
method: a method's layer subclasses it and overrides the contract:

* ``compress(query, scaling)``: called once, right after the prefill attention of this layer, while
  the layer holds the whole prompt; decide what to keep (``keep``) or where to store it. A method
  that scores from an observation pass (KVzip: the model repeating the prompt) has it called after
  that pass instead, which ``observe`` watches: the pass's tokens are attended, never stored.
* ``attend(query, keys, values, mask, scaling, softcap)``: the attention of one step over this layer.
* ``after_step(query, scaling)``: called after every later step's tokens are stored.
* ``index_tensors()``: other device tensors it keeps (counted as memory).
* ``stats()``: counters of what the layer holds (bytes on the device, offloaded, read per step, ...),
  summed over layers; the method's ``summarize`` turns the totals into its own fields.
* ``fetch_overlap()``: for layers that read an offload store, the parts the speed benchmark times.
* ``info()``: facts about the layer (a rank, how values are fetched) that every layer should share.
* ``batch_tensors()``: names of the tensors with a batch dimension (beam search reorders them).

``get_seq_length`` is the *logical* length (prompt + appended tokens, padding included), so
transformers keeps assigning RoPE positions and slicing generate inputs from the true length.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, ClassVar, NamedTuple, Protocol

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .attention import causal_slot_mask, dense_attention
from .intake import PromptIntake
from .tensors import gather_rows, gather_tokens, nbytes, prompt_positions
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


def spare_slots(slots: int) -> int:
    """Room a slot buffer gets beyond ``slots`` when it grows: ~6%, at least 16 and at most 1024 slots."""
    return min(1024, max(16, slots // 16))


def capacity_bucket(slots: int) -> int:
    """The capacity a compiled decoding step's buffer of ``slots`` slots takes: the next power of two
    (at least 64), so requests of other lengths in the same bucket reuse the compiled step."""
    return 1 << max(6, (slots - 1).bit_length())


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` moved to ``device`` if it is a tensor (a saved state's entries: tensors or plain values)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def nested(prefix: str, state: dict[str, Any] | None) -> dict[str, Any]:
    """An object's saved state inside its holder's, its names under ``prefix.`` (None: ``prefix`` is None)."""
    return {prefix: None} if state is None else {f"{prefix}.{name}": value for name, value in state.items()}


def held_state(held: Any) -> dict[str, Any] | None:
    """The saved state of an object a layer holds (None where it holds none)."""
    return None if held is None else held.state_dict()


def inner(state: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    """The entries ``nested`` put under ``prefix``, without it (None where the object was None)."""
    if state.get(prefix, "") is None:
        return None
    return {name[len(prefix) + 1 :]: value for name, value in state.items() if name.startswith(prefix + ".")}


class KVLayer(DynamicLayer):
    """One layer's KV storage; uncompressed unless a method's subclass overrides the contract.

    The prompt is held as the prefill computed it. From the first later step on, the slots live in
    buffers of a fixed capacity with room to spare: ``keys``/``values`` are those whole buffers,
    ``valid [batch, capacity]`` marks the slots holding real tokens (False for padding and for the
    room), and every step attends over all of them. A step writes its tokens at ``cursor`` (a
    device tensor, moved on when the step commits), so it reads no host value and keeps every
    shape: a decoding step is one capturable graph. Host-side counters (``seen_tokens``, ``used``) are kept by ``advance``, which
    eager steps call from ``update`` and a compiled decoding loop calls after each step."""

    STATE: ClassVar[tuple[str, ...]] = ()  # a subclass's own saved entries (tensors or plain values), by attribute name
    HELD: ClassVar[dict[str, Any]] = {}  # objects a subclass holds, saved under their name: state_dict() and from_state(state, device)

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.module_id: int | None = None  # id() of the attention module this layer serves (make_cache sets it)
        self.dtype: torch.dtype | None = None  # of the keys and values, set with them (transformers' lazy_initialization)
        self.device: torch.device | None = None
        self.seen_tokens = 0  # logical length: every token fed, padding included
        self.used = 0  # slots holding tokens: [0, used)
        self.cursor: torch.Tensor | None = None  # [1] on the device: the slot of the next (during a step: this step's first) token
        self.prefill_len: int | None = None  # slots of the first fill (the padded prompt), set after it
        self.prefilled = False  # prefill_len is set (a bool: a compiled step reads it, and an int would be guarded by value)
        self.prompt_tokens: torch.Tensor | None = None  # real prompt tokens per row, set after the prefill
        self.valid: torch.Tensor | None = None  # [batch, slots]; None while every slot is real (a prefill without padding)
        self.positions: torch.Tensor | None = None  # [batch, kv_heads, prompt slots]: prompt positions held
        self.awaiting_commit = False
        self.compress_s = 0.0
        self.spans: torch.Tensor | None = None  # [batch, prompt slots]: word/number span of each prompt token, when known
        self.intake = PromptIntake()  # what the layer holds while its prompt comes in (intake.py)

    # --- storage ----------------------------------------------------------------------------------

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
        counted = not torch.compiler.is_compiling()  # a compiled step's loop counts after the step
        if not self.prefilled and self.intake.in_blocks:  # a block of a prompt: into the prompt's buffer
            self.write_prompt_block(key_states, value_states)
        elif not self.prefilled:  # the first fill is held as computed, not copied
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        else:
            if counted:
                self.make_room(new)
            self.write(key_states, value_states)
        if counted:
            self.advance(new)
        self.awaiting_commit = True
        keys, values = (t[:, :, : self.used] for t in (self.keys, self.values)) if self.intake.in_blocks else (self.keys, self.values)
        _announced.layer, _announced.keys = self, keys
        return keys, values

    def expect_prompt(self, total: int) -> None:
        """The prompt will arrive in blocks, ``total`` tokens in all (``longprompt.BlockedPrefill``):
        each block is written into one buffer, and the layer compresses after the last."""
        self.intake.total = total

    def write_prompt_block(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.used == 0:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = (t.new_empty(*t.shape[:2], self.intake.total, t.shape[-1]) for t in (key_states, value_states))
        end = self.used + key_states.shape[-2]
        self.keys[:, :, self.used : end] = key_states
        self.values[:, :, self.used : end] = value_states

    def queries_needed(self) -> int | None:
        """The last prefill queries ``compress`` reads (None: all of them). Default: none."""
        return 0

    def advance(self, new: int) -> None:
        """Host-side counters after a step of ``new`` tokens."""
        self.seen_tokens += new
        self.used += new

    def make_room(self, new: int) -> None:
        """Buffers with room for ``new`` more tokens: moved into larger ones (room ~6% of the slots,
        see ``spare_slots``) only when the room runs out, so decoding copies the cache once per room."""
        if self.cursor is None or self.keys.shape[-2] - self.used < new:
            self.relayout(self.used + new + spare_slots(self.used + new))

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        """Room for ``tokens`` more tokens now (at least the usual spare room), so the steps that
        append them keep every shape; with ``buckets``, a capacity of ``capacity_bucket`` exactly."""
        if buckets:
            capacity = capacity_bucket(self.used + tokens)
            if self.cursor is None or self.keys.shape[-2] != capacity:
                self.relayout(capacity)
        elif self.cursor is None or self.keys.shape[-2] - self.used < tokens:
            self.relayout(self.used + max(tokens, spare_slots(self.used)))

    def relayout(self, capacity: int) -> None:
        """Move the ``used`` slots into buffers of ``capacity`` slots (the rest: room, invalid)."""
        held = (self.keys[:, :, : self.used], self.values[:, :, : self.used])
        self.keys, self.values = (t.new_zeros(*t.shape[:2], capacity, t.shape[-1]) for t in held)
        for buffer, tensor in zip((self.keys, self.values), held):
            buffer[:, :, : self.used].copy_(tensor)
        valid = torch.zeros(self.keys.shape[0], capacity, dtype=torch.bool, device=self.keys.device)
        valid[:, : self.used] = True if self.valid is None else self.valid[:, : self.used]
        self.valid = valid
        self.cursor = torch.tensor([self.used], device=self.keys.device)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store this step's tokens at ``cursor`` (valid until ``commit`` says otherwise)."""
        slots = self.new_slots(key_states.shape[-2])
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        self.valid.index_fill_(1, slots, True)

    def new_slots(self, new: int) -> torch.Tensor:
        """Slot indices ``[new]`` of this step's ``new`` tokens."""
        return self.cursor if new == 1 else self.cursor + torch.arange(new, device=self.cursor.device)

    def close_step(self, new: int) -> None:
        """Move the cursor past this step's ``new`` tokens."""
        self.cursor.add_(new)

    def set_slots(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        """Replace every slot (e.g. by the kept ones). ``valid [b, slots]`` (None: all real),
        ``positions [b, kv_heads, prompt slots]`` (None: derived from validity)."""
        self.keys, self.values, self.valid, self.positions = keys, values, valid, positions
        self.used, self.cursor = keys.shape[-2], None

    def keep(self, indices: torch.Tensor, slot_valid: torch.Tensor) -> None:
        """Keep, per row and KV head, the prompt slots ``indices [b, kv_heads, n]`` (ascending);
        ``slot_valid [b, n]`` marks filler slots of rows that keep fewer (see ``select_kept``)."""
        kept = gather_rows(prompt_positions(self.slot_validity()), indices).masked_fill(~slot_valid[:, None, :], -1)
        valid = None if bool(slot_valid.all()) else slot_valid
        self.set_slots(gather_tokens(self.keys, indices), gather_tokens(self.values, indices), valid, kept)

    def batch_prompt_tokens(self) -> torch.Tensor:
        """Real prompt tokens of every row of the batch: a cache prefilled for a group of a batch's
        rows compresses them into the shapes the whole batch would take, so the groups can be joined."""
        return self.prompt_tokens if self.intake.batch_lengths is None else self.intake.batch_lengths

    def slot_validity(self) -> torch.Tensor:
        """``[batch, slots]`` bool, True for real tokens."""
        if self.valid is not None:
            return self.valid
        return torch.ones(self.keys.shape[0], self.keys.shape[-2], dtype=torch.bool, device=self.keys.device)

    def visibility(self, new_block: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
        """Boolean mask ``[b, 1, q_len, slots]`` of what the new queries see, from each slot's validity
        and ``new_block [b, 1, q_len, q_len]``, the new tokens among themselves (None: causal). None
        when plain causal attention over the slots is right (a prefill without padding)."""
        if self.is_prefill:
            return new_block  # the slots are exactly the new tokens
        seen = self.valid.view(self.valid.shape[0], 1, 1, -1)
        if q_len == 1:
            return seen  # a decoding token is valid from its write on: it sees itself and every real slot
        block = new_block if new_block is not None else causal_slot_mask(q_len, q_len, self.keys.device)
        mask = seen.expand(-1, -1, q_len, -1).clone()
        mask[..., self.used - q_len : self.used] = block
        return mask

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions held, ``[batch, kv_heads, prompt slots]`` ascending per head; -1 marks
        filler slots of rows (in a batch) that keep fewer tokens than the longest row."""
        if self.positions is not None:
            return self.positions
        valid = self.slot_validity()[:, : self.prefill_len]
        return prompt_positions(valid)[:, None, :].expand(-1, self.keys.shape[1], -1)

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
        if self.is_prefill and self.intake.in_blocks:  # a prompt in blocks: compressed after its last
            self.intake.keep_block(query, new_valid, self.used, self.queries_needed())
            if self.used < self.intake.total:
                return
            query, new_valid = self.intake.whole_prompt()
        if self.is_prefill:
            self._end_prefill(query, new_valid, scaling)
            return
        if new_valid is not None:  # written without asking the device whether all are real: that would synchronize
            self.mark_padding(new_valid)
        self.after_step(query, scaling)
        self.close_step(query.shape[-2])

    def mark_padding(self, new_valid: torch.Tensor) -> None:
        """The validity ``[b, q]`` of this step's tokens."""
        self.valid.index_copy_(1, self.new_slots(new_valid.shape[-1]), new_valid)

    def _end_prefill(self, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float) -> None:
        if new_valid is not None and not bool(new_valid.all()):
            if bool((new_valid[:, :-1] & ~new_valid[:, 1:]).any()):
                raise ValueError(
                    "kvcompress needs left-padded batches (padding before each prompt, as tokenizer.padding_side='left' "
                    "gives); this batch has padding after real tokens"
                )
            self.valid = new_valid
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
        self.set_slots(source.keys[:, :, : source.prefill_len], source.values[:, :, : source.prefill_len])
        self.seen_tokens = source.prefill_len
        self.spans = source.spans
        query, scaling = source.intake.recorded
        self._end_prefill(query, None if source.valid is None else source.valid[:, : source.prefill_len], scaling)

    # --- the contract a method's layer overrides ----------------------------------------------------

    def compress(self, query: torch.Tensor, scaling: float) -> None:
        """After the prefill (the layer holds the whole prompt): keep or store what the method needs.
        ``query``: the prefill's post-RoPE queries ``[b, q_heads, seq, d]``. Default: keep everything."""

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Attention of ``query`` over this layer (``keys``/``values`` as ``update`` returned them)."""
        return dense_attention(query, keys, values, mask, scaling, softcap)

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
        """This layer's counters. Numbers are summed over layers by the cache."""
        batch, heads, _, dim = self.keys.shape
        kept = 2 * batch * heads * self.held_tokens() * dim * self.keys.element_size()
        held = nbytes(self.keys, self.values)
        return {
            "kv_tokens": self.held_tokens(),
            "kv_bytes_full": 2 * batch * heads * self.full_tokens() * dim * self.keys.element_size(),
            "kv_bytes_kept": kept,
            "spare_bytes": held - kept,
            "index_bytes": nbytes(self.valid, self.positions, self.cursor, *self.index_tensors()),
            "offloaded_bytes": 0,
            "bytes_read_per_step": held,  # a step attends over every slot, the room included (masked)
        }

    def held_tokens(self) -> int:
        """Slots holding tokens (per row and KV head)."""
        return self.used

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
        """Attributes holding a batch dimension first (reordered by beam search)."""
        return ["keys", "values", "valid", "positions", "prompt_tokens", "spans"]

    # --- the saved file (docs/file-format.md) ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This layer as a saved file holds it: tensors and plain values under their documented names
        (docs/file-format.md), which are the format, whatever the attributes are called. A subclass
        adds its entries to its parent's. Only a layer at rest (a whole prompt, no step half done) is saved."""
        if not self.prefilled or self.awaiting_commit or self.observing:
            raise CacheMisuseError("kvcompress: a cache can be saved once its prompt is prefilled and compressed, not during a step")
        return {
            "keys": self.keys, "values": self.values, "valid": self.valid, "positions": self.positions, "cursor": self.cursor,
            "prompt_tokens": self.prompt_tokens, "spans": self.spans,
            "seen_tokens": self.seen_tokens, "used": self.used, "prefill_len": self.prefill_len, "compress_s": self.compress_s,
            **{name: getattr(self, name) for name in self.STATE},
            **{key: value for name in self.HELD for key, value in nested(name, held_state(getattr(self, name))).items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Put ``state`` (``state_dict``'s entries, tensors in host memory) into this fresh layer on ``device``."""
        self.keys, self.values, self.valid, self.positions, self.cursor, self.prompt_tokens, self.spans = (
            on_device(state[name], device) for name in ("keys", "values", "valid", "positions", "cursor", "prompt_tokens", "spans")
        )
        self.seen_tokens, self.used, self.prefill_len, self.compress_s = (state[name] for name in ("seen_tokens", "used", "prefill_len", "compress_s"))
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
        for name, complete in (("valid", KVLayer.slot_validity), ("positions", KVLayer.kept_positions)):
            if any(getattr(layer, name) is not None for layer in layers):  # a group without padding holds None
                for layer in layers:
                    setattr(layer, name, complete(layer))
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
        self.used = self.keys.shape[-2]
        self.compress_s += sum(layer.compress_s for layer in others)

    def ragged_dims(self) -> dict[str, int]:
        """Batch tensors whose size along one dimension depends on the data (a factor's rank): groups
        are padded with zeros at its end before they are joined."""
        return {}

    def _batch_apply(self, apply) -> None:
        if not self.is_initialized:
            return
        for name in self.batch_tensors():
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, apply(value))
            elif hasattr(value, "batch_apply"):
                value.batch_apply(apply)


class WindowLayer(KVLayer):
    """A sliding-window attention layer (Mistral, Gemma 2/3 local layers, ...): it keeps the last
    ``window - 1`` tokens, all the model ever attends to from the next token on, whatever the
    method (the method compresses the full-attention layers).

    After the prefill the slots form a ring: the token of logical index ``t`` lives in slot
    ``t % capacity`` and ``slot_index`` says which token each slot holds, so a step overwrites the
    oldest token in place and sees the slots less than ``window`` tokens before it."""

    is_sliding = True
    STATE = ("slot_index",)

    def __init__(self, layer_idx: int, window: int) -> None:
        super().__init__(layer_idx)
        self.window = window
        self.slot_index: torch.Tensor | None = None  # [capacity]: logical index of each slot's token (-window: empty)

    def compress(self, query: torch.Tensor, scaling: float) -> None:
        keep = min(self.used, self.window - 1)  # copied, so the prompt's KV is freed
        positions = self.kept_positions()[..., self.used - keep :].clone()
        valid = None if self.valid is None else self.valid[:, self.used - keep :].clone()
        self.set_slots(self.keys[:, :, self.used - keep :].clone(), self.values[:, :, self.used - keep :].clone(), valid, positions)

    def advance(self, new: int) -> None:
        self.seen_tokens += new
        self.used = self.used + new if not self.prefilled else min(self.used + new, self.window - 1)

    def make_room(self, new: int) -> None:
        needed = self.window - 1 + new  # every token of a longer turn sees the window before it
        if self.cursor is None or self.keys.shape[-2] < needed:
            self.relayout(needed + spare_slots(needed))

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        self.make_room(1)  # a ring: decoding steps overwrite the oldest token (its size is the model's window, whatever the request)

    def relayout(self, capacity: int) -> None:
        """The held tokens (the last ``used`` before ``seen_tokens``) into a ring of ``capacity`` slots."""
        if self.cursor is None:
            order = torch.arange(self.used, device=self.keys.device)
            logical = order + (self.seen_tokens - self.used)
            valid = self.slot_validity()
        else:
            logical = torch.arange(self.seen_tokens - self.used, self.seen_tokens, device=self.keys.device)
            order = logical % self.keys.shape[-2]
            valid = self.valid[:, order]
        slots = logical % capacity
        keys, values = (t.new_zeros(*t.shape[:2], capacity, t.shape[-1]) for t in (self.keys, self.values))
        keys.index_copy_(2, slots, self.keys[:, :, order])
        values.index_copy_(2, slots, self.values[:, :, order])
        self.keys, self.values = keys, values
        self.valid = torch.zeros(keys.shape[0], capacity, dtype=torch.bool, device=keys.device).index_copy_(1, slots, valid)
        self.slot_index = torch.full((capacity,), -self.window, device=keys.device).index_copy_(0, slots, logical)
        self.cursor = torch.tensor([self.seen_tokens], device=keys.device)

    def new_slots(self, new: int) -> torch.Tensor:
        return self.new_logical(new) % self.keys.shape[-2]

    def new_logical(self, new: int) -> torch.Tensor:
        """Logical indices ``[new]`` of this step's tokens."""
        return super().new_slots(new)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.slot_index.index_copy_(0, self.new_slots(key_states.shape[-2]), self.new_logical(key_states.shape[-2]))
        super().write(key_states, value_states)

    def visibility(self, new_block: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
        """Each new query sees the real slots less than ``window`` tokens before it (and the new
        tokens as ``new_block`` says, which carries the window too)."""
        if self.is_prefill:
            return new_block
        query = self.new_logical(q_len)[:, None]  # [q, 1]
        near = (self.slot_index[None, :] > query - self.window) & (self.slot_index[None, :] <= query)
        mask = self.valid[:, None, None, :] & near[None, None]
        if q_len == 1 or new_block is None:
            return mask
        return mask.index_copy(3, self.new_slots(q_len), new_block.expand(mask.shape[0], -1, -1, -1))

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions still inside the window."""
        positions = super().kept_positions()
        if not self.prefilled:
            return positions
        gone = max(0, positions.shape[-1] + self.seen_tokens - self.prefill_len - (self.window - 1))  # pushed out by later tokens
        return positions[..., gone:]

    def full_tokens(self) -> int:
        return min(self.seen_tokens, self.window - 1)

    def index_tensors(self) -> list[torch.Tensor]:
        return [] if self.slot_index is None else [self.slot_index]

    def load_prefill(self, source: KVLayer) -> None:
        """The recorded window is already what this layer keeps."""
        self.lazy_initialization(source.keys, source.values)
        self.set_slots(source.keys, source.values, source.valid, source.positions)
        self.seen_tokens, self.prefill_len, self.prompt_tokens = source.seen_tokens, source.prefill_len, source.prompt_tokens


class LayerFactory(Protocol):
    """What a cache needs from a method (``methods.base.Method`` provides it)."""

    def check_model(self, model: Any) -> None: ...

    def make_layer(self, layer_idx: int, model: Any) -> KVLayer: ...

    def describe(self) -> str: ...

    def needs_tokens(self) -> bool: ...

    def summarize(self, totals: dict[str, Any]) -> dict[str, Any]: ...

    def observation(self) -> Any: ...

    def before_compress(self, layers: list[KVLayer]) -> None: ...


class KVCompressCache(Cache):
    """A ``Cache`` whose layers apply a method. Build it with ``method.make_cache(model)`` and pass it
    to ``model.generate(past_key_values=cache)`` or use ``kvcompress.generate``."""

    def __init__(self, method: LayerFactory, layers: list[KVLayer], model: torch.nn.Module | None = None, spans: TokenSpans | None = None) -> None:
        super().__init__(layers=layers)
        self.method = method
        self.model_id = id(model) if model is not None else None  # the model it was made for: integration.py refuses any other
        self.model = weakref.ref(model) if model is not None else lambda: None  # for a saved cache's fingerprint
        self.span_table = spans  # the tokenizer's word boundaries, when known
        self.timings: dict[str, float | None] = {"prefill_s": None, "decode_ms_per_token": None, "compile_s": None}
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
        self.method.before_compress([layer for layer in self.layers if layer.observing])
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
        """Host-side counters after a compiled step of ``new`` tokens (eager steps count in ``update``)."""
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
