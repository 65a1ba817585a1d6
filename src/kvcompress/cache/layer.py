"""A cache layer: ``KVLayer``, one class made of its roles, and ``WindowLayer`` for sliding-window layers.

A layer holds its storage, a ``storage.slots.Slots`` object (dense slots, a sliding window's ring, capped slots,
packed per-head segments: one class per layout, knowing no method), which keeps the keys and values, their
validity and positions, the lengths and the batch operations; the layer swaps it for another layout where a
method needs one (head-adaptive budgets pack after compression). Its roles, one file each:

* ``adapter.TransformersLayer``: transformers' layer contract (``update``, the lengths, beam search's batch
  operations), handed to the storage or the prompt's intake;
* ``lifecycle.PromptLifecycle``: the prompt's way from prefill to compression (blocks, an observation pass, a
  prefill record, a stored context continued) and each later step's commit;
* ``policy.LayerPolicy``: what a method's layer overrides (``compress``, ``attend``, ``after_step``,
  ``observe``, ``stats``, ...), with the defaults of an uncompressed layer;
* ``state.LayerState``: the saved file's entries (docs/file-format.md) and the joining of a batch's groups.

It knows nothing of any method: a method's layer subclasses ``KVLayer`` and overrides the policy.
"""

from __future__ import annotations

import torch

from ..storage.slots import DenseSlots, RingSlots, Slots
from .adapter import TransformersLayer
from .intake import PromptIntake
from .lifecycle import PromptLifecycle
from .policy import LayerPolicy
from .state import LayerState


class KVLayer(PromptLifecycle, LayerState, LayerPolicy, TransformersLayer):
    """One layer of the cache: it holds its storage (``slots``), and applies its method's policy through
    the contract a method's layer overrides (``compress``, ``attend``, ``after_step``, ``observe``);
    uncompressed unless a subclass overrides it. Its state is what ``__init__`` declares.

    The prompt is held as the prefill computed it; from the first later step on, the slots live in
    buffers of a fixed capacity and a step writes at the storage's device-side position, so it reads
    no host value and keeps every shape: a decoding step is one capturable graph. The lengths live in
    the storage, the device-side position and validity the truth; their host mirrors describe the
    cache before the step until the step commits, then move in ``advance``: an eager step's ``commit``
    calls it first, a compiled decoding loop after the step's graph (``KVCompressCache.advance``)."""

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
