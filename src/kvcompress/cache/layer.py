"""A cache layer: ``KVLayer`` and ``WindowLayer`` for sliding-window layers.

A layer is composed of four things: its storage (``slots``, a ``storage.slots.Slots``: one class per layout,
knowing no method), the way its prompt is coming in (``intake``, intake.py), its phase (phase.py) and its method's
policy (``policy``, policy.py: what a method decides, ``compress``, ``attend``, ``after_step``, ...; an uncompressed
layer's by default). One layer class serves every method. What it holds beside its storage is declared once, in
the class body (``hold``, held.py), as its policy declares its own, and saving, loading, batch operations, joining
groups and moving derive from those declarations.

transformers calls ``update`` (a step's keys and values), which looks up the step its phase calls for once
(steps.py: the prompt's, the observation pass's, a later step's); the attention function then calls that step's
``attend`` and the layer's ``commit``, which closes the step and commits it. ``get_seq_length`` is the *logical*
length (prompt + appended tokens, padding included), so transformers keeps assigning RoPE positions and slicing
generate inputs from the true length.

The prompt is held as the prefill computed it; from the first later step on, the slots live in buffers of a fixed
capacity and a step writes at the storage's device-side position, so it reads no host value and keeps every shape: a
decoding step is one capturable graph. The storage's host mirrors of the lengths describe the cache before a step
until it commits, then move in ``advance``: an eager step's ``commit`` calls it, a compiled decoding loop after the
step's graph (``KVCompressCache.advance``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import torch
from transformers.cache_utils import DynamicLayer

from ..storage.codec import KVCodec
from ..storage.dense import DenseSlots
from ..storage.ring import RingSlots
from ..storage.slots import Slots, store_coded
from ..storage.tensors import prompt_positions, synced_clock
from . import held
from .errors import CacheMisuseError, UnsupportedModelError
from .held import hold
from .intake import (
    InBlocks,
    Intake,
    ObservationPass,
    OneForward,
    OverStored,
    PromptRecord,
    StoredPrompt,
    left_padded,
    recorded_prompt,
)
from .phase import Phase, moved
from .policy import LayerPolicy
from .steps import STEP_OF, Step

_announced = threading.local()


def take_announced() -> tuple[KVLayer | None, torch.Tensor | None]:
    """The layer (and the keys it returned) whose ``update`` ran last in this thread, then forget it.

    Attention modules call ``cache.update`` right before their attention function, so this is how
    the attention function (integrations/transformers/attach.py) finds the cache layer it is working for."""
    layer, keys = getattr(_announced, "layer", None), getattr(_announced, "keys", None)
    _announced.layer = _announced.keys = None
    return layer, keys


def _refuse_replacing(name: str) -> Callable[[Any, Any], None]:
    def refuse(layer: Any, value: Any) -> None:
        if value is not None:  # transformers' base class starts every layer with None
            raise CacheMisuseError(f"kvcompress: a layer's {name} are views of its storage (layer.slots)")

    return refuse


class KVLayer(DynamicLayer):
    """One layer of the cache, for every method (see the module docstring); uncompressed unless given a method's
    policy (``policy``; ``slots``: the layout the policy needs, dense by default)."""

    # What the layer holds beside its storage (held.py), each declared once: its type, then how it is held.
    prompt_tokens: torch.Tensor | None = hold(rows=True)  # [b] real prompt tokens per row
    spans: torch.Tensor | None = hold(rows=True, counted=True)  # [b, prompt slots]: each token's word/number span
    prefill_len: int | None = hold()  # slots of the first fill (the padded prompt)
    compress_s: float = hold(join=sum, default=0.0)
    queries: torch.Tensor | None = hold(rows=True, counted=True)  # a record's last prefill queries (a stored context)
    query_scaling: float | None = hold()
    batch_lengths: torch.Tensor | None = hold(saved=False, join=lambda v: None)  # a batch group: all rows' lengths
    sinks: torch.Tensor | None = hold(saved=False)  # [q_heads]: learned sink logits (gpt-oss), set by make_cache

    # transformers' layer attributes, as attention gets them: views of the storage (its lengths, validity and
    # positions are read from it: ``slots.seen``, ``slots.used``, ``slots.view(decoded=False)``)
    keys = property(lambda self: self.slots.view().keys, _refuse_replacing("keys"))
    values = property(lambda self: self.slots.view().values, _refuse_replacing("values"))
    # the kind of layer a file and an error name: its policy's name for it (EvictionLayer, ...), else its class
    kind = property(lambda self: self.policy.SAVED_AS or type(self).__name__)

    def __init__(self, layer_idx: int, policy: LayerPolicy | None = None, slots: Slots | None = None) -> None:
        self.slots: Slots = DenseSlots() if slots is None else slots  # before the base class sets keys and values
        super().__init__()
        self.layer_idx = layer_idx
        self.policy = LayerPolicy() if policy is None else policy  # what the method decides (policy.py)
        self.policy.serve(self)
        self.rotary: Any = None  # the model's rotary embedding for this layer, for methods that score with it
        self.phase = Phase.EMPTY
        self.intake: Intake = OneForward()  # how the prompt comes in (intake.py)
        self.observation: ObservationPass | None = None  # the pass compression waits for (AWAITING_PASS, OBSERVING)
        self.open_step: Step | None = None  # the step update took, until its attention commits (steps.py)
        # the attention module this layer serves, held weakly (make_cache sets it; compared by identity, not id())
        self.attention_module: Callable[[], object] | None = None
        # the first keys' (lazy_initialization); transformers types them as always set, here they are born None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None  # type: ignore[assignment]
        self.record_window: int | None | bool = False  # the last prefill queries to record (False: none; None: all)
        self.observes = False  # compression waits for an observation pass (KVCompressCache.observe_first)
        self.kv_codec: KVCodec | None = None  # how tokens are stored once compressed (make_cache gives it)
        held.reset(self)  # every attribute the class declares (hold) at its default

    # --- transformers' layer contract -----------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step its phase calls for (steps.py) takes the new keys and values; it stays open until ``commit``.
        Refused: a second update before its attention committed (the model's attention does not go through
        kvcompress), or another batch size than the one the layer holds."""
        if self.open_step is not None:
            raise UnsupportedModelError(
                f"kvcompress: layer {self.layer_idx} was updated twice without its attention running through the "
                "'kvcompress' attention implementation; the model's attention layout is not supported (was "
                "attn_implementation changed after make_cache?)"
            )
        new_rows = key_states.shape[0]
        rows = self.slots.view(decoded=False).keys.shape[0] if self.phase is not Phase.EMPTY else new_rows
        if rows != new_rows:
            raise CacheMisuseError(
                f"kvcompress: this cache holds a batch of {rows} rows but got {new_rows}; make a "
                "new cache for a new batch"
            )
        step = STEP_OF[self.phase]
        keys, values = step.take(self, key_states, value_states)
        self.open_step = step
        _announced.layer, _announced.keys = self, keys
        return keys, values

    def get_seq_length(self) -> int:
        return self.slots.seen  # the logical length: every token fed, padding included

    # get_mask_sizes: the base class's, from get_seq_length (transformers' mask covers logical positions; attach.py
    # keeps only its newest columns)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvcompress caches cannot be cropped (assisted/speculative decoding is unsupported)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            held.apply_rows(self, lambda t: t.index_select(0, indices.to(t.device)))

    reorder_cache = batch_select_indices  # type: ignore[assignment]  # beam search's reordering: a row selection

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            held.apply_rows(self, lambda t: t.repeat_interleave(repeats, dim=0))

    # --- the pipeline: prompt -> (observation pass) -> compression -> decoding ------------------------------

    def commit(
        self, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float, lse: torch.Tensor | None = None
    ) -> None:
        """After the open step's attention (``new_valid [b, q]``: which new tokens are real; None: all; ``lse``: an
        observation step's log-normalisers): the step is closed and commits (steps.py)."""
        step, self.open_step = self.open_step, None
        if step is None:
            raise CacheMisuseError(f"kvcompress: layer {self.layer_idx}'s attention committed a step no update opened")
        step.commit(self, query, new_valid, scaling, lse)

    def end_prompt(self, record: PromptRecord) -> None:
        """The whole prompt is held: its validity, lengths and recorded queries; then compress, or wait for a pass."""
        slots = cast(DenseSlots, self.slots)  # a prompt comes into dense slots
        if record.valid is not None and not bool(record.valid.all()):
            slots.valid = left_padded(record.valid)
        if record.positions is not None:  # a thinned context: its slots are not its tokens in order
            slots.positions = record.positions
            self.spans = record.spans
        self.intake = OneForward()
        self.prefill_len = self.keys.shape[-2]
        self.prompt_tokens = self.slot_validity().sum(dim=-1)
        if self.record_window is not False and record.query is not None:  # (a window asked for records its queries)
            kept = record.query if self.record_window is None else record.query[..., -self.record_window :, :]
            self.queries, self.query_scaling = kept, record.scaling
        self.observation = ObservationPass(record, self.prefill_len)
        if self.observes:
            self.phase = moved(self.layer_idx, self.phase, Phase.AWAITING_PASS, "the prompt waits for its pass")
        else:
            self.end_observation()  # none to wait for: compressed now

    def expect_blocks(self, total: int) -> bool:
        """The prompt will come in blocks, ``total`` tokens in all (``longprompt.BlockedPrefill``); False: it won't
        (the layer is not empty, or its prompt comes another way)."""
        if self.phase is not Phase.EMPTY or not isinstance(self.intake, OneForward):
            return False
        self.intake = InBlocks(total)
        return True

    def continue_prompt(self, source: KVLayer, rows: torch.Tensor, pads: list[int], spans: torch.Tensor | None) -> None:
        """This fresh layer's prompt continues ``source``'s (read, never written): rows ``rows`` of it, one per row of
        the new prompt, led by ``pads`` padding slots; ``spans``: the joined prompt's word spans ``[b, width]``."""
        stored = source.stored_prompt()
        if stored is None:
            raise CacheMisuseError(
                f"kvcompress: layer {source.layer_idx} of this context ({source.kind}) "
                f"holds its prompt in a form a question cannot be prefilled over; {_STORE_WHOLE}"
            )
        moved(self.layer_idx, self.phase, Phase.PROMPT, "a prompt continuing a stored context")
        picked = StoredPrompt._make(
            t.index_select(0, rows.to(t.device)) if isinstance(t, torch.Tensor) else t for t in stored
        )
        self.intake = OverStored(picked, pads, spans)
        self.slots.seen, self.slots.used = source.slots.seen, stored.keys.shape[-2]  # the logical length continued
        self.spans = spans

    def load_prefill(self, source: KVLayer) -> None:
        """A prompt recorded by ``source`` (an uncompressed layer that kept its last queries), compressed here."""
        self.lazy_initialization(source.keys, source.values)
        record = recorded_prompt(source, cast(DenseSlots, self.slots))
        self.spans = source.spans
        self.phase = moved(self.layer_idx, self.phase, Phase.PROMPT, "a prefill record")
        self.end_prompt(record)

    @property
    def asked(self) -> torch.Tensor | None:
        """Each row's tokens after a stored context ``[b]`` while the layer compresses (a question and what followed
        it; None: the prompt continues none)."""
        return None if self.observation is None else self.observation.record.asked

    def held_prompt(self) -> tuple[torch.Tensor, int]:
        """``(prompt_tokens, prefill_len)`` once the layer holds its prompt (``end_prompt`` or a load sets both): that
        phase said once to the type checker."""
        if self.prompt_tokens is None or self.prefill_len is None:
            raise CacheMisuseError(f"kvcompress: layer {self.layer_idx} was read as a prompt before it held one")
        return self.prompt_tokens, self.prefill_len

    def stored_prompt(self) -> StoredPrompt | None:
        """This layer's prompt as a later prompt continues it (a question over a stored context); None where its
        storage cannot be read as one (chunks in a store, packed segments)."""
        at_rest = self.phase is Phase.DECODING and self.slots.view(decoded=False).cursor is None
        stored = self.slots.stored() if at_rest and self.policy.prompt_readable() else None
        if stored is None:
            return None
        return StoredPrompt(*stored, self.held_prompt()[0], self.queries, self.query_scaling)

    def begin_observation(self, openings: torch.Tensor) -> None:
        """The observation pass starts; it repeats each row's prompt after its first ``openings [b]`` tokens."""
        if self.phase is Phase.AWAITING_PASS and self.observation is not None:  # (the phase waits for this pass)
            self.phase = moved(self.layer_idx, self.phase, Phase.OBSERVING, "the observation pass begins")
            self.observation.context = prompt_positions(self.slot_validity()) >= openings[:, None]

    def end_observation(self) -> None:
        """The prompt's observation pass is over, or none was waited for (or it never began: the method then says
        what it lacks): the method's ``compress``, then the storage's codec, timed (on a GPU, between
        synchronizations)."""
        if self.observation is None:
            return
        self.phase = moved(self.layer_idx, self.phase, Phase.DECODING, "the prompt is compressed")
        record, start = self.observation.record, synced_clock(self.device)
        self.policy.compress(record.query, record.scaling)
        store_coded(self.slots, self.kv_codec)
        self.compress_s += synced_clock(self.device) - start
        self.observation = None
        if self.record_window is False:
            self.spans = None  # read by compress only (a prefill record keeps them for the methods it makes)

    def advance(self, new: int) -> None:
        """The host mirrors of the lengths after a step of ``new`` tokens: the storage's, then the policy's."""
        self.slots.advance(new)
        self.policy.advanced(new)

    def slot_validity(self) -> torch.Tensor:
        return cast(DenseSlots, self.slots).slot_validity()  # [batch, slots] bool, True for real tokens

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions held, ``[batch, kv_heads, prompt slots]`` ascending per head; -1 marks
        filler slots of rows (in a batch) that keep fewer tokens than the longest row (the policy's)."""
        return self.policy.kept_positions()

    def stats(self) -> dict[str, Any]:
        """This layer's counters (the storage's bytes, the declared index, the policy's), summed by the cache."""
        full = self.policy.full_tokens()
        stats = {**self.slots.memory(full), "offloaded_bytes": 0, "kv_tokens_full": full}
        stats["index_bytes"] += held.counted_bytes(self)
        return self.policy.stats(stats)


class WindowLayer(KVLayer):
    """A sliding-window attention layer (Mistral, Gemma 2/3 local layers, ...): it keeps the last
    ``window - 1`` tokens, all the model ever attends to from the next token on, whatever the
    method (the method compresses the full-attention layers), in a ring (``ring.RingSlots``)."""

    is_sliding = True
    slots: RingSlots

    def __init__(self, layer_idx: int, window: int) -> None:
        super().__init__(layer_idx, WindowPolicy(window), RingSlots(window))
        self.window = window

    def continue_prompt(self, source: KVLayer, rows: torch.Tensor, pads: list[int], spans: torch.Tensor | None) -> None:
        """A window is what this layer keeps whatever the method: a copy of the stored one (rows ``rows``),
        which the new prompt's tokens then go through as a later turn's do."""
        state = {
            name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in held.save(source).items()
        }
        held.put(self, state, rows.device)
        self.phase = moved(self.layer_idx, self.phase, Phase.CONTINUING, "a stored window continued")
        self.batch_select_indices(rows)
        self.queries = None

    def load_prefill(self, source: KVLayer) -> None:
        """The recorded window is already what this layer keeps (an observation pass then attends to it and
        stores none of its own tokens, as after a prefill: ``compress`` waits for the pass)."""
        self.lazy_initialization(source.keys, source.values)
        stored = source.slots.view(decoded=False)
        self.slots.set(source.keys, source.values, stored.valid, stored.positions)
        self.slots.seen, self.prefill_len = source.slots.seen, source.prefill_len
        self.prompt_tokens = source.prompt_tokens
        if self.observes:  # compress (the window kept) reads no query
            self.observation = ObservationPass(PromptRecord(source.keys.new_zeros(0), None, 1.0), self.held_prompt()[1])
            self.phase = moved(self.layer_idx, self.phase, Phase.AWAITING_PASS, "a recorded window")
        else:
            self.phase = moved(self.layer_idx, self.phase, Phase.DECODING, "a recorded window")
            store_coded(self.slots, self.kv_codec)


class WindowPolicy(LayerPolicy):
    """A sliding window's decision, whatever the method: its prompt leaves the last ``window - 1`` tokens."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    @property
    def slots(self) -> RingSlots:
        return cast(RingSlots, self.layer.slots)

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        used = self.slots.used
        keep = min(used, self.window - 1)  # copied, so the prompt's KV is freed
        positions = self.layer.kept_positions().clone()  # (the ring's own: already the last ``keep``)
        valid = None if self.slots.valid is None else self.slots.valid[:, used - keep :].clone()
        window = slice(used - keep, used)
        keys, values = self.layer.keys, self.layer.values
        self.slots.set(keys[:, :, window].clone(), values[:, :, window].clone(), valid, positions)

    def full_tokens(self) -> int:
        return min(self.slots.seen, self.window - 1)

    def kept_positions(self) -> torch.Tensor:
        prompt_tokens, prefill_len = self.layer.held_prompt()
        return self.slots.kept_positions(prefill_len, prompt_tokens)


_STORE_WHOLE = (
    "compress the context with a method that keeps its tokens (kvc.FullKV(), or a prompt method with "
    "heads='uniform' and layers='uniform')"
)
