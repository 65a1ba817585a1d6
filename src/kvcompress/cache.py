"""The transformers ``Cache`` that applies a kvcompress method.

Each layer stores keys/values ``[batch, kv_heads, slots, head_dim]`` with exactly the slots it keeps
(per-KV-head selection, no repeated heads), plus a per-row slot validity ``[batch, slots]`` when a
batch mixes prompt lengths. The first time a layer is filled (the prefill) it holds the full
prompt for the duration of that layer's attention; right after it, ``commit`` compresses it
(see hooks.py), so at most one layer holds a full prompt cache at a time.

``get_seq_length`` reports the *logical* length (prompt + tokens appended, padding included), so
transformers keeps assigning RoPE positions and slicing generate inputs from the true prompt length,
not the compressed one.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer


if TYPE_CHECKING:
    from .methods.base import Method


class UnsupportedModelError(ValueError):
    """The model's architecture cannot be used with kvcompress."""


_announced = threading.local()


def take_announced() -> tuple[CompressedLayer | None, torch.Tensor | None]:
    """The layer (and the keys it returned) whose ``update`` ran last in this thread, then forget it.

    Attention modules call ``cache.update`` right before their attention function, so this is how
    the attention function (hooks.py) finds the cache layer it is working for."""
    layer, keys = getattr(_announced, "layer", None), getattr(_announced, "keys", None)
    _announced.layer = _announced.keys = None
    return layer, keys


def prompt_positions(valid: torch.Tensor) -> torch.Tensor:
    """Each slot's position inside its row's real prompt ``[batch, slots]``; -1 for padding."""
    return (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host-memory copy, pinned when it comes from a GPU (so the GPU can read it directly)."""
    if not tensor.is_cuda:
        return tensor.contiguous()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


class CompressedLayer(DynamicLayer):
    """One layer's compressed KV storage."""

    def __init__(self, method: Method, layer_idx: int) -> None:
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.seen_tokens = 0
        self.prefill_len: int | None = None  # slots of the first fill (padded prompt), set at prefill
        self.prompt_tokens: torch.Tensor | None = None  # real prompt length per row, set at prefill
        self.valid: torch.Tensor | None = None  # [batch, slots]; None when every slot is real
        self.positions: torch.Tensor | None = None  # [batch, kv_heads, prompt slots] after compression
        self.awaiting_commit = False
        self.new_tokens = 0  # tokens added by the last update
        self.compress_s = 0.0  # time spent compressing at the end of prefill
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # keys/values with spare slots, once decoding

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.awaiting_commit:
            raise UnsupportedModelError(
                f"kvcompress: layer {self.layer_idx} was updated twice without its attention running through the "
                "'kvcompress' attention implementation; the model's attention layout is not supported "
                "(was attn_implementation changed after make_cache?)"
            )
        keys, values = self._append(key_states, value_states)
        self.seen_tokens += key_states.shape[-2]
        self.new_tokens = key_states.shape[-2]
        self.awaiting_commit = True
        _announced.layer, _announced.keys = self, keys
        return keys, values

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append slots. After the first fill they live at the front of buffers with spare room, so a
        decoding step writes its token instead of copying the whole cache (as ``torch.cat`` would);
        the buffers are copied once per ``spare_slots`` tokens."""
        if not self.is_initialized or self.keys.dim() < 4 or self.keys.shape[-2] == 0:
            return super().update(key_states, value_states)
        used, total = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if not self._in_buffers(total):
            capacity = total + spare_slots(total)
            self.buffers = tuple(t.new_empty(*t.shape[:2], capacity, t.shape[-1]) for t in (self.keys, self.values))
            for buffer, held in zip(self.buffers, (self.keys, self.values)):
                buffer[:, :, :used].copy_(held)
        for buffer, new in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, used:total].copy_(new)
        self.keys, self.values = (buffer[:, :, :total] for buffer in self.buffers)
        return self.keys, self.values

    def _in_buffers(self, slots: int) -> bool:
        """Whether keys/values are the leading slots of ``buffers`` and those hold ``slots`` slots
        (methods that rewrite their slots, e.g. by compressing, leave the buffers behind)."""
        if self.buffers is None or self.buffers[0].shape[-2] < slots:
            return False
        return all(
            held.data_ptr() == buffer.data_ptr() and held.shape[:2] == buffer.shape[:2] and held.stride() == buffer.stride()
            for held, buffer in zip((self.keys, self.values), self.buffers)
        )

    def slot_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors that hold this layer's key/value slots: the buffers (spare room included) or keys/values."""
        return self.buffers if self._in_buffers(self.keys.shape[-2]) else (self.keys, self.values)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask transformers builds covers logical positions; hooks.py keeps only its newest columns.
        return self.seen_tokens + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvcompress caches cannot be cropped (assisted/speculative decoding is unsupported)")

    def load_prefill(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, query_tail: torch.Tensor, scaling: float) -> None:
        """Fill this empty layer with a prompt prefilled elsewhere (``kvcompress.prefill``), then apply
        the method as if the prefill had run here. ``query_tail``: the last prefill queries."""
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.seen_tokens = keys, values, keys.shape[-2]
        self.new_tokens = keys.shape[-2]
        self.commit(query_tail, valid, scaling)

    @property
    def is_prefill(self) -> bool:
        """True while the layer holds only its first fill (the prompt), before compression."""
        return self.prefill_len is None

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of ``query`` over this layer's slots (``keys``/``values`` as ``update`` returned them)."""
        return dense_attention(query, keys, values, mask, scaling)

    def slot_validity(self) -> torch.Tensor:
        """``[batch, slots]`` bool, True for real tokens."""
        if self.valid is not None:
            return self.valid
        return torch.ones(self.keys.shape[0], self.keys.shape[-2], dtype=torch.bool, device=self.keys.device)

    def commit(self, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float) -> None:
        """Record which new tokens are real; on the first fill, apply the method (compression)."""
        self.awaiting_commit = False
        # After the prefill, record the new tokens' validity without asking the device whether all
        # are real: that question would synchronize every layer at every decoding step.
        if new_valid is not None and (not self.is_prefill or not bool(new_valid.all())):
            old = self.slot_validity()[:, : self.keys.shape[-2] - new_valid.shape[-1]]
            self.valid = torch.cat([old, new_valid], dim=-1)
        elif self.valid is not None:
            self.valid = torch.nn.functional.pad(self.valid, (0, self.new_tokens), value=True)
        if self.is_prefill:
            valid = self.slot_validity()
            if self.valid is not None and bool((valid[:, :-1] & ~valid[:, 1:]).any()):
                raise ValueError(
                    "kvcompress needs left-padded batches (padding before each prompt, as tokenizer.padding_side='left' "
                    "gives); this batch has padding after real tokens"
                )
            self.prefill_len = self.keys.shape[-2]
            self.prompt_tokens = valid.sum(dim=-1)
            _sync(self.keys)
            start = time.perf_counter()
            self._compress_prompt(query, scaling)
            _sync(self.keys)
            self.compress_s = time.perf_counter() - start

    def _compress_prompt(self, query: torch.Tensor, scaling: float) -> None:
        from .methods.base import select_kept

        valid = self.slot_validity()
        lengths = self.prompt_tokens
        counts = self.method.keep_counts(lengths)
        if counts is None or bool((counts >= lengths).all()):
            return
        indices, slot_valid = select_kept(self.prompt_scores(query, valid, scaling), valid, counts)
        gather = indices[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather)
        kept = prompt_positions(valid)[:, None, :].expand(-1, indices.shape[1], -1).gather(2, indices)
        self.positions = kept.masked_fill(~slot_valid[:, None, :], -1)
        self.valid = None if bool(slot_valid.all()) else slot_valid

    def prompt_scores(self, query: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
        """The method's importance of each prompt slot ``[batch, kv_heads, seq]``."""
        return self.method.scores(query, self.keys, valid, scaling)

    def kept_positions(self) -> torch.Tensor:
        """Prompt positions held, ``[batch, kv_heads, prompt slots]`` ascending; -1 marks filler slots
        of rows (in a batch) that keep fewer tokens than the longest row."""
        if self.positions is not None:
            return self.positions
        valid = self.slot_validity()[:, : self.prefill_len]
        return prompt_positions(valid)[:, None, :].expand(-1, self.keys.shape[1], -1)

    def extra_stats(self, layers: list[CompressedLayer]) -> dict:
        """Method-specific stats over all ``layers`` (called on the first one)."""
        return {}

    def bytes_read_per_step(self) -> int:
        """KV bytes one decoding step reads (every held key and value)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def tensor_bytes(self) -> int:
        """Bytes of every tensor this layer holds."""
        held = [*self.slot_tensors(), self.valid, self.positions]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.buffers = None
        for name in ("keys", "values", "valid", "positions", "prompt_tokens"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, indices.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.buffers = None
        for name in ("keys", "values", "valid", "positions", "prompt_tokens"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.repeat_interleave(repeats, dim=0))


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Exact SDPA, ``[b, q_heads, q, d]``; KV heads are shared by query-head groups without copies.

    ``mask`` is boolean, ``[b, 1 or kv_heads or q_heads, q, kv]``; None means causal over the
    last ``q`` slots (or no mask for one query)."""
    q_heads, kv_heads = query.shape[1], keys.shape[1]
    if mask is not None and 1 < mask.shape[1] < q_heads:
        mask = mask.repeat_interleave(q_heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None and query.shape[-2] > 1,
        scale=scaling,
        enable_gqa=q_heads != kv_heads,
    )


def causal_slot_mask(q_len: int, slots: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q_len, slots]``: the newest ``q_len`` slots are the queries, each sees itself and all before."""
    return torch.ones(q_len, slots, dtype=torch.bool, device=device).tril(slots - q_len)[None, None]


def attend_selected(
    query: torch.Tensor,
    chosen: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Exact attention over per-head chosen prompt tokens (``keys, values, valid [b, h, n]``) followed
    by the layer's dense slots (``keys``/``values`` with their ``mask``; None = causal)."""
    chosen_keys, chosen_values, chosen_valid = chosen
    q_len = query.shape[-2]
    if mask is None:
        mask = causal_slot_mask(q_len, keys.shape[-2], keys.device)
    full_mask = torch.cat([chosen_valid[:, :, None, :].expand(-1, -1, q_len, -1), mask.expand(keys.shape[0], keys.shape[1], -1, -1)], dim=-1)
    return dense_attention(query, torch.cat([chosen_keys, keys], dim=2), torch.cat([chosen_values, values], dim=2), full_mask, scaling)


class KVCompressCache(Cache):
    """A ``Cache`` whose layers apply ``method`` at the end of prefill. Use it with ``model.generate``
    (``past_key_values=cache``) or ``kvcompress.generate``."""

    def __init__(self, method: Method, model: PreTrainedModel) -> None:
        layers = model.config.get_text_config().num_hidden_layers
        super().__init__(layers=[method.make_layer(i, model) for i in range(layers)])
        self.method = method
        self.timings: dict[str, float | None] = {"prefill_s": None, "decode_ms_per_token": None}

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """LongTensor ``[batch, kv_heads, n_kept]``: original prompt positions kept by ``layer_idx``."""
        return self.layers[layer_idx].kept_positions()

    def stats(self) -> dict:
        """Sizes (tokens, bytes) of what is held versus what a full cache would hold, plus any
        method-specific fields the layers report (``CompressedLayer.extra_stats``)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            return {"method": self.method.describe(), "prompt_tokens": 0, "new_tokens": 0}
        first = layers[0]
        prompt = first.prompt_tokens.tolist() if first.prompt_tokens is not None else [0]
        batch, kv_heads, _, head_dim = first.keys.shape
        full = sum(2 * batch * kv_heads * layer.seen_tokens * head_dim * layer.keys.element_size() for layer in layers)
        kept = sum(layer.tensor_bytes() for layer in layers)
        return {
            "method": self.method.describe(),
            "prompt_tokens": prompt[0] if batch == 1 else prompt,
            "new_tokens": first.seen_tokens - first.prefill_len,
            "kv_tokens_per_layer": [layer.keys.shape[-2] for layer in layers],
            "kv_bytes_full": full,
            "kv_bytes_kept": kept,
            "kv_kept_fraction": kept / full if full else 1.0,
            "kv_bytes_read_per_step": sum(layer.bytes_read_per_step() for layer in layers),
            "compress_s": sum(layer.compress_s for layer in layers),
            **first.extra_stats(layers),
            **self.timings,
        }


def spare_slots(slots: int) -> int:
    """Room a slot buffer gets beyond ``slots`` when it grows: ~6%, at least 16 and at most 1024 slots."""
    return min(1024, max(16, slots // 16))


def gather_tokens(tensor: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tensor [b, h, s, d]`` at per-head token indices ``[b, h, n]`` -> ``[b, h, n, d]``."""
    return tensor.gather(2, tokens[..., None].expand(-1, -1, -1, tensor.shape[-1]).to(tensor.device))


class SelectiveLayer(CompressedLayer):
    """A layer that drops nothing and attends sparsely while decoding (Quest, Loki).

    After prefill the first ``region`` prompt slots move to a store (on the device, or in host
    memory with ``offload``); the rest stay dense with everything generated later. Each step,
    ``select`` picks region tokens per KV head and attention runs exactly over [selected; dense]."""

    def __init__(self, method: Method, layer_idx: int, offload: bool = False) -> None:
        super().__init__(method, layer_idx)
        self.offload = offload
        self.region_keys: torch.Tensor | None = None
        self.region_values: torch.Tensor | None = None
        self.region_valid: torch.Tensor | None = None  # [b, region]
        self.fetched_bytes = 0
        self.steps = 0

    def region_length(self, seq: int) -> int:
        """How many leading prompt slots are selectable (the rest stay dense)."""
        raise NotImplementedError

    def prepare(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """Build the method's selection index from the region's keys ``[b, h, region, d]``."""
        raise NotImplementedError

    def select(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Region token indices ``[b, kv_heads, n]`` to attend to for these queries."""
        raise NotImplementedError

    def _compress_prompt(self, query: torch.Tensor, scaling: float) -> None:
        region = self.region_length(self.keys.shape[-2])
        if region <= 0:
            return
        valid = self.slot_validity()
        keys, values = self.keys[:, :, :region], self.values[:, :, :region]
        self.prepare(keys, valid[:, :region])
        store = to_host if self.offload else (lambda t: t)
        self.region_keys, self.region_values = store(keys), store(values)
        self.region_valid = valid[:, :region]
        self.keys, self.values = self.keys[:, :, region:], self.values[:, :, region:]
        self.valid = None if self.valid is None else self.valid[:, region:]

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        if self.region_keys is None:
            return super().attend(query, keys, values, mask, scaling)
        tokens = self.select(query, scaling)
        chosen_keys = gather_tokens(self.region_keys, tokens).to(keys.device, non_blocking=True)
        chosen_values = gather_tokens(self.region_values, tokens).to(keys.device, non_blocking=True)
        self.steps += 1
        self.fetched_bytes += (chosen_keys.numel() * chosen_keys.element_size() * 2) if self.offload else 0
        chosen_valid = self.region_valid[:, None, :].expand(-1, tokens.shape[1], -1).gather(2, tokens)
        return attend_selected(query, (chosen_keys, chosen_values, chosen_valid), keys, values, mask, scaling)

    def kept_positions(self) -> torch.Tensor:
        """Every prompt position: nothing is dropped (padding reported as -1)."""
        if self.region_valid is None:
            return super().kept_positions()
        valid = torch.cat([self.region_valid, self.slot_validity()[:, : self.prefill_len - self.region_valid.shape[-1]]], dim=-1)
        return prompt_positions(valid)[:, None, :].expand(-1, self.keys.shape[1], -1)

    def index_tensors(self) -> list[torch.Tensor]:
        """The method's selection index kept on the device (page bounds, projected keys, ...)."""
        return []

    def tensor_bytes(self) -> int:
        held = [*self.slot_tensors(), self.valid, self.region_valid, *self.index_tensors()]
        if not self.offload:
            held += [self.region_keys, self.region_values]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def offloaded_bytes(self) -> int:
        if not self.offload or self.region_keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.region_keys, self.region_values))

    def extra_stats(self, layers: list[CompressedLayer]) -> dict:
        steps = max(1, max(layer.steps for layer in layers))
        return {
            "offloaded_bytes": sum(layer.offloaded_bytes() for layer in layers),
            "fetched_bytes_per_step": sum(layer.fetched_bytes for layer in layers) / steps,
        }
