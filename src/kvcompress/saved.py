"""A compressed cache's state, taken apart for a file and put back into a fresh cache of the same model.

A cache layer's state is its attributes: tensors (buffers, validity, positions, scores, factors,
landmarks, write positions) and plain values (counters, lengths, flags), plus the objects some
layers hold (an offload ``ChunkStore``, head-adaptive ``PackedSlots``), taken apart the same way.
What ``make_cache`` builds from the method and the model (the method itself, the rotary module,
the module a layer belongs to) is not saved: loading makes a fresh cache of the same method for the
same model and puts the saved state into it. An attribute of any other kind is refused by name, so
a new kind of state cannot be dropped unnoticed.

``model_fingerprint`` tells one model from another: its config and, per parameter, its shape, dtype
and the sum of a strided sample of its values.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from .cache import KVCompressCache, KVLayer
from .offload import ChunkStore
from .packed import PackedSlots

REBUILT = {"method", "rotary", "module_id", "dtype", "device", "view", "stream", "offsets"}  # made by make_cache / restored from the rest
STATEFUL = {cls.__name__: cls for cls in (ChunkStore, PackedSlots)}


class CacheFileError(ValueError):
    """A saved cache that cannot be loaded here: another model, another format version, a damaged file."""


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's config (without its private and volatile entries: the attention
    implementation, the path it was loaded from, the transformers version) and weights (shape, dtype
    and a strided sample's sum per parameter)."""
    config = {key: value for key, value in model.config.to_dict().items() if not key.startswith("_") and key != "transformers_version"}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, parameter in sorted(model.state_dict().items()):  # the checkpoint's names, whatever kvcompress wraps
            flat = parameter.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].double().sum().item()
            digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}:{sample:.6e}".encode())
    return digest.hexdigest()[:32]


def take_apart(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state of a cache layer (or of an object it holds): plain values returned, tensors added to
    ``tensors`` under ``prefix``; objects ``STATEFUL`` knows are taken apart in turn."""
    state: dict[str, Any] = {}
    for name, value in vars(obj).items():
        if name in REBUILT:
            continue
        key = f"{prefix}.{name}"
        if isinstance(value, torch.Tensor):
            state[name] = {"tensor": take_tensor(key, value, tensors)}
        elif type(value).__name__ in STATEFUL:
            state[name] = {"object": type(value).__name__, "state": take_apart(value, key, tensors)}
        elif name == "positions" and isinstance(value, list):  # PackedSlots: a tensor per segment
            state[name] = {"segments": [[take_tensor(f"{key}.{r}.{h}", t, tensors) for h, t in enumerate(row)] for r, row in enumerate(value)]}
        elif plain(value):
            state[name] = {"value": value}
        else:
            raise CacheFileError(f"cannot save {type(obj).__name__}.{name} ({type(value).__name__}); this cache holds state the file format does not know")
    return state


def take_tensor(key: str, tensor: torch.Tensor, tensors: dict[str, torch.Tensor]) -> str:
    """Add ``tensor`` under ``key`` (a copy where another attribute shares its memory: a file holds each apart)."""
    saved = tensor.detach().contiguous().cpu()
    if any(other.untyped_storage().data_ptr() == saved.untyped_storage().data_ptr() for other in tensors.values()):
        saved = saved.clone()
    tensors[key] = saved
    return key


def plain(value: Any) -> bool:
    """Whether ``value`` is JSON as it is (numbers, strings, None, and lists or tuples of those)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(plain(item) for item in value)


def put_back(obj: Any, state: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set the attributes ``take_apart`` saved on ``obj`` (tensors moved to ``device``, an offload
    store's host copy kept in host memory)."""
    for name, entry in state.items():
        if "tensor" in entry:
            tensor = tensors[entry["tensor"]]
            value = tensor if isinstance(obj, ChunkStore) and name == "host" else tensor.to(device)
        elif "object" in entry:
            value = STATEFUL[entry["object"]].__new__(STATEFUL[entry["object"]])
            put_back(value, entry["state"], tensors, device)
            value.restored(device)
        elif "segments" in entry:
            value = [[tensors[key].to(device) for key in row] for row in entry["segments"]]
        else:
            value = entry["value"]
            value = [list(item) if isinstance(item, (list, tuple)) else item for item in value] if isinstance(value, list) else value
        setattr(obj, name, value)


def cache_state(cache: KVCompressCache) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Every layer's state: the tensors (by name) and, per layer, its class and plain values."""
    tensors: dict[str, torch.Tensor] = {}
    layers = [{"class": type(layer).__name__, "state": take_apart(layer, f"layers.{i}", tensors)} for i, layer in enumerate(cache.layers)]
    return tensors, layers


def restore_cache(cache: KVCompressCache, layers: list[dict[str, Any]], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put a saved state into ``cache``, a fresh cache of the same method for the same model."""
    if len(layers) != len(cache.layers):
        raise CacheFileError(f"the file holds {len(layers)} layers, this model has {len(cache.layers)}")
    for index, (layer, saved) in enumerate(zip(cache.layers, layers)):
        if saved["class"] != type(layer).__name__:
            raise CacheFileError(f"layer {index} was saved as a {saved['class']}, this method makes a {type(layer).__name__}")
        put_back(layer, saved["state"], tensors, device)
        if isinstance(layer, KVLayer):
            layer.prefilled = layer.prefill_len is not None  # files written before the flag existed
            if layer.keys is not None:
                layer.dtype, layer.device = layer.keys.dtype, layer.keys.device


def to_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
