"""A layer's step, read once: the step object its phase calls for takes the step's keys and values (``update``),
attends the step's queries and commits what follows (the model's attention function calls ``attend`` and ``commit``
and reads nothing else of the layer: integrations/transformers/attach.py).

One step per kind of phase (``STEP_OF``):

* ``PromptStep``: the prompt coming in (one forward, blocks of a long one, or over a stored context: the layer's
  intake, intake.py); its queries attend causally, and once the whole prompt has come the layer compresses it, or
  waits for an observation pass (``KVLayer.end_prompt``).
* ``ObservationStep``: the observation pass (KVzip) attends the held prompt and its own tokens, which are never
  stored; the method observes each step with its queries' log-normalisers.
* ``LaterStep``: a decoding step, or the rest of a stored window's prompt, written into the slots and attended by the
  method over them: the step asks the storage what each query sees and in which basis (``visibility``, the codec),
  then calls the policy's ``attend``, which calls the storage's (or attends its own way); nothing below calls up.

How a step's new tokens are masked is the model's: its integration hands a ``NewTokens`` to ``attend``, and the cache
never reads a model's mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch

from ..storage import attention
from ..storage.codec import attended_pair, into_basis, out_of_basis
from ..storage.dense import DenseSlots
from ..storage.slots import Slots
from .errors import CacheMisuseError
from .intake import Intake, ObservationPass, PromptRecord, queries_to_keep
from .phase import Phase, moved
from .policy import LayerPolicy, present


class KVLayer(Protocol):
    """What a step reads and moves of its layer (``layer.KVLayer``, which imports this module, is one): nothing else."""

    layer_idx: int
    phase: Phase
    slots: Slots
    intake: Intake
    observation: ObservationPass | None
    policy: LayerPolicy
    record_window: int | None | bool
    prefill_len: int | None
    prompt_tokens: torch.Tensor | None

    @property
    def keys(self) -> torch.Tensor: ...

    @property
    def values(self) -> torch.Tensor: ...

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None: ...

    def advance(self, new: int) -> None: ...

    def end_prompt(self, record: PromptRecord) -> None: ...

    def held_prompt(self) -> tuple[torch.Tensor, int]: ...

    def slot_validity(self) -> torch.Tensor: ...


def observing(layer: KVLayer) -> ObservationPass:
    """The layer's open observation pass (its phase holds one: said once to the type checker)."""
    if layer.observation is None:
        raise CacheMisuseError(f"kvcompress: layer {layer.layer_idx} took an observation step with no pass open")
    return layer.observation


Attend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float, "float | None"], torch.Tensor
]
Attended = tuple[torch.Tensor, "torch.Tensor | None"]  # the output and, for an observation step, its log-normalisers


class NewTokens(Protocol):
    """A step's new tokens as the model masks them (padding, causality, a sliding window): the integration's side."""

    valid: torch.Tensor | None  # [b, q] which new tokens are real (None: all)

    def continuing(self, slot_valid: torch.Tensor) -> NewTokens:
        """The same tokens masked by ``slot_valid [b, slots]`` instead of the model's mask: a prompt continuing a
        stored context, whose slots are not the model's columns."""
        ...

    def causal(
        self,
        attend: Attend,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """The new queries (the newest of ``key``'s) attend by ``attend``, in blocks of queries where masked."""
        ...

    def causal_with_lse(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        softcap: float | None,
        unpadded: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same attention with each query's log-normaliser ``[b, q_heads, q]``; ``unpadded``: no slot and no new
        token is padding (an unmasked kernel may serve)."""
        ...

    def among_new(self) -> torch.Tensor | None:
        """The new queries' mask over the new tokens ``[b, 1, q, q]`` (None: plain causal)."""
        ...


class Step:
    """What a layer does with one step in its phase."""

    def take(
        self, layer: KVLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's keys and values stored (or held) by ``layer``; the keys and values its queries attend."""
        raise NotImplementedError

    def attend(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        new: NewTokens,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> Attended:
        """The step's attention (``sinks``: learned sink logits, gpt-oss, one more term in each denominator)."""
        raise NotImplementedError

    def commit(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        new_valid: torch.Tensor | None,
        scaling: float,
        lse: torch.Tensor | None,
    ) -> None:
        """After the step's attention: ``new_valid [b, q]`` which new tokens are real (None: all)."""
        raise NotImplementedError


class PromptStep(Step):
    """The prompt coming in; the last of it compresses the layer."""

    def take(
        self, layer: KVLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer.phase is Phase.EMPTY:
            layer.lazy_initialization(key_states, value_states)
            layer.phase = moved(layer.layer_idx, layer.phase, Phase.PROMPT, "a prompt's first tokens")
        return layer.intake.take(cast(DenseSlots, layer.slots), key_states, value_states)

    def attend(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        new: NewTokens,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> Attended:
        joined = layer.intake.joined_valid  # over a stored context: its slots, rows aligned, not the model's columns
        if joined is not None:
            new = new.continuing(joined)
        if sinks is not None:  # the same attention with each query's normaliser, for the sink's share
            return attention.with_sinks(*new.causal_with_lse(query, key, value, scaling, softcap), sinks), None
        return new.causal(layer.policy.attend, query, key, value, scaling, softcap), None

    def commit(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        new_valid: torch.Tensor | None,
        scaling: float,
        lse: torch.Tensor | None,
    ) -> None:
        if not torch.compiler.is_compiling():
            layer.advance(query.shape[-2])
        keep = queries_to_keep(layer.policy.queries_needed(), layer.record_window)
        record = layer.intake.commit(cast(DenseSlots, layer.slots), query, new_valid, scaling, keep)
        if record is not None:
            layer.end_prompt(record)


class ObservationStep(Step):
    """A step of the observation pass: attended over the held prompt, observed, never stored."""

    def take(
        self, layer: KVLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return observing(layer).take((layer.keys, layer.values), key_states, value_states)

    def attend(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        new: NewTokens,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> Attended:
        unpadded = (new.valid is None or bool(new.valid.all())) and bool(layer.slot_validity().all())
        out, lse = new.causal_with_lse(query, key, value, scaling, softcap, unpadded)
        if sinks is not None:
            return attention.with_sinks(out, lse, sinks), attention.sink_normaliser(lse, sinks)
        return out, lse

    def commit(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        new_valid: torch.Tensor | None,
        scaling: float,
        lse: torch.Tensor | None,
    ) -> None:
        observation = observing(layer)
        keys, valid = observation.step(query, new_valid, layer.slot_validity())
        layer.policy.observe(query, keys, valid, scaling, *present(lse, observation.context))


class LaterStep(Step):
    """A step after the prompt: written at the storage's position, attended over the slots by the method."""

    def take(
        self, layer: KVLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():  # a compiled step's loop made the room before it
            layer.policy.prepare_step(key_states.shape[-2])
            layer.slots.make_room(key_states.shape[-2])
        layer.slots.write(key_states, value_states)
        keys, values = layer.slots.view(decoded=not layer.slots.reads_codes(key_states))[:2]  # (attend decodes)
        return keys, values

    def attend(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        new: NewTokens,
        scaling: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> Attended:
        """The method's attention over the slots (its policy's ``attend``), each query seeing what the storage says it
        sees (``visibility``: compressed slots no longer line up with the model's columns), in the basis the codec
        decodes keys in, the output turned back (codec.py); with learned sinks (gpt-oss) the same attention spelled
        out, each sink taking its share."""
        slots = layer.slots
        block = new.among_new() if query.shape[-2] > 1 else None  # one query sees itself
        mask, turned = slots.visibility(block, query.shape[-2], new.valid), into_basis(slots.codec, query)
        if sinks is None:
            return out_of_basis(slots.codec, layer.policy.attend(turned, key, value, mask, scaling, softcap)), None
        pair = attended_pair(slots.codec, key, value)
        out, lse = attention.spelled_out_with_lse(turned, *pair, mask, scaling, softcap)
        return out_of_basis(slots.codec, attention.with_sinks(out, lse, sinks)), None

    def commit(
        self,
        layer: KVLayer,
        query: torch.Tensor,
        new_valid: torch.Tensor | None,
        scaling: float,
        lse: torch.Tensor | None,
    ) -> None:
        if not torch.compiler.is_compiling():  # a compiled step's loop moves them after the step (cache.advance)
            layer.advance(query.shape[-2])
        if new_valid is not None:  # written without asking the device whether all are real: that would synchronize
            layer.slots.mark_padding(new_valid)
        if layer.phase is Phase.CONTINUING:  # a window continuing a stored context: this step ends its prompt
            tokens, slots = layer.held_prompt()
            layer.prefill_len = slots + query.shape[-2]
            layer.prompt_tokens = tokens + (query.shape[-2] if new_valid is None else new_valid.sum(-1))
            layer.phase = moved(layer.layer_idx, layer.phase, Phase.DECODING, "the stored window's prompt ended")
        layer.policy.after_step(query, scaling)
        layer.slots.close_step(query.shape[-2])


class PassNotRun(Step):
    """The prompt waits for its observation pass: no step may come before it."""

    def take(
        self, layer: KVLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise CacheMisuseError(
            "kvcompress: this cache's method compresses the prompt after an observation pass (KVzip: the model "
            "repeating the prompt), and the model was called again before that pass ran; kvcompress.generate and "
            "kvcompress.compress run it (model.generate() cannot): use them to prefill"
        )


_PROMPT, _LATER = PromptStep(), LaterStep()
STEP_OF: dict[Phase, Step] = {
    Phase.EMPTY: _PROMPT,
    Phase.PROMPT: _PROMPT,
    Phase.AWAITING_PASS: PassNotRun(),
    Phase.OBSERVING: ObservationStep(),
    Phase.CONTINUING: _LATER,
    Phase.DECODING: _LATER,
}
