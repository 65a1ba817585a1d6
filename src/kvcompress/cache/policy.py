"""What a method decides for one cache layer: ``LayerPolicy``, with an uncompressed layer's defaults.

A layer (layer.py) holds the storage and drives the pipeline (prompt -> compression -> decoding) the same way for
every method; at the points where a method decides, it asks its policy: which of the prompt's last queries to keep
for compression (``queries_needed``), what to keep of the whole prompt (``compress``), how a step attends
(``attend``), what follows a step (``prepare_step``, ``advanced``, ``after_step``), what an observation pass leaves
(``observe``), which prompt positions are held (``kept_positions``), and what the stats say (``stats``, ``info``).
A method's policy overrides those; a policy declares what it holds beside the layer's storage with ``hold``, as a
layer class does (held.py saves, loads, moves and joins both), and reads the layer it serves as ``self.layer``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch

from ..storage.codec import KVCodec
from ..storage.slots import Slots
from . import held
from .errors import CacheMisuseError
from .intake import ObservationPass
from .phase import Phase


class ScoredLayer(Protocol):
    """What a method's scores read of a layer's prompt (``layer_scores``): its keys and values ``[b, kv_heads, n,
    d]``, validity, real tokens, word spans, rotary module, where each row's question begins and an observation pass's
    record. ``layer.KVLayer`` is one; so is a vLLM worker's prompt (``serving.settings.PromptLayer``)."""

    spans: torch.Tensor | None
    rotary: Any  # the model's rotary module for the layer (methods that score with it)
    observation: ObservationPass | None

    @property
    def keys(self) -> torch.Tensor: ...

    @property
    def values(self) -> torch.Tensor: ...

    @property
    def prompt_tokens(self) -> torch.Tensor | None: ...

    @property
    def asked(self) -> torch.Tensor | None: ...

    def slot_validity(self) -> torch.Tensor: ...


class PolicyLayer(ScoredLayer, Protocol):
    """What a policy may read (and set) of the layer it serves: ``layer.KVLayer`` is one; the layer imports this
    module, so its policies see it through this, nothing more."""

    layer_idx: int
    phase: Phase
    slots: Slots  # (a policy may swap it for its own layout: LAYOUTS)
    kv_codec: KVCodec | None  # (a byte budget sets its layer's)
    dtype: torch.dtype | None
    prefill_len: int | None
    sinks: torch.Tensor | None
    batch_lengths: torch.Tensor | None

    def held_prompt(self) -> tuple[torch.Tensor, int]: ...

    def kept_positions(self) -> torch.Tensor: ...


def present(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Tensors a phase guarantees (the prompt's queries a policy asked for, the state its compression set, declared
    with ``hold`` and None before), where a later step reads them: the phase said once to the type checker; a read
    before they exist is refused in one line."""
    if any(tensor is None for tensor in tensors):
        raise CacheMisuseError(
            "kvcompress: a method read what its phase had not set yet (the prompt's queries it "
            "asked for, or what its compression keeps)"
        )
    return tuple(tensor for tensor in tensors if tensor is not None)


class LayerPolicy:
    """An uncompressed layer's decisions: keep everything, attend every slot (see the module docstring)."""

    LAYOUTS: ClassVar[tuple[type[Slots], ...]] = ()  # storage the policy may swap its layer's slots for (by NAME)
    # the kind of layer a file records for a layer of this policy (docs/file-format.md; None: the layer's class)
    SAVED_AS: ClassVar[str | None] = None

    def __init__(self) -> None:
        self._layer: Callable[[], PolicyLayer | None] = lambda: None  # the layer this policy serves (``serve``)
        held.reset(self)  # every attribute the policy's class declares (hold) at its default

    def serve(self, layer: PolicyLayer) -> None:
        """Serve ``layer`` (the layer calls it when it is made); held weakly, so a cache dropped is freed at once,
        its tensors with it, not at the next cycle collection."""
        self._layer = weakref.ref(layer)

    @property
    def layer(self) -> PolicyLayer:
        """The layer this policy serves."""
        layer = self._layer()
        if layer is None:
            raise CacheMisuseError("kvcompress: a method's layer policy was used after its cache was freed")
        return layer

    @property
    def slots(self) -> Slots:
        """The layer's storage (a policy's subclass narrows its type to the layout it gives its layer)."""
        return self.layer.slots

    def queries_needed(self) -> int | None:
        """The last prefill queries ``compress`` reads (None: all of them). Default: none."""
        return 0

    def compress(self, query: torch.Tensor | None, scaling: float) -> None:
        """Once the layer holds the whole prompt (``query``: its last post-RoPE queries ``[b, q_heads, seq, d]``): keep
        or store what the method needs (the storage codes what it keeps afterwards). Default: keep everything."""

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` over the layer (``keys``/``values`` as ``update`` returned them, coded where the
        storage reads codes: an override decodes them first, ``codec.attended_pair``)."""
        return self.layer.slots.attend(query, keys, values, mask, scaling, softcap)

    def prepare_step(self, new: int) -> None:
        """Before a step of ``new`` tokens is written, or its room reserved (an eager step's ``update``, the
        cache's ``reserve``, a compiled loop between steps): e.g. a decoding bound's re-selection. Default: nothing."""

    def advanced(self, new: int) -> None:
        """After the storage's host mirrors moved past a step of ``new`` tokens: the policy's own. Default: none."""

    def after_step(self, query: torch.Tensor, scaling: float) -> None:
        """After a later step's tokens are stored (e.g. evict while decoding). Default: nothing."""

    def observe(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        lse: torch.Tensor,
        context: torch.Tensor,
    ) -> None:
        """A step of the observation pass: ``query [b, q_heads, new, d]`` attended ``keys`` (the prompt's slots,
        then the step's), ``valid [b, prompt + new]``; ``lse [b, q_heads, new]`` each query's log-normaliser;
        ``context [b, prompt]`` the prompt slots the pass repeats (after each row's opening). Default: nothing."""

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions held ``[b, kv_heads, n]`` ascending per head (-1: filler). Default: the storage's."""
        return self.layer.slots.kept_positions(self.layer.held_prompt()[1])

    def prompt_readable(self) -> bool:
        """Whether the layer's slots hold its prompt as a later prompt may continue it. Default: they do."""
        return True

    def stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The layer's counters (``stats``: its storage's, measured) with the policy's own. Default: as they are."""
        return stats

    def info(self) -> dict[str, Any]:
        return {}  # facts about this layer shown in the cache's stats (kept when every layer agrees)

    def uncapturable(self) -> str | None:
        return None  # why this layer's decoding step cannot be one compiled graph (None: it can)

    def full_tokens(self) -> int:
        return self.layer.slots.seen  # tokens per KV head an uncompressed cache would hold for this layer
