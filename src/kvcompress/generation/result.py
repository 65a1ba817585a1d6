"""A conversation over a compressed cache: what ``generate`` returns, and how it is saved and loaded.

``Result.save(path)`` writes one safetensors file: every tensor the cache holds on the device (and
the offload store of ShadowKV or Quest with ``offload=True``), the conversation's mask and positions,
and as metadata the format version, the method and its settings, a fingerprint of the model's
config and weights, each layer's other state and the conversation itself (messages, transcript,
tokens); a conversation asked over a stored context (``Result.store``) holds that context too.
``load(path, model, tokenizer)`` makes a fresh cache of that method for ``model``, puts the saved
state into it and returns a ``Result`` that ``generate(..., past=...)`` continues exactly as the one
it was saved from. A file from another model, another format version, a method not registered
here, or a damaged or truncated file is refused with ``CacheFileError``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.kv_cache import KVCompressCache
from ..cache.tokens import TokenSpans
from ..io.saved import CacheFileError, cache_state, model_fingerprint, restore_cache, to_json
from ..io.version import package_version
from ..methods import METHODS, Method, field_specs

FORMAT, VERSION = "kvcompress-cache", 3  # the version changes only when docs/file-format.md does
# version 4: version 3 plus a conversation's stored context (header "store", rows' "store_row"), written only by a
# file that holds one, so a kvcompress that reads 3 refuses it by version and still reads every other file
STORE_VERSION = 4
READS = (2, 3, 4)  # version 2: the same entries without codecs, and no checksum (loaded unchecked, with a warning)


STORE_PREFIX = "store."  # a conversation's stored context: its entries under this prefix, its header under "store"


class UncheckedFileWarning(UserWarning):
    """A saved file that carries no checksum (format version 2) was loaded without one."""


Messages = list[dict[str, str]]


@dataclass
class Row:
    """One conversation of a batch: what was said, and what the cache has not seen yet."""

    chat: bool
    messages: Messages = field(default_factory=list)  # chat rows: the conversation so far
    transcript: str = ""  # everything fed, as text (used to continue raw-text rows)
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # last sampled token, not yet fed to the cache
    open_turn: bool = False  # the last user message (a compressed context) waits for its question
    store_row: int | None = None  # the row of the stored context (``Result.store``) this conversation is asked over


@dataclass
class Result:
    """What ``generate`` returns: ``text`` (a list for a batch), ``stats`` and the live ``cache``."""

    text: str | list[str]
    stats: dict[str, Any]
    cache: KVCompressCache
    token_ids: list[list[int]]
    rows: list[Row]
    attention_mask: torch.Tensor  # [batch, logical length] of everything fed so far
    next_position: torch.Tensor  # [batch] RoPE position of each row's next real token
    # the stored context this conversation's turns are asked over (read, never written): a follow-up with a
    # method is compressed with the whole conversation over it
    store: Result | None = None

    @property
    def method(self) -> Method:
        """The method this conversation's cache applies (the cache knows it as its ``LayerFactory``)."""
        return cast(Method, self.cache.method)

    def question_store(self) -> Result | None:
        """The stored context a new question over this result is compressed with: its conversation's ``store``, or
        the result itself when it is a stored context waiting for its question that keeps its prompt's tokens
        (``cache.storable()``); None when a question can only continue its cache."""
        if self.store is not None:
            return self.store
        if all(row.open_turn for row in self.rows) and self.cache.storable():
            return self
        return None

    def save(self, path: str | Path) -> None:
        """Write this conversation and its cache to ``path`` (see the module docstring); the model is
        the one the cache was made for. An existing file is replaced whole (never left half
        written); the file's mode follows the umask, as any new file's does."""
        model = _made_for(self.cache, "save")
        target = Path(path)
        if not target.parent.is_dir():
            raise FileNotFoundError(f"cannot save to {target}: the folder {target.parent} does not exist")
        tensors, conversation = _entries(self)
        if self.store is not None:  # the stored context the turns are asked over, its entries under "store."
            stored, conversation["store"] = _entries(self.store)
            tensors.update({f"{STORE_PREFIX}{key}": tensor for key, tensor in stored.items()})
        meta = {
            "format": FORMAT,
            "version": VERSION if self.store is None else STORE_VERSION,
            "written_by": f"kvcompress {package_version()}",
            "model": model_fingerprint(model),
            "model_name": model_name(model),
            **conversation,
            "checksum": {"algorithm": "sha256", "digest": tensor_digest(tensors)},
        }
        staging = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            save_file(tensors, str(staging), metadata={FORMAT: to_json(meta)})
            os.chmod(staging, 0o666 & ~_umask())
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)

    def copy(self) -> Result:
        """An independent copy of this conversation and its cache (what ``save`` then ``load`` would
        give, without a file): each question asked of its own copy of one compressed context sees
        none of the others. The stored context it is asked over (``store``), never written, is shared."""
        model = _made_for(self.cache, "copy")
        tensors, layers = cache_state(self.cache)
        cache = _rebuilt(
            self.method, model, self.cache.span_table, layers, {key: t.clone() for key, t in tensors.items()}
        )
        cache.embeds_itself, cache.timings, cache.observe_s = (
            self.cache.embeds_itself,
            dict(self.cache.timings),
            self.cache.observe_s,
        )
        return Result(
            text=copy.deepcopy(self.text),
            stats=dict(self.stats),
            cache=cache,
            token_ids=copy.deepcopy(self.token_ids),
            rows=copy.deepcopy(self.rows),
            attention_mask=self.attention_mask.clone(),
            next_position=self.next_position.clone(),
            store=self.store,
        )


def _made_for(cache: KVCompressCache, doing: str) -> PreTrainedModel:
    """The model ``cache`` was made for (held weakly), or a refusal to go on ``doing`` without it."""
    model = cache.model()
    if model is None:
        raise CacheFileError(f"the model this cache was made for is gone; {doing} while it is loaded")
    return cast(PreTrainedModel, model)


def _entries(result: Result) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A conversation's tensors (its cache's, its mask and positions) and its metadata (the method, the layers'
    plain values, the conversation itself), as a file holds them (docs/file-format.md)."""
    tensors, layers = cache_state(result.cache)
    tensors["conversation.attention_mask"] = result.attention_mask.bool().cpu()  # one byte per token fed
    tensors["conversation.next_position"] = result.next_position.cpu()
    method = result.method
    return tensors, {
        "method": {
            "name": method.name,
            "fields": {spec.name: getattr(method, spec.name) for spec in field_specs(type(method))},
        },
        "layers": layers,
        "rows": [{k: v for k, v in asdict(row).items() if k != "store_row" or v is not None} for row in result.rows],
        "text": result.text,
        "token_ids": result.token_ids,
        "stats": result.stats,
        "embeds_itself": result.cache.embeds_itself,
        "observe_s": result.cache.observe_s,
    }


def _restored(
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
) -> Result:
    """The conversation ``_entries`` wrote, its cache rebuilt for ``model`` (a stored context in host memory)."""
    cache = _rebuilt(_method(meta), model, tokenizer, meta["layers"], tensors)
    cache.embeds_itself, cache.observe_s = meta["embeds_itself"], meta.get("observe_s", 0.0)
    cache.timings = {key: meta["stats"].get(key) for key in cache.timings}
    cache.hold_in_host()  # a stored context loads into host memory, as compress() leaves it
    return Result(
        text=meta["text"],
        stats=meta["stats"],
        cache=cache,
        token_ids=meta["token_ids"],
        rows=[Row(**row) for row in meta["rows"]],
        attention_mask=tensors["conversation.attention_mask"].long().to(model.device),
        next_position=tensors["conversation.next_position"].to(model.device),
    )


def _rebuilt(
    method: Method,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | TokenSpans | None,
    layers: list[dict[str, Any]],
    tensors: dict[str, torch.Tensor],
) -> KVCompressCache:
    """A fresh cache of ``method`` for ``model`` holding a saved state."""
    cache = method.make_cache(model, tokenizer)
    restore_cache(cache, layers, tensors, model.device)
    return cache


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_header(path: str | Path) -> dict[str, Any]:
    """The metadata of a saved conversation (format, model fingerprint, method, conversation), read
    without its tensors; ``CacheFileError`` when ``path`` is not a kvcompress cache file of this version."""
    if Path(path).is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a kvcompress cache file (.kvc)")
    try:
        with safe_open(str(path), framework="pt") as file:
            meta = json.loads((file.metadata() or {})[FORMAT])
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except Exception as error:  # noqa: BLE001 - a damaged file fails in many ways; each is this one error
        raise CacheFileError(f"{path} is not a whole kvcompress cache file ({type(error).__name__}: {error})") from None
    if meta.get("format") != FORMAT:
        raise CacheFileError(f"{path} is not a kvcompress cache file (its format is {meta.get('format')!r})")
    if meta.get("version") not in READS:
        writer = meta.get("written_by", "an earlier kvcompress")
        versions = f"{', '.join(map(str, READS[:-1]))} and {READS[-1]}"
        raise CacheFileError(
            f"{path} is in kvcompress cache format version {meta.get('version')} (written by {writer}); this "
            f"kvcompress {package_version()} reads versions {versions}: compress the document again with this version"
        )
    name = meta["method"]["name"]
    if name not in METHODS:
        raise CacheFileError(
            f"{path} was made with method {name!r}, which is not registered here (register it with kvc.register_method "
            "first)"
        )
    return meta


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor in name order: its name, dtype, shape and bytes (docs/file-format.md)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)};".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]  # (a buffer)
    return digest.hexdigest()


def check_digest(path: str | Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a file whose tensors are not the ones its header's checksum was computed over (a version 2 file,
    which carries none, is loaded unchecked, with an ``UncheckedFileWarning``)."""
    checksum = meta.get("checksum")
    if checksum is None:
        warnings.warn(
            f"{path} carries no checksum (format version {meta.get('version')}): its tensors are loaded "
            "unchecked; save it again to add one",
            UncheckedFileWarning,
            stacklevel=3,
        )
        return
    if tensor_digest(tensors) != checksum["digest"]:
        raise CacheFileError(
            f"{path} is damaged: its tensors do not match the checksum in its header (sha256); "
            "compress the document again or restore the file from a copy"
        )


def saved_method(path: str | Path) -> Method:
    """The method (with its settings) that compressed the conversation saved at ``path``."""
    return _method(read_header(path))


def _method(meta: dict[str, Any]) -> Method:
    """The method a file's metadata names, with its settings (a setting the file predates: what it meant then)."""
    cls = METHODS[meta["method"]["name"]]
    return cls(**{**cls.unrecorded_meant, **meta["method"]["fields"]})


def model_name(model: PreTrainedModel) -> str:
    """A model as a user would load it again: its class and the folder or name it was loaded from."""
    source = getattr(model.config, "_name_or_path", "")
    return f"{type(model).__name__} from {source}" if source else type(model).__name__


def load(path: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> Result:
    """The conversation saved at ``path``, its cache rebuilt for ``model`` (which must be the model it
    was saved from), ready to continue with ``generate(model, tokenizer, prompt, past=...)``."""
    meta = read_header(path)
    if meta["model"] != model_fingerprint(model):
        made = f" ({meta['model_name']})" if meta.get("model_name") else ""  # (files before 11-29 do not name it)
        raise CacheFileError(
            f"{path} was saved from another model{made} (fingerprint {meta['model']}, this {model_name(model)}: "
            f"{model_fingerprint(model)}); load it into the model it was made with"
        )
    try:
        with safe_open(str(path), framework="pt") as file:
            tensors = {key: file.get_tensor(key) for key in file.keys()}
    except Exception as error:  # noqa: BLE001 - as in read_header
        raise CacheFileError(f"{path} is not a whole kvcompress cache file ({type(error).__name__}: {error})") from None
    check_digest(path, meta, tensors)
    own = {key: tensor for key, tensor in tensors.items() if not key.startswith(STORE_PREFIX)}
    result = _restored(meta, own, model, tokenizer)
    if "store" in meta:
        stored = {key[len(STORE_PREFIX) :]: t for key, t in tensors.items() if key.startswith(STORE_PREFIX)}
        result.store = _restored(meta["store"], stored, model, tokenizer)
    return result
