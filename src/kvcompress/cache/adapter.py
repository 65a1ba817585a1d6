"""Transformers' layer contract, as a thin adapter over the layer's storage and its prompt's way.

``TransformersLayer`` is what transformers' ``Cache`` calls on a layer (``update``, ``get_seq_length``,
``get_mask_sizes``, ``crop``, ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``); it routes
a step's keys and values to the storage (``slots``) or to the prompt's intake, and hands the storage's own
operations on. Mixed into ``KVLayer`` (layer.py), whose ``__init__`` declares the state it reads.

``get_seq_length`` is the *logical* length (prompt + appended tokens, padding included), so
transformers keeps assigning RoPE positions and slicing generate inputs from the true length.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicLayer

from .errors import CacheMisuseError, UnsupportedModelError

_announced = threading.local()


def take_announced() -> tuple[TransformersLayer | None, torch.Tensor | None]:
    """The layer (and the keys it returned) whose ``update`` ran last in this thread, then forget it.

    Attention modules call ``cache.update`` right before their attention function, so this is how
    the attention function (integrations/transformers/attach.py) finds the cache layer it is working for."""
    layer, keys = getattr(_announced, "layer", None), getattr(_announced, "keys", None)
    _announced.layer = _announced.keys = None
    return layer, keys


def _refuse_replacing(name: str) -> Callable[[TransformersLayer, Any], None]:
    def refuse(layer: TransformersLayer, value: Any) -> None:
        if value is not None:  # transformers' base class starts every layer with None
            raise CacheMisuseError(f"kvcompress: a layer's {name} are views of its storage (layer.slots)")
    return refuse


class TransformersLayer(DynamicLayer):
    """A cache layer as transformers sees it: the storage's tensors as ``keys``/``values``, a step's
    ``update``, the logical length, and the batch operations of beam search."""

    # The storage as the layer's callers read it (SlotView: keys/values as attention gets them, validity, ...).
    keys = property(lambda self: self.slots.view().keys, _refuse_replacing("keys"))
    values = property(lambda self: self.slots.view().values, _refuse_replacing("values"))
    valid = property(lambda self: self.slots.view().valid)
    positions = property(lambda self: self.slots.view().positions)
    cursor = property(lambda self: self.slots.view().cursor)
    used = property(lambda self: self.slots.used)
    seen_tokens = property(lambda self: self.slots.seen)  # the logical length: every token fed, padding included

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

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # transformers' mask covers logical positions; attach.py keeps only its newest columns.
        return self.seen_tokens + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvcompress caches cannot be cropped (assisted/speculative decoding is unsupported)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_apply(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

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

    def visibility(self, new_block: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
        """Boolean mask ``[b, 1, q_len, slots]`` of what the new queries see, from the storage and
        ``new_block [b, 1, q_len, q_len]``, the new tokens among themselves (None: causal). None
        when plain causal attention over the slots is right (a prefill without padding)."""
        return new_block if self.is_prefill else self.slots.visibility(new_block, q_len)

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions held, ``[batch, kv_heads, prompt slots]`` ascending per head; -1 marks
        filler slots of rows (in a batch) that keep fewer tokens than the longest row."""
        return self.slots.kept_positions(self.prefill_len)
