"""SnapKV inside vLLM (a prototype on vLLM's CPU build): prefill-time eviction whose freed KV blocks
go back to vLLM's block pool. Design and measurements: docs/vllm.md.

Each piece goes through an extension point vLLM offers (nothing of vLLM is patched or forked):

* ``register`` (a ``vllm.general_plugins`` entry point, run in every vLLM process) points vLLM's
  ``CPU_ATTN`` attention backend at ``SnapKVCPUBackend``, and adds a PyTorch forward pre-hook that
  notes each step's token ids as they enter the vocabulary embedding, so SnapKV keeps words and
  numbers whole as kvcompress does (``clustering="spans"``).
* ``SnapKVCPUBackend`` (the attention backend): right after a request's prefill attention, each
  layer scores the prompt with SnapKV (kvcompress's own functions) and rewrites, per KV head, the
  kept tokens into the request's first ``budget`` cache slots. From then on its metadata builder
  maps the request's new tokens to the slots right after them, and its attention reads only those
  slots: RoPE positions stay the logical ones, slots become the compressed ones.
* ``SnapKVScheduler`` (``scheduler_cls``): once a request's prefill is done, its KV blocks beyond
  what the compressed request needs are freed (replaced by vLLM's null block, as vLLM does for
  sliding windows), so more requests fit in the pool.

Settings come from ``additional_config={"kvcompress": {"budget": 256, "window": 32, "kernel": 7,
"pooling": "max", "clustering": "spans"}}`` (any SnapKV field). Requirements of the prototype: a prompt's prefill in one step (no chunked
prefill), no prefix caching, no speculative decoding, full-attention models.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from transformers import AutoTokenizer
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.core.sched.scheduler import Scheduler

from .methods import SnapKV
from .methods.prompt import select_kept
from .tokens import spans_for

SETTINGS_KEY = "kvcompress"


STEP_TOKEN_IDS: list[torch.Tensor | None] = [None]  # the token ids of the step being run (this process)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: use the SnapKV backend where vLLM uses CPU_ATTN, and
    note each step's token ids as they enter the model's embedding."""
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.SnapKVCPUBackend")
    register_module_forward_pre_hook(note_token_ids)


def note_token_ids(module: torch.nn.Module, args: tuple) -> None:
    """A global forward pre-hook: the integer input of a vocabulary embedding is the step's token ids."""
    if isinstance(module, VocabParallelEmbedding) and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        STEP_TOKEN_IDS[0] = args[0]


def method(vllm_config: Any = None) -> SnapKV:
    """The SnapKV settings of this vLLM instance; refuses the settings the prototype cannot serve."""
    config = vllm_config or get_current_vllm_config()
    refusals = (
        (config.scheduler_config.enable_chunked_prefill, "enable_chunked_prefill=False (a prompt's prefill must run in one step)"),
        (config.cache_config.enable_prefix_caching, "enable_prefix_caching=False (compressed blocks no longer hold what their hash says)"),
        (config.speculative_config is not None, "no speculative decoding"),
    )
    for refused, what in refusals:
        if refused:
            raise ValueError(f"kvcompress: SnapKV in vLLM needs {what}")
    return SnapKV(**dict((config.additional_config or {}).get(SETTINGS_KEY, {})))


# Per worker process: the first KV block of a compressed request -> (prompt tokens, kept tokens). A
# request's first block is its own while it lives; a new request starting on it resets the entry.
COMPRESSED: dict[int, tuple[int, int]] = {}
# The same key -> layer name -> the prompt positions each KV head kept ``[kv_heads, kept]`` (as
# ``KVCompressCache.kept_positions``), for checks against kvcompress's own cache.
KEPT_POSITIONS: dict[int, dict[str, torch.Tensor]] = {}


class SnapKVCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """Maps compressed requests' tokens to their compressed slots before vLLM's metadata is built."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        common = common_attn_metadata
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens.clone()
        slots = common.slot_mapping.clone()
        changed = False
        for row in range(common.num_reqs):
            first = int(common.block_table_tensor[row, 0])
            queries, seen = starts[row + 1] - starts[row], int(seq_lens[row])
            if queries == seen:  # a fresh prefill: whatever was compressed on this block before is gone
                COMPRESSED.pop(first, None)
                KEPT_POSITIONS.pop(first, None)
                continue
            if first not in COMPRESSED:
                continue
            prompt, kept = COMPRESSED[first]
            physical = kept + (seen - prompt) - queries + torch.arange(queries)  # where this row's new tokens go
            blocks = common.block_table_tensor[row, physical // self.block_size].to(slots.dtype)
            slots[starts[row] : starts[row + 1]] = blocks * self.block_size + physical % self.block_size
            seq_lens[row] = kept + (seen - prompt)
            changed = True
        if changed:
            common = dataclasses.replace(common, seq_lens=seq_lens, slot_mapping=slots, max_seq_len=int(seq_lens.max()))
        return super().build(common_prefix_len, common, fast_build)


class SnapKVCPUImpl(CPUAttentionBackendImpl):
    """CPU attention that compresses each fresh prefill at the end of its attention (SnapKV)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = get_current_vllm_config()
        self.method = method(config)
        self.spans = spans_for(AutoTokenizer.from_pretrained(config.model_config.tokenizer)) if self.method.needs_tokens() else None

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(layer.layer_name) if isinstance(metadata, dict) else None
        if metadata is not None:  # our builder's slots: compressed requests write after their kept tokens
            slot_mapping = metadata.slot_mapping[: slot_mapping.shape[0]]
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: Any = None, output_block_scale: Any = None) -> torch.Tensor:
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None or kv_cache.numel() == 0:
            return output
        starts = attn_metadata.query_start_loc.tolist()
        for row in range(len(starts) - 1):
            length = starts[row + 1] - starts[row]
            if length == int(attn_metadata.seq_lens[row]) and length > self.method.budget_tokens:
                rows = slice(starts[row], starts[row + 1])
                self.compress(layer, query[rows], key[rows], value[rows], kv_cache, attn_metadata.block_table[row], self.step_spans(rows))
        return output

    def step_spans(self, rows: slice) -> torch.Tensor | None:
        """The word and number spans of one request's prompt in this step ``[1, tokens]``, if noted."""
        if self.spans is None:
            return None
        ids = STEP_TOKEN_IDS[0]
        if ids is None:
            raise ValueError("kvcompress: SnapKV(clustering='spans') needs the prompt's token ids, and this model took embeddings; "
                             "use additional_config {'kvcompress': {'clustering': 'pool'}}")
        return self.spans.span_ids(ids[rows][None].cpu())

    def compress(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor,
                 spans: torch.Tensor | None) -> None:
        """One request's prompt ``[tokens, heads, dim]``: keep each KV head's SnapKV tokens in its first slots."""
        length = key.shape[0]
        valid = torch.ones(1, length, dtype=torch.bool)
        scores = self.method.scores(query.transpose(0, 1)[None], key.transpose(0, 1)[None], valid, self.scale, spans)
        counts = self.method.keep_counts(torch.tensor([length]))
        kept, _ = select_kept(scores, valid, counts)  # [1, kv_heads, n], ascending per head
        heads = torch.arange(key.shape[1])[None, :]
        order = kept[0].T  # slot s of head h holds token order[s, h]
        block_size = kv_cache.shape[2]
        slots = torch.arange(order.shape[0])
        slot_mapping = blocks[slots // block_size].to(torch.long) * block_size + slots % block_size
        super().do_kv_cache_update(layer, key[order, heads], value[order, heads], kv_cache, slot_mapping)
        COMPRESSED[int(blocks[0])] = (length, order.shape[0])
        KEPT_POSITIONS.setdefault(int(blocks[0]), {})[layer.layer_name] = kept[0]


class SnapKVCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[SnapKVCPUImpl]:
        return SnapKVCPUImpl

    @staticmethod
    def get_builder_cls() -> type[SnapKVCPUMetadataBuilder]:
        return SnapKVCPUMetadataBuilder


class SnapKVScheduler(Scheduler):
    """vLLM's scheduler, freeing the KV blocks a request no longer needs once SnapKV compressed its prompt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.method = method(self.vllm_config)
        self.blocks_before_after: dict[str, tuple[int, int]] = {}  # request -> KV blocks in use before / after
        self.peak_running = 0  # the most requests running at once

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self.peak_running = max(self.peak_running, len(self.running))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self.running:
            if request.num_computed_tokens >= request.num_prompt_tokens:
                self.shrink(request)
        return outputs

    def shrink(self, request: Any) -> None:
        """Free the blocks past the compressed prompt plus room for every token the request may
        generate. Called after every step: it also frees the blocks vLLM adds for the request's later
        logical positions (its tokens go right after the kept ones instead), and it compresses again
        after a preempted request is recomputed."""
        if request.num_prompt_tokens <= self.method.budget_tokens:
            return
        before = after = 0
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request.request_id, [])
            in_use = lambda: sum(block is not manager._null_block for block in blocks)  # noqa: E731
            before += in_use()
            keep = math.ceil((self.method.budget_tokens + request.max_tokens) / manager.block_size)
            manager._remove_blocks_in_range(request.request_id, keep, len(blocks))
            after += in_use()
        self.blocks_before_after.setdefault(request.request_id, (before, after))  # the first compression
