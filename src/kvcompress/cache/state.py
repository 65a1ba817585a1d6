"""A layer's state as a saved file holds it (docs/file-format.md) and as rows of a batch are joined, selected
and repeated. Mixed into ``KVLayer`` (layer.py), whose ``__init__`` declares the state these methods read."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..storage.slots import Slots, held_state, inner, nested, on_device
from .errors import CacheMisuseError


class LayerState:
    """``state_dict`` / ``load_state_dict`` under the documented names, ``concat`` of groups of a batch, and the
    batch operations every tensor of the layer goes through (``_batch_apply``)."""

    STATE: ClassVar[tuple[str, ...]] = ()  # a subclass's own saved entries (tensors or plain values), by attribute
    HELD: ClassVar[dict[str, Any]] = {}  # objects held beside the slots, saved under their name (state_dict)
    LAYOUTS: ClassVar[tuple[type[Slots], ...]] = ()  # storage a subclass may swap its slots for (saved under its NAME)

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

    def concat(self, others: list[LayerState]) -> None:
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


def concat_rows(tensors: list[torch.Tensor], ragged: int | None = None) -> torch.Tensor:
    """Tensors with the batch first, joined along it; with ``ragged``, each padded with zeros at the
    end of that dimension to the largest first."""
    if ragged is not None:
        size = max(t.shape[ragged] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - ragged) + (0, size - t.shape[ragged])) for t in tensors]
    return torch.cat(tensors, dim=0)
