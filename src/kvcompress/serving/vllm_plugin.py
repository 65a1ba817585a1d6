"""kvcompress inside vLLM (its CPU build): prefill-time eviction whose freed KV blocks go back to
vLLM's block pool, a method per request. Design and measurements: docs/vllm.md.

Each piece goes through an extension point vLLM offers (nothing of vLLM is patched or forked):

* ``register`` (a ``vllm.general_plugins`` entry point, run in every vLLM process) points vLLM's
  ``CPU_ATTN`` attention backend at ``KVCompressCPUBackend``.
* ``RequestSettings`` (an ASGI middleware of vLLM's API server, ``--middleware``): a request's own
  ``kvcompress`` settings are validated by the library (an HTTP 400 naming the field otherwise) and
  handed to the engine in the request's ``vllm_xargs``.
* ``KVCompressConnector`` (a KV connector, ``kv_transfer_config``; it moves no KV): learns each
  request's method when the request arrives and sends the workers, with every step, the method of
  each scheduled request by its first KV block (workers are other processes), and while a request's
  prompt is being prefilled its token ids, so SnapKV keeps words and numbers whole as kvcompress does
  (``clustering="spans"``).
* ``KVCompressScheduler`` (``scheduler_cls``): once a request's prefill is done, frees its KV blocks
  beyond what the compressed request needs (replaced by vLLM's null block, as vLLM does for sliding
  windows), so more requests fit.
* ``KVCompressCPUBackend`` (the attention backend): right after a request's prefill attention, each
  layer scores the prompt with the request's method (kvcompress's own functions) and rewrites, per
  KV head, the kept tokens into the request's first cache slots. From then on its metadata builder
  maps the request's new tokens to the slots right after them, and its attention reads only those
  slots: RoPE positions stay the logical ones, slots become the compressed ones.

The engine's method comes from ``additional_config={"kvcompress": {"method": "snapkv", "budget":
256, ...}}`` (any field of a servable method, ``settings.SERVABLE``); a request may name its own
(``settings.method_of``). ``settings.engine_options`` gives all of it for ``vllm.LLM``. Requirements:
no prefix caching, no speculative decoding, full-attention models (chunked prefill is fine: a
prompt's earlier chunks are held until its last, which compresses the whole prompt).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

import torch
from transformers import AutoTokenizer
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.core.sched.scheduler import Scheduler

from ..cache.tokens import spans_for
from ..integrations.transformers.rope import Rotary, rotary_from_config
from ..methods import SnapKV, method_from_name
from ..methods.base import InvalidParameterError, Method
from ..methods.prompt import PromptMethod, select_kept
from ..storage.attention import scoring_sinks
from ..storage.codec import make_codec
from .settings import ENGINE_ENV, FIELD, PromptLayer, check_pool, method_of, model_config, scorable


def register() -> None:
    """The ``vllm.general_plugins`` entry point: use kvcompress's backend where vLLM uses CPU_ATTN."""
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.KVCompressCPUBackend")


def engine_method(vllm_config: Any = None) -> Method:
    """The method of this vLLM instance (a request may name its own); refuses the engine settings the
    plugin cannot serve, naming them."""
    config = vllm_config or get_current_vllm_config()
    refusals = (
        (config.cache_config.enable_prefix_caching,
         "enable_prefix_caching=False (compressed blocks no longer hold what their hash says)"),
        (config.speculative_config is not None, "no speculative decoding"),
    )
    for refused, what in refusals:
        if refused:
            raise ValueError(f"kvcompress in vLLM needs {what}")
    check_pool(config.cache_config.cache_dtype, config.model_config.hf_config)
    settings = (config.additional_config or {}).get(FIELD)
    method = method_of(settings, default=SnapKV()) if settings is not None else SnapKV()
    return scorable(method, config.model_config.hf_config)


def request_method(request: Any, default: Method) -> Method:
    """A request's own method (its ``kvcompress`` settings in ``SamplingParams.extra_args``: a dict, or
    the JSON string ``RequestSettings`` put in ``vllm_xargs``), else ``default``."""
    extra = request.sampling_params.extra_args if request.sampling_params is not None else None
    settings = (extra or {}).get(FIELD)
    return method_of(json.loads(settings) if isinstance(settings, str) else settings, default=default)


@functools.lru_cache(maxsize=4)
def tokenizer_spans(tokenizer: str) -> Any:
    """Where the tokenizer's words and numbers start (``tokens.TokenSpans``), read once per process."""
    return spans_for(AutoTokenizer.from_pretrained(tokenizer))


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer's name (``model.layers.N.self_attn.attn``) belongs to."""
    return int(name.split("layers.")[1].split(".")[0])


def kept_count(method: Method, prompt: int) -> int:
    """Prompt tokens ``method`` keeps of a ``prompt``-token prompt (all of them: nothing to compress)."""
    if not isinstance(method, PromptMethod):
        return prompt
    return min(prompt, int(method.kept_tokens(torch.tensor([prompt]))[0]))


# Per worker process: a scheduled request's first KV block -> its method and its prompt's length, as the
# connector brought them for this step.
REQUEST_METHODS: dict[int, Method] = {}
REQUEST_PROMPTS: dict[int, int] = {}
# This step's requests still in their prompt whose method reads the prompt's words: first KV block -> the
# prompt's token ids, as the connector brought them (a model's input ids are read nowhere else: a hook on the
# embedding does not run inside vLLM's compiled graph, which kept the first request's ids for every later one).
REQUEST_TOKENS: dict[int, torch.Tensor] = {}
STEP_SPANS: dict[int, torch.Tensor] = {}  # their word spans, read once a step rather than once a layer
# A prompt prefilled in chunks, until its last: (first KV block, layer) -> each earlier chunk's keys, values and
# the queries its method may read (the paged cache's layout is the kernel's own, so the keys are kept as
# computed rather than read back).
CHUNKS: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
# Per worker process: the first KV block of a compressed request -> (prompt tokens, kept tokens). A
# request's first block is its own while it lives; a new request starting on it resets the entry.
COMPRESSED: dict[int, tuple[int, int]] = {}
ATTEND_BLOCK = 512  # prompt queries per call when an fp8 pool's prompt attends itself (``attend_prompt``)
# This step's requests already compressed (their first KV blocks), as the metadata builder remapped them.
REMAPPED: set[int] = set()
# The same key as COMPRESSED -> layer name -> the prompt positions each KV head kept ``[kv_heads, kept]`` (as
# ``KVCompressCache.kept_positions``), for checks against kvcompress's own cache.
KEPT_POSITIONS: dict[int, dict[str, torch.Tensor]] = {}


class KVCompressCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """Maps compressed requests' tokens to their compressed slots before vLLM's metadata is built."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        common = common_attn_metadata
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens.clone()
        slots = common.slot_mapping.clone()
        changed = False
        REMAPPED.clear()
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
            REMAPPED.add(first)
        if changed:
            common = dataclasses.replace(common, seq_lens=seq_lens, slot_mapping=slots, max_seq_len=int(seq_lens.max()))
        return super().build(common_prefix_len, common, fast_build)


class KVCompressCPUImpl(CPUAttentionBackendImpl):
    """CPU attention that compresses each fresh prefill at the end of its attention, with its request's method."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = get_current_vllm_config().model_config  # its tokenizer's spans and its rotary read on first need
        self.rotary: Rotary | None = None
        # An fp8 pool (``--kv-cache-dtype fp8``): vLLM's prefill would attend the prompt as rounded into the pool;
        # the library codes a cache once its prompt is compressed, so a prompt attends itself as computed here too.
        self.coded_pool = is_quantized_kv_cache(self.kv_cache_dtype)
        plain = (self.sliding_window == -1 and not self.logits_soft_cap and self.sinks is None
                 and self.alibi_slopes is None)
        if self.coded_pool and not plain:  # what check_pool reads from the config, and ALiBi
            raise ValueError(f"kvcompress: --kv-cache-dtype {self.kv_cache_dtype} cannot be served for a model whose "
                             "attention has sliding windows, soft-capping, sinks or ALiBi; valid: auto")

    def layer_rotary(self, layer: Any) -> Rotary:
        """The rotary embedding of this layer, from the model's config."""
        if self.rotary is None:
            self.rotary = rotary_from_config(self.model.hf_config, layer_index(layer.layer_name))
        return self.rotary

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(layer.layer_name) if isinstance(metadata, dict) else None
        if metadata is not None:  # our builder's slots: compressed requests write after their kept tokens
            slot_mapping = metadata.slot_mapping[: slot_mapping.shape[0]]
        self.write_pool(layer, key, value, kv_cache, slot_mapping)

    def write_pool(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
        """vLLM's write into the pool; an fp8 pool gets each element rounded to its nearest e4m3 value first (the
        CPU build's cast truncates toward zero; rounded here, the pool holds what the library's ``fp8`` codec and
        vLLM's CUDA cast hold, and the cast of an e4m3 value is exact)."""
        if self.coded_pool:
            codec = make_codec("fp8", key.shape[-1], key.dtype)
            key, value = (codec.decode(codec.encode(t)) for t in (key, value))
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(
        self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        attn_metadata: Any, output: torch.Tensor, output_scale: Any = None, output_block_scale: Any = None,
    ) -> torch.Tensor:
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if attn_metadata is None or kv_cache.numel() == 0:
            return output
        starts = attn_metadata.query_start_loc.tolist()
        for row in range(len(starts) - 1):
            blocks = attn_metadata.block_table[row]
            first, prompt = int(blocks[0]), REQUEST_PROMPTS.get(int(blocks[0]))
            length, seen = starts[row + 1] - starts[row], int(attn_metadata.seq_lens[row])
            if prompt is None or seen - length >= prompt or first in REMAPPED:  # decoding
                continue
            method = REQUEST_METHODS[first]
            compressing = kept_count(method, prompt) < prompt
            if not compressing and not self.coded_pool:
                continue
            # The step's part of the prompt; after it, a preempted request's recomputed tokens (fed with the prompt).
            ends = min(length, prompt - (seen - length))
            rows, after = slice(starts[row], starts[row] + ends), slice(starts[row] + ends, starts[row + 1])
            needed = method.queries_needed() if compressing else 0
            queries = query[rows] if needed is None else query[rows][ends - min(needed, ends) :]
            chunk = (key[rows], value[rows], queries)
            held = CHUNKS.pop((first, layer.layer_name), []) if length < seen else []  # a first chunk starts afresh
            if self.coded_pool or seen >= prompt:  # (an earlier chunk of a 16-bit pool needs none of it)
                keys, values, queries = (torch.cat([part[i] for part in (*held, chunk)]) for i in range(3))
            if self.coded_pool:  # the prompt attends itself as computed, as the library's prefill does
                self.attend_prompt(query[rows], keys, values, output[rows])
            if seen < prompt:  # an earlier chunk of a prompt prefilled in chunks: held until the last, copied (the
                # keys live in the step's whole projection)
                CHUNKS[(first, layer.layer_name)] = [*held, tuple(part.clone() for part in chunk)]
                continue
            if not compressing:
                continue
            kept = self.compress(layer, method, queries, keys, values, kv_cache, blocks, self.spans(method, first),
                                 key[after], value[after])
            if after.stop > after.start:  # a recomputed request's generated tokens see the cache its decoding saw
                self.attend_kept(layer, query[after], kv_cache, blocks, kept, output[after])
        return output

    def spans(self, method: Method, first: int) -> torch.Tensor | None:
        """The word spans of the prompt of the request whose first KV block is ``first``, if its method reads
        them (``[1, prompt]``)."""
        if not method.needs_tokens():
            return None
        if first not in STEP_SPANS:
            STEP_SPANS[first] = tokenizer_spans(self.model.tokenizer).span_ids(REQUEST_TOKENS[first][None])
        return STEP_SPANS[first]

    def compress(
        self, layer: Any, method: Method, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, blocks: torch.Tensor, spans: torch.Tensor | None, later_keys: torch.Tensor,
        later_values: torch.Tensor
    ) -> int:
        """One request's prompt (keys and values ``[tokens, heads, dim]``, the last queries its method reads):
        keep each KV head's tokens in its first slots, then ``later_keys``/``later_values`` (the tokens a
        recomputed request had generated) right after them; returns how many tokens each head kept."""
        length = key.shape[0]
        if spans is not None and spans.shape[-1] != length:  # never score one prompt with another's words
            raise RuntimeError(f"kvcompress: a prompt of {length} tokens came with {spans.shape[-1]} token ids")
        rotary = self.layer_rotary(layer) if method.needs_rotary() else None
        prompt = PromptLayer(key.transpose(0, 1)[None], value.transpose(0, 1)[None], spans, rotary)
        # gpt-oss's learned sinks take their share of the scorer's softmax, as in the library
        with scoring_sinks(self.sinks):
            scores = method.layer_scores(prompt, query.transpose(0, 1)[None], self.scale)
        valid = prompt.slot_validity()
        kept, _ = select_kept(scores, valid, torch.tensor([kept_count(method, length)]))  # [1, kv_heads, n] ascending
        heads = torch.arange(key.shape[1])[None, :]
        order = kept[0].T  # slot s of head h holds token order[s, h]
        block_size = kv_cache.shape[2]
        slots = torch.arange(order.shape[0] + later_keys.shape[0])
        slot_mapping = blocks[slots // block_size].to(torch.long) * block_size + slots % block_size
        keys, values = (torch.cat([t[order, heads], later]) for t, later in ((key, later_keys), (value, later_values)))
        self.write_pool(layer, keys, values, kv_cache, slot_mapping)
        COMPRESSED[int(blocks[0])] = (length, order.shape[0])
        KEPT_POSITIONS.setdefault(int(blocks[0]), {})[layer.layer_name] = kept[0]
        return order.shape[0]

    def attend_prompt(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      output: torch.Tensor) -> None:
        """Causal attention of a prompt's last ``query`` tokens ``[n, heads * dim]`` over its keys and values as
        computed (``[tokens, kv_heads, dim]``, those queries' own last), into ``output``; ``ATTEND_BLOCK`` queries
        at a time, so the masked scores stay small for long prompts."""
        n, total = query.shape[0], keys.shape[0]
        q = query.view(n, self.num_heads, self.head_size).transpose(0, 1)
        k, v = (t.transpose(0, 1).repeat_interleave(self.num_heads // self.num_kv_heads, dim=0) for t in (keys, values))
        out = output.view(n, self.num_heads, self.head_size)
        for start in range(0, n, ATTEND_BLOCK):
            block = q[:, start : start + ATTEND_BLOCK]
            causal = torch.ones(block.shape[1], total, dtype=torch.bool, device=q.device).tril(total - n + start)
            attended = torch.nn.functional.scaled_dot_product_attention(block, k, v, attn_mask=causal, scale=self.scale)
            out[start : start + block.shape[1]].copy_(attended.transpose(0, 1))

    def attend_kept(
        self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, kept: int,
        output: torch.Tensor,
    ) -> None:
        """Attention of a recomputed request's generated tokens (``query``, the last of its ``kept + n`` slots)
        over its compressed cache, causal, with vLLM's kernel, into ``output``: the prefill that recomputes a
        preempted request let them attend to the whole prompt, which its decoding steps never saw."""
        n = query.shape[0]
        starts, lengths = torch.tensor([0, n], dtype=torch.int32), torch.tensor([kept + n], dtype=torch.int32)
        key_cache, value_cache = kv_cache.view(*kv_cache.shape[:2], kv_cache.shape[2] * 2, -1).chunk(2, dim=2)
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
            seq_lens=lengths, dtype=query.dtype, query_start_loc=starts, causal=True,
            sliding_window_size=self.sliding_window, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype
        )
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=starts,
            seq_lens=lengths, scale=self.scale, causal=True, alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window, block_table=blocks[None], softcap=self.logits_soft_cap,
            scheduler_metadata=schedule, s_aux=self.sinks, dynamic_causal=None, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype
        )


class KVCompressCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompressCPUImpl]:
        return KVCompressCPUImpl

    @staticmethod
    def get_builder_cls() -> type[KVCompressCPUMetadataBuilder]:
        return KVCompressCPUMetadataBuilder


@dataclasses.dataclass
class StepMethods(KVConnectorMetadata):
    """A step's scheduled requests, by first KV block: the settings of the request's method, its prompt's length,
    the prompt's token ids while it is prefilled (where its method reads them); and the first KV blocks of every
    request holding blocks, scheduled this step or not."""

    methods: dict[int, dict[str, Any]]
    prompts: dict[int, int]
    live: set[int]
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)


class KVCompressConnector(KVConnectorBase_V1):
    """Carries each request's method from the scheduler to the workers; it moves no KV."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.default = engine_method(vllm_config)
        self.methods: dict[str, Method] = {}  # scheduler side: request id -> its method
        self.requests: dict[str, Any] = {}  # and vLLM's request (its prompt, its progress)

    # --- the scheduler's side -------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self.methods[request.request_id] = request_method(request, self.default)
        self.requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # nothing to load from elsewhere

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> StepMethods:
        manager = self._kv_cache_manager.coordinator.single_type_managers[0]
        methods, prompts, tokens = {}, {}, {}
        for request_id in scheduler_output.num_scheduled_tokens:  # (called before the step advances requests)
            blocks, method = manager.req_to_blocks.get(request_id), self.methods.get(request_id)
            if blocks and method is not None:
                first, request = blocks[0].block_id, self.requests[request_id]
                methods[first] = {"method": method.name, **method.settings()}
                prompts[first] = request.num_prompt_tokens
                if method.needs_tokens() and request.num_computed_tokens < request.num_prompt_tokens:
                    tokens[first] = list(request.prompt_token_ids)
        live = {blocks[0].block_id for request_id in self.methods if (blocks := manager.req_to_blocks.get(request_id))}
        return StepMethods(methods, prompts, live, tokens)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.methods.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        return False, None

    # --- a worker's side ------------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: StepMethods) -> None:
        """Before the step's forward (``start_load_kv`` comes after it where no load is synchronous)."""
        super().bind_connector_metadata(connector_metadata)
        for block, settings in connector_metadata.methods.items():
            REQUEST_METHODS[block] = settled(json.dumps(settings, sort_keys=True))
        REQUEST_PROMPTS.update(connector_metadata.prompts)
        REQUEST_TOKENS.clear()  # this step's only: they are sent with every step of a prompt
        STEP_SPANS.clear()
        REQUEST_TOKENS.update({block: torch.tensor(ids) for block, ids in connector_metadata.tokens.items()})
        for held in [key for key in CHUNKS if key[0] not in connector_metadata.live]:  # ended, or preempted
            del CHUNKS[held]  # (a request that skips a step keeps its chunks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


@functools.lru_cache(maxsize=256)
def settled(settings: str) -> Method:
    """The method of settings the scheduler already checked (built once per distinct settings)."""
    fields = json.loads(settings)
    return method_from_name(fields.pop("method"), **fields)


class KVCompressScheduler(Scheduler):
    """vLLM's scheduler, freeing the KV blocks a request no longer needs once its prompt is compressed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.connector, KVCompressConnector):
            raise ValueError("kvcompress in vLLM needs its KV connector (serving.engine_options: kv_transfer_config)")
        self.blocks_before_after: dict[str, tuple[int, int]] = {}  # request -> KV blocks in use before / after
        self.peak_running = 0  # the most requests running at once

    def add_request(self, request: Any) -> None:  # bad settings refused by name before vLLM holds the request
        method = scorable(request_method(request, self.connector.default), self.vllm_config.model_config.hf_config)
        if method.needs_tokens() and request.prompt_token_ids is None:
            raise InvalidParameterError(f"kvcompress: {method.name} reads the prompt's words (clustering='spans'), and "
                                        "this prompt came as embeddings; use the setting clustering='pool'")
        super().add_request(request)

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
        kept = kept_count(self.connector.methods[request.request_id], request.num_prompt_tokens)
        if kept >= request.num_prompt_tokens:
            return
        before = after = 0
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request.request_id, [])
            in_use = lambda: sum(block is not manager._null_block for block in blocks)  # noqa: E731
            before += in_use()
            keep = math.ceil((kept + request.max_tokens) / manager.block_size)
            manager._remove_blocks_in_range(request.request_id, keep, len(blocks))
            after += in_use()
        self.blocks_before_after.setdefault(request.request_id, (before, after))  # the first compression


class RequestSettings:
    """An ASGI middleware of vLLM's API server (``--middleware``): a request body's ``kvcompress``
    settings are checked by the library's own validation (an HTTP 400 naming the field and its valid
    values otherwise, the server serving on) and passed to the engine in the request's ``vllm_xargs``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        engine = json.loads(os.environ.get(ENGINE_ENV) or "{}")  # where ``kvcompress serve`` started the server:
        self.default = method_of(engine[FIELD]) if FIELD in engine else None  # the engine's method
        self.config = model_config(engine["model"]) if "model" in engine else None  # and its model's

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None  # not JSON: vLLM answers it
        if isinstance(payload, dict) and FIELD in payload:
            try:
                method = scorable(method_of(payload.pop(FIELD), default=self.default), self.config)
            except InvalidParameterError as err:
                return await bad_request(send, str(err))
            xargs = payload.get("vllm_xargs") or {}
            payload["vllm_xargs"] = {**xargs, FIELD: json.dumps({"method": method.name, **method.settings()})}
            body = json.dumps(payload).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # a disconnect, as vLLM waits for it
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def bad_request(send: Any, message: str) -> None:
    """An HTTP 400 in the OpenAI error format."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": FIELD, "code": 400}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
