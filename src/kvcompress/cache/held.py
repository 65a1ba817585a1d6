"""What a cache layer and its method's policy hold beside the storage, declared once per class; saving, loading,
batch selection, beam reordering, joining a batch's groups, moving between devices and counting bytes all derive from
the declarations.

A layer class, or a policy class (policy.py), declares each such attribute once, in its body, with its type and role,
as a dataclass field is (``prompt_tokens: torch.Tensor | None = hold(rows=True)``, gpt-fast's ``register_buffer`` in
spirit); a subclass adds its own, ``declared`` collects them over the class's bases and ``reset`` gives a fresh layer
or policy their defaults; ``holding`` walks a layer's and its policy's together, one flat set of names. The storage
(``layer.slots``) saves and moves its own tensors. A tensor attribute a layer or policy sets that its class does not
declare is a bug (a test walks every method's layers after a generation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..storage.slots import held_state, inner, nested, on_device
from ..storage.tensors import nbytes
from .errors import CacheMisuseError
from .phase import Phase, moved


@dataclass(frozen=True)
class Held:
    """How a layer holds one attribute (``hold`` makes one).

    ``saved``: an entry of the saved file under its name (docs/file-format.md); ``rows``: the batch comes first, so
    selecting, repeating or reordering rows and joining groups of a batch apply to it; ``counted``: device bytes the
    stats count as index bytes; ``index``: the method's selection index, read at every decoding step (counted too);
    ``ragged``: a dimension whose size follows the data (a factor's rank), padded with zeros when groups are joined;
    ``kind``: an object with ``state_dict``/``from_state``/``batch_apply``/``concat`` (an offload store);
    ``join``: how a plain value of groups of a batch joins (``sum``, ``all``; None: the first group's);
    ``default``: its value in a fresh layer (``reset``)."""

    saved: bool = True
    rows: bool = False
    counted: bool = False
    index: bool = False
    ragged: int | None = None
    kind: Any = None  # a class with from_state (offload.ChunkStore)
    join: Callable[[list[Any]], Any] | None = None
    default: Any = None


def hold(
    saved: bool = True,
    rows: bool = False,
    counted: bool = False,
    index: bool = False,
    ragged: int | None = None,
    kind: type | None = None,
    join: Callable[[list[Any]], Any] | None = None,
    default: Any = None,
) -> Any:
    """A layer attribute's declaration, its class-level value (typed ``Any`` so it may stand where the
    attribute's own type is annotated, as ``dataclasses.field`` does)."""
    return Held(saved, rows, counted or index, index, ragged, kind, join, default)


_DECLARED: dict[type, dict[str, Held]] = {}  # per class, read once: beam search reorders a layer's rows every step


def declared(cls: type) -> dict[str, Held]:
    """Every attribute ``cls`` and its bases declare (``hold``), the bases' first, each in its order (read-only)."""
    if cls not in _DECLARED:
        merged: dict[str, Held] = {}
        for klass in reversed(cls.__mro__):
            merged.update((name, value) for name, value in vars(klass).items() if isinstance(value, Held))
        _DECLARED[cls] = merged
    return _DECLARED[cls]


def reset(holder: Any) -> None:
    """Every attribute ``holder`` (a fresh layer, or a fresh policy) declares, at its default."""
    for name, spec in declared(type(holder)).items():
        setattr(holder, name, spec.default)


def holding(layer: Any) -> list[tuple[Any, str, Held]]:
    """Every attribute ``layer`` and its method's policy (``layer.policy``) declare, each with the object holding it:
    the layer's first, then the policy's (one flat set of names, as a saved file holds them)."""
    return [(owner, name, spec) for owner in (layer, layer.policy) for name, spec in declared(type(owner)).items()]


def save(layer: Any) -> dict[str, Any]:
    """The layer's saved entries: its storage's, an empty marker for each layout it may swap to and does not hold,
    then every saved attribute (a held object's entries nested under its name). Only a layer at rest (its prompt
    compressed, no step half done) is saved."""
    if layer.phase is not Phase.DECODING or layer.open_step is not None:
        raise CacheMisuseError(
            "kvcompress: a cache can be saved once its prompt is prefilled and compressed, not during a step (layer "
            f"{layer.layer_idx} is {layer.phase.value})"
        )
    layouts = type(layer.policy).LAYOUTS
    state = {**layer.slots.state_dict(), **{kind.NAME: None for kind in layouts if not isinstance(layer.slots, kind)}}
    for owner, name, spec in holding(layer):
        if spec.saved:
            value = getattr(owner, name)
            state.update(nested(name, held_state(value)) if spec.kind is not None else {name: value})
    return state


def load(layer: Any, state: dict[str, Any], device: torch.device) -> None:
    """``save``'s entries (tensors in host memory) put back into a fresh layer on ``device``, which is then at rest
    (decoding); an entry a file written before it existed lacks loads as None."""
    put(layer, state, device)
    layer.phase = moved(layer.layer_idx, layer.phase, Phase.DECODING, "a saved state loaded")


def put(layer: Any, state: dict[str, Any], device: torch.device) -> None:
    """``save``'s entries put into ``layer`` on ``device``, its phase left to the caller."""
    swapped = [kind for kind in type(layer.policy).LAYOUTS if inner(state, kind.NAME) is not None]
    if swapped:
        layer.slots = swapped[0].from_state(state, device)
    else:
        layer.slots.load_state_dict(state, device)
    for owner, name, spec in holding(layer):
        if not spec.saved:
            continue
        if spec.kind is not None:
            entries = inner(state, name)
            setattr(owner, name, None if entries is None else spec.kind.from_state(entries, device))
        else:
            setattr(owner, name, on_device(state.get(name), device))
    layer.is_initialized = True
    layer.dtype, layer.device = layer.keys.dtype, layer.keys.device


def apply_rows(layer: Any, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A batch operation (select, repeat, reorder rows) on the storage and every attribute whose batch is first."""
    layer.slots.batch_apply(apply)
    for owner, name, spec in holding(layer):
        value = getattr(owner, name)
        if not spec.rows or value is None:
            continue
        if isinstance(value, torch.Tensor):
            setattr(owner, name, apply(value))
        else:
            value.batch_apply(apply)


def move(layer: Any, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every tensor of the layer through ``place`` (onto another device): the storage's and each declared one."""
    layer.slots.batch_apply(place)
    for owner, name, _ in holding(layer):
        value = getattr(owner, name)
        if isinstance(value, torch.Tensor):
            setattr(owner, name, place(value))
        elif value is not None and hasattr(value, "batch_apply"):
            value.batch_apply(place)


def join(layer: Any, others: list[Any]) -> None:
    """The rows of ``others`` (the same layer in caches of other groups of one batch, each compressed with the
    batch's shapes, none decoded yet) appended to ``layer``'s: the storage's, then every attribute whose batch is
    first (each freed from ``others`` as the join goes) and every plain value with a ``join`` rule."""
    stepped = (each.slots.view(decoded=False).cursor is not None for each in (layer, *others))
    if any(stepped) or any(each.phase is not Phase.DECODING for each in (layer, *others)):
        raise CacheMisuseError("kvcompress: only caches holding a compressed prompt, not yet decoded, can be joined")
    layer.slots = layer.slots.joined([other.slots for other in others])
    for owner, name, spec in holding(layer):
        holders = [owner, *(other if owner is layer else other.policy for other in others)]
        values = [getattr(each, name) for each in holders]
        if spec.join is not None:
            setattr(owner, name, spec.join(values))
        if not spec.rows or any(value is None for value in values):
            continue
        if isinstance(values[0], torch.Tensor):
            setattr(owner, name, concat_rows(values, spec.ragged))
        else:
            setattr(owner, name, type(values[0]).concat(values))
        for other in holders[1:]:
            setattr(other, name, None)


def counted_bytes(layer: Any, index_only: bool = False) -> int:
    """Bytes of the attributes the stats count as index bytes (``index_only``: the selection index alone)."""
    return nbytes(
        *(getattr(owner, name) for owner, name, spec in holding(layer) if (spec.index if index_only else spec.counted))
    )


def concat_rows(tensors: list[torch.Tensor], ragged: int | None = None) -> torch.Tensor:
    """Tensors with the batch first, joined along it; with ``ragged``, each padded with zeros at the
    end of that dimension to the largest first."""
    if ragged is not None:
        size = max(t.shape[ragged] for t in tensors)
        tensors = [
            torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - ragged) + (0, size - t.shape[ragged])) for t in tensors
        ]
    return torch.cat(tensors, dim=0)
