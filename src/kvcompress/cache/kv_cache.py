"""The cache: ``KVCompressCache``, a transformers ``Cache`` made of one ``KVLayer`` (layer.py) per model layer.

It hands each call to its layers (a prompt's spans, a prefill record, a stored context continued, an observation
pass, room for the next steps, a batch's groups joined), moves a stored context between devices, and measures
what the layers hold against what a full cache would (``stats``). What a method needs of it is ``LayerFactory``.
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache

from ..storage.codec import KVCodec
from ..storage.tensors import to_host
from . import held
from .errors import CacheMisuseError
from .layer import KVLayer
from .phase import Phase
from .tokens import TokenSpans


class LayerFactory(Protocol):
    """What a cache needs from a method (``methods.base.Method`` provides it)."""

    def check_model(self, model: Any) -> None: ...

    def make_layer(self, layer_idx: int, model: Any) -> KVLayer: ...

    def describe(self) -> str: ...

    def kv_codec(self) -> str | None: ...

    def storage_codec(self, head_dim: int, dtype: torch.dtype, turned: bool | None = None) -> KVCodec | None: ...

    def needs_tokens(self) -> bool: ...

    def attends_slots(self) -> bool: ...

    def summarize(self, totals: dict[str, Any]) -> dict[str, Any]: ...

    def observation(self) -> Any: ...

    def compresses_together(self) -> bool: ...

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

    layers: list[KVLayer]  # type: ignore[assignment]  # transformers types them as its own layer classes

    def __init__(
        self,
        method: LayerFactory,
        layers: list[KVLayer],
        model: torch.nn.Module | None = None,
        spans: TokenSpans | None = None,
    ) -> None:
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.method = method
        # the model it was made for, held weakly (attach.py refuses any other; a saved cache's fingerprint reads it):
        # compared by identity, never by id(), which a freed model hands on to the next object made at its address
        self.model = weakref.ref(model) if model is not None else lambda: None
        self.has_model = model is not None
        self.keyword = cache_keyword(model)  # the model's name for its cache argument
        self.span_table = spans  # the tokenizer's word boundaries, when known
        self.timings: dict[str, float | None] = {
            "prefill_s": None,
            "ttft_s": None,
            "decode_ms_per_token": None,
            "compile_s": None,
        }
        # the model embedded this cache's prompt itself (no one else holds its hidden states)
        self.embeds_itself = False
        # layers compress after an observation pass (end_observation)
        self.observe_first = method.compresses_together()  # every layer waits (end_observation, compress_waiting)
        self.observe_s = 0.0  # time the observation pass took (part of compressing)
        self.call_checked = False  # the input check let this model's call through (attach.check_inputs)
        for layer in layers:
            layer.observes = self.observe_first

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's step, taken only within a call of the model this cache was made for (its input check ran)."""
        # a compiled step reads no Python state here: its loop's model call was checked before it
        if not torch.compiler.is_compiling() and self.has_model and not self.call_checked:
            raise CacheMisuseError(
                "kvcompress: this cache was called by a model it was not made for (another model instance, or one "
                "never prepared by method.make_cache(model)); make a cache for that model with "
                "method.make_cache(model)"
            )
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def check_model(self, model: Any, remedy: str) -> None:
        """Refuse ``model`` unless it is the one instance this cache was made for (another instance, even of the same
        checkpoint, has other attention modules, and perhaps other weights); ``remedy`` says what to do instead."""
        if self.model() is not model:
            layers = model.config.get_text_config().num_hidden_layers
            raise CacheMisuseError(
                f"kvcompress: this cache was made for another model instance ({len(self.layers)} "
                f"layers; this {type(model).__name__} has {layers}); {remedy}"
            )

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
            layer.record_window = window

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """LongTensor ``[batch, kv_heads, n_kept]``: original prompt positions kept by ``layer_idx``."""
        return self.layers[layer_idx].kept_positions()

    def continue_context(
        self, context: KVCompressCache, rows: torch.Tensor, pads: list[int], spans: torch.Tensor | None
    ) -> None:
        """This fresh cache's prompt continues ``context``'s (a stored context, read and never written, e.g. a
        document prefilled once): rows ``rows`` of it, one per row of the new prompt (a question), whose tokens
        are led by ``pads`` padding slots; each layer's prefill attends to the context, then the method
        compresses the joined prompt. ``spans``: the joined prompt's word spans, rows right-aligned."""
        if context.model() is not self.model():
            raise CacheMisuseError(
                "kvcompress: this context was stored for another model; ask it with the model that compressed it"
            )
        for layer, source in zip(self.layers, context.layers):
            layer.continue_prompt(source, rows, pads, spans)

    def forget_records(self) -> None:
        """Drop what the layers recorded of their prefill for later prompts (queries, word spans)."""
        for layer in self.layers:
            layer.queries = layer.query_scaling = layer.spans = None

    def storable(self) -> bool:
        """Whether a later prompt can continue this cache's prompt without writing to it (``continue_context``)."""
        return all(layer.is_sliding or layer.stored_prompt() is not None for layer in self.layers)

    def hold_in_host(self) -> bool:
        """Whether this is a stored context (every prompt token kept, continuable); such a store on an
        accelerator moves to host memory (pinned): the device then holds only what each question selects."""
        whole = self.storable() and self.stats()["tokens_kept_fraction"] == 1.0
        held = self.device_of()
        if whole and held is not None and held.type != "cpu":
            self.move("cpu")
        return whole

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
            if not layer.is_sliding and layer.stored_prompt() is None:
                raise CacheMisuseError(
                    f"kvcompress: layer {layer.layer_idx} ({layer.kind}) cannot be moved; "
                    "only a stored context's layers can"
                )
            held.move(layer, place)
            layer.device = device

    def note_batch(self, lengths: torch.Tensor) -> None:
        """This cache holds a group of a batch's rows, whose real prompt lengths are ``lengths``: its
        layers compress into the batch's shapes, so ``concat`` can join the groups."""
        for layer in self.layers:
            layer.batch_lengths = lengths

    @classmethod
    def concat(cls, caches: list[KVCompressCache]) -> KVCompressCache:
        """The rows of ``caches`` (groups of one batch, in order, each prefilled after ``note_batch``)
        as one cache: the first, with the others' rows appended layer by layer."""
        first = caches[0]
        for index, layer in enumerate(first.layers):
            held.join(layer, [cache.layers[index] for cache in caches[1:]])
        return first

    def begin_observation(self, openings: torch.Tensor) -> None:
        """The observation pass starts: until ``end_observation`` the model's calls are its pieces, which
        repeat each row's prompt after its first ``openings [b]`` tokens (a chat template's opening, a BOS)."""
        for layer in self.layers:
            layer.begin_observation(openings)

    def end_observation(self, seconds: float) -> None:
        """The observation pass (``seconds`` long) is over: the method sees every layer that waited
        for it (e.g. to share a budget across layers), then every layer compresses."""
        start = time.perf_counter()
        # the method's own layers: a sliding-window layer keeps its window, whatever the method
        self.method.before_compress(
            [layer for layer in self.layers if layer.observation is not None and not layer.is_sliding]
        )
        self.observe_s += seconds + time.perf_counter() - start
        for layer in self.layers:
            layer.end_observation()

    def compress_waiting(self) -> None:
        """Compress the layers that wait for every layer to be scored, once all hold their prompts, where the method
        runs no observation pass (``layers="global"`` for a method that scores from the prefill): the end of the
        model's call that fed the prompt (attach.end_call), or of a prefill record's loading."""
        if (
            not self.observe_first
            or self.method.observation() is not None
            or not any(layer.phase is Phase.AWAITING_PASS for layer in self.layers)
        ):
            return  # (first: every eager step's call ends here, and most methods never wait)
        if any(layer.phase in (Phase.EMPTY, Phase.PROMPT) for layer in self.layers):  # (a stored window continues)
            raise CacheMisuseError(
                "kvcompress: a call ended with only some layers holding their whole prompt; "
                "every layer must be fed the same prompt in one call"
            )
        self.end_observation(0.0)

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        """Room in every layer for ``tokens`` more tokens, so the steps that append them keep every
        shape (a compiled decoding step is one graph only while nothing is reallocated); with
        ``buckets``, capacities rounded to ``capacity_bucket``, so other requests reuse the graph."""
        for layer in self.layers:
            layer.policy.prepare_step(1)
            layer.slots.reserve(tokens, buckets)

    def prepare_step(self, new: int) -> None:
        """Every layer before a compiled step of ``new`` tokens, outside its graph (a layer under a decoding bound
        re-selects here, so the graph never changes; the room was reserved)."""
        for layer in self.layers:
            layer.policy.prepare_step(new)

    def advance(self, new: int) -> None:
        """The host mirrors after a compiled step of ``new`` tokens (an eager step's ``commit`` moves them)."""
        for layer in self.layers:
            layer.advance(new)

    def stats(self) -> dict[str, Any]:
        """What is held versus what a full cache would hold, measured from the tensors, plus the
        method's own fields (from its layers' counters) and the last run's timings."""
        layers = [layer for layer in self.layers if layer.is_initialized and not layer.phase.taking_prompt]
        if not layers:
            return {"method": self.method.describe(), "prompt_tokens": 0, "new_tokens": 0}
        per_layer = [layer.stats() for layer in layers]
        totals = merge_counters(per_layer)
        facts = merge_facts([layer.policy.info() for layer in layers])
        first = layers[0]
        prompt_tokens, prefill_len = first.held_prompt()
        prompt = prompt_tokens.tolist()
        full, kept = totals["kv_bytes_full"], totals["kv_bytes_kept"]
        device = kept + totals["spare_bytes"] + totals["index_bytes"]
        return {
            "method": self.method.describe(),
            "prompt_tokens": prompt[0] if len(prompt) == 1 else prompt,
            "new_tokens": first.slots.seen - prefill_len,
            "kv_tokens_per_layer": [s["kv_tokens"] for s in per_layer],
            # the precision kv_bits=16 keeps and kv_bytes_full counts: the model's own (float32 on a CPU)
            "kv_dtype": str(first.dtype).removeprefix("torch."),
            "kv_stored_as": self.method.kv_codec() or str(first.dtype).removeprefix("torch."),
            "kv_bytes_full": full,
            "kv_bytes_kept": kept,
            "kv_kept_fraction": kept / full if full else 1.0,  # bytes: a codec's tokens cost less
            "tokens_kept_fraction": sum(s["kv_tokens"] for s in per_layer) / max(1, totals["kv_tokens_full"]),
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
