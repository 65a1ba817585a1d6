"""Where a layer's keys and values live: one small interface, one class per layout.

A cache layer (cache/layer.py) holds one ``Slots`` object and drives it; the storage knows no method. Every
layout keeps the layer's lengths, the one place they live: the device-side write position and
validity are the truth a step reads (``write`` at the position, ``close_step`` moves it), and
``seen`` (tokens fed, padding included: the layer's length to transformers) and ``used`` (slots
holding tokens) are host mirrors that describe the cache before a step until it commits, then move
in ``advance``, eager or compiled alike (a compiled step reads none of them). The layouts:

* ``dense.DenseSlots``: ``[batch, kv_heads, slots, head_dim]`` buffers with spare room at the end; the
  prompt is held as the prefill computed it until the first later step moves it into buffers of a
  fixed capacity, after which a step writes at ``cursor`` (a device tensor) and keeps every shape.
* ``ring.RingSlots``: a sliding window's ring (the token of logical index ``t`` in slot ``t % capacity``).
* ``capped.CappedSlots``: dense slots that hold at most ``limit`` tokens after each step (a layer that
  evicts while decoding keeps its best at the front), with per-slot annotations moved along.
* ``capped.BoundedSlots``: dense slots whose buffers never grow past ``limit`` while decoding; the layer
  compacts what it re-selects to the front, in place (a decoding bound for every prompt method).
* ``packed.PackedSlots``: one segment per (row, KV head), each with its own length.

An offload store of chunks (``offload.ChunkStore``) is held beside a layer's slots, not instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch

from .codec import KVCodec


def spare_slots(slots: int) -> int:
    """Room a slot buffer gets beyond ``slots`` when it grows: ~6%, at least 16 and at most 1024 slots."""
    return min(1024, max(16, slots // 16))


def capacity_bucket(slots: int) -> int:
    """The capacity a compiled decoding step's buffer of ``slots`` slots takes: the next power of two
    (at least 64), so requests of other lengths in the same bucket reuse the compiled step."""
    return 1 << max(6, (slots - 1).bit_length())


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` moved to ``device`` if it is a tensor (a saved state's entries: tensors or plain values)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def nested(prefix: str, state: dict[str, Any] | None) -> dict[str, Any]:
    """An object's saved state inside its holder's, its names under ``prefix.`` (None: ``prefix`` is None)."""
    return {prefix: None} if state is None else {f"{prefix}.{name}": value for name, value in state.items()}


def held_state(held: Any) -> dict[str, Any] | None:
    """The saved state of an object a layer holds (None where it holds none)."""
    return None if held is None else held.state_dict()


def inner(state: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    """The entries ``nested`` put under ``prefix``, without it (None where the object was None)."""
    if state.get(prefix, "") is None:
        return None
    return {name[len(prefix) + 1 :]: value for name, value in state.items() if name.startswith(prefix + ".")}


class SlotView(NamedTuple):
    """What a layer's attention and its callers see of the slots, whatever the layout."""

    keys: torch.Tensor  # [b, h, slots, d] handed to attention (a layout that attends itself: no slots)
    values: torch.Tensor
    valid: torch.Tensor | None  # [b, slots]; None while every slot is real
    positions: torch.Tensor | None  # [b, h, prompt slots]: prompt positions held (None: slot order)
    cursor: torch.Tensor | None  # [1] on the device: the slot of the next token (None: no step yet)


class Slots:
    """The storage interface a layer drives (see the module docstring)."""

    NAME: ClassVar[str] = ""  # the prefix of the layout's own saved entries, for layouts a layer swaps to

    seen: int  # tokens fed, padding included
    used: int  # slots holding tokens (per row and KV head: the longest)
    codec: KVCodec | None = None  # how tokens are stored from ``encode_with`` on (None: as the model computed them)

    def view(self, decoded: bool = True) -> SlotView:
        """The attend-ready views (``decoded=False``: keys and values as stored, coded rows where a codec writes
        them: for shapes and validity, without decoding every token)."""
        raise NotImplementedError

    def encode_with(self, codec: KVCodec) -> None:
        """Store the held tokens, and every later one, with ``codec`` (codec.py)."""
        raise NotImplementedError

    def reads_codes(self, new_keys: torch.Tensor) -> bool:
        """Whether ``attend`` reads this step's slots as stored, so a step of ``new_keys`` may hand the coded rows
        on instead of decoding them (``view(decoded=False)``)."""
        raise NotImplementedError

    def make_room(self, new: int) -> None:
        """Room for a step of ``new`` tokens (the buffers move only when the room runs out)."""
        raise NotImplementedError

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        """Room for ``tokens`` more tokens now; ``buckets``: a capacity other requests share (``capacity_bucket``)."""
        raise NotImplementedError

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a step's tokens at the device-side position (valid until ``mark_padding`` says otherwise)."""
        raise NotImplementedError

    def mark_padding(self, valid: torch.Tensor) -> None:
        """The validity ``[b, q]`` of this step's tokens."""
        raise NotImplementedError

    def close_step(self, new: int) -> None:
        """Move the device-side position past this step's ``new`` tokens."""
        raise NotImplementedError

    def advance(self, new: int) -> None:
        """The host mirrors after a step of ``new`` tokens."""
        raise NotImplementedError

    def visibility(
        self, new_block: torch.Tensor | None, q_len: int, new_valid: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The mask a later step's queries attend with (``new_block``: the new tokens among themselves; ``new_valid
        [b, q]``: which of them are real, None: all)."""
        raise NotImplementedError

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` over the slots (``keys``/``values``: the view, as ``update`` returned it)."""
        raise NotImplementedError

    def kept_positions(self, prefill_len: int) -> torch.Tensor:
        """Prompt positions held ``[b, h, n]`` ascending per head (-1: filler); the prompt is ``prefill_len`` slots."""
        raise NotImplementedError

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """The held tokens as a context a later prompt continues without writing to them: keys, values
        ``[b, h, n, d]``, validity ``[b, n]`` and prompt positions ``[b, h, n]`` (None: tokens in order);
        None where the layout cannot be read as one (a ring, packed segments)."""
        raise NotImplementedError

    def memory(self, full_tokens: int) -> dict[str, int]:
        """Bytes: ``kv_tokens``, ``kv_bytes_full`` (``full_tokens`` per head), ``kv_bytes_kept``, ``spare_bytes``,
        ``index_bytes``, ``bytes_read_per_step`` (a step reads every slot, room included)."""
        raise NotImplementedError

    def batch_apply(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A batch operation (select, repeat, reorder rows) on every tensor with the batch first."""
        raise NotImplementedError

    def joined(self, others: list[Slots]) -> Slots:
        """These rows, then ``others``' (groups of one batch, compressed, not decoded yet), as one storage."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The layout's saved entries (docs/file-format.md)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Put ``state`` (``state_dict``'s entries in host memory) into this fresh storage on ``device``."""
        raise NotImplementedError


def store_coded(slots: Slots, codec: KVCodec | None) -> None:
    """From compression on, the held tokens and every later one stored with ``codec`` (None: as computed); a storage
    already coded (loaded, or continued) keeps its codes."""
    if codec is not None and slots.codec is None:
        slots.encode_with(codec)
