"""A compressed cache's state, taken apart for a file and put back into a fresh cache of the same model.

A layer's state is what its ``state_dict`` names (docs/file-format.md; storage, then what its
method adds, objects it holds under their own prefix): tensors, and plain values (counters,
lengths, flags). Those names are the file format, whatever the attributes are called. What
``make_cache`` builds from the method and the model (the method itself, the rotary module, the
module a layer belongs to) is not saved: loading makes a fresh cache of the same method for the same
model and puts the saved state into it (``load_state_dict``). An entry of any other kind is refused
by name, so a new kind of state cannot be dropped unnoticed.

``model_fingerprint`` tells one model from another: its config and, per parameter, its shape, dtype
and the sum of a strided sample of its values.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from ..cache import held
from ..cache.errors import Said
from ..cache.kv_cache import KVCompressCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CacheFileError(Said, ValueError):
    """A saved cache that cannot be loaded here: another model, another format version, a damaged file."""


# The config entries that shape a cache (docs/file-format.md): not the whole config, whose other
# entries come and go with transformers versions while the model stays the same.
ARCHITECTURE = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "rope_theta",
    "partial_rotary_factor",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
)


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short hash of the model's architecture (``ARCHITECTURE``'s config entries) and weights (per
    parameter: its name, shape, dtype and a strided sample's sum): the same for the same checkpoint
    under any transformers version, different for another model."""
    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or {}  # where newer configs keep the rotary entries
    shape = {key: rope[key] if key in rope else getattr(config, key, None) for key in ARCHITECTURE}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, parameter in sorted(model.state_dict().items()):  # the checkpoint's names, whatever kvcompress wraps
            flat = parameter.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].double().sum().item()
            digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}:{sample:.6e}".encode())
    return digest.hexdigest()[:32]


def cache_state(cache: KVCompressCache) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Every layer's ``state_dict`` (docs/file-format.md): its tensors under ``layers.<i>.<name>`` and,
    per layer, its class and its plain values (numbers, flags, lists; None for an absent tensor)."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for index, layer in enumerate(cache.layers):
        values: dict[str, Any] = {}
        for name, value in held.save(layer).items():
            if isinstance(value, torch.Tensor):
                take_tensor(f"layers.{index}.{name}", value, tensors)
            elif plain(value):
                values[name] = value
            else:
                raise CacheFileError(
                    f"cannot save {type(layer).__name__}'s {name} ({type(value).__name__}): neither a tensor nor a "
                    "plain value"
                )
        layers.append({"class": layer.kind, "values": values})
    return tensors, layers


def take_tensor(key: str, tensor: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensor`` under ``key`` (a copy where another entry shares its memory: a file holds each apart)."""
    saved = tensor.detach().contiguous().cpu()
    if any(other.untyped_storage().data_ptr() == saved.untyped_storage().data_ptr() for other in tensors.values()):
        saved = saved.clone()
    tensors[key] = saved


def plain(value: Any) -> bool:
    """Whether ``value`` is JSON as it is (numbers, strings, None, and lists or tuples of those)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(plain(item) for item in value)


def restore_cache(
    cache: KVCompressCache, layers: list[dict[str, Any]], tensors: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Put a saved state into ``cache``, a fresh cache of the same method for the same model."""
    if len(layers) != len(cache.layers):
        raise CacheFileError(f"the file holds {len(layers)} layers, this model has {len(cache.layers)}")
    for index, (layer, saved) in enumerate(zip(cache.layers, layers)):
        if saved["class"] != layer.kind:
            raise CacheFileError(f"layer {index} was saved as a {saved['class']}, this method makes a {layer.kind}")
        prefix = f"layers.{index}."
        state = {
            **saved["values"],
            **{key[len(prefix) :]: tensor for key, tensor in tensors.items() if key.startswith(prefix)},
        }
        held.load(layer, state, device)


def to_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
