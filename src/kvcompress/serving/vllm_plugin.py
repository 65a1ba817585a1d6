"""kvcompress inside vLLM (its CPU build): prefill-time eviction whose freed KV blocks go back to
vLLM's block pool, a method per request, with vLLM's prefix caching on. Design and measurements: docs/vllm.md.

Each piece goes through an extension point vLLM offers (nothing of vLLM is patched or forked):

* ``register`` (a ``vllm.general_plugins`` entry point, run in every vLLM process) points vLLM's
  ``CPU_ATTN`` attention backend at ``KVCompressCPUBackend``.
* ``RequestSettings`` (an ASGI middleware of vLLM's API server, ``--middleware``): a request's own
  ``kvcompress`` settings are validated by the library (an HTTP 400 naming the field otherwise) and
  handed to the engine in the request's ``vllm_xargs``.
* ``KVCompressConnector`` (a KV connector, ``kv_transfer_config``; it moves no KV): learns each
  request's method when the request arrives and sends the workers (other processes), with every step,
  each scheduled request's method, prompt, progress and, while its prompt is prefilled, its token ids
  (so SnapKV keeps words and numbers whole as kvcompress does, ``clustering="spans"``).
* ``KVCompressScheduler`` (``scheduler_cls``): cuts a compressing request's prefix-cache hit so that it
  computes the queries its method reads; gives it blocks of its own for its compressed cache when its
  prompt's last step is scheduled (never blocks the prefix cache holds); adds, to what the connector
  sends, each request's blocks; once the prompt is compressed, lets its prompt's blocks go (the cached
  ones stay cached for the next request), so more requests fit and a shared document is prefilled once.
* ``KVCompressCPUBackend`` (the attention backend): finds each scheduled request's row of the batch by
  its blocks; right after a prompt's last prefill attention, each layer scores the whole prompt with the
  request's method (kvcompress's own functions; the part a prefix-cache hit spared read back from the
  paged cache) and writes, per KV head, the kept tokens into the request's own blocks. From then on the
  request's rows read those blocks: new tokens go right after the kept ones, RoPE positions stay the
  logical ones.

The engine's method comes from ``additional_config={"kvcompress": {"method": "snapkv", "budget":
256, ...}}`` (any field of a servable method, ``settings.SERVABLE``); a request may name its own
(``settings.method_of``). ``settings.engine_options`` gives all of it for ``vllm.LLM``. Requirements:
no speculative decoding, full-attention models (chunked prefill is fine: a prompt's earlier chunks are
held until its last, which compresses the whole prompt).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import torch
from transformers import AutoTokenizer
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
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

logger = init_logger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: use kvcompress's backend where vLLM uses CPU_ATTN."""
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.KVCompressCPUBackend")


def engine_method(vllm_config: Any = None) -> Method:
    """The method of this vLLM instance (a request may name its own); refuses the engine settings the
    plugin cannot serve, naming them."""
    config = vllm_config or get_current_vllm_config()
    if config.speculative_config is not None:
        raise ValueError("kvcompress in vLLM needs no speculative decoding")
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


@dataclasses.dataclass
class Scheduled:
    """What a worker is told of one request scheduled in a step (by the connector, from the scheduler): its method's
    settings, its prompt's length, the tokens computed before the step and scheduled in it, where this prefill began
    (its prefix-cache hit: the prompt before it is read back from the paged cache), the prompt's token ids while it
    is prefilled (where its method reads them), the block ids the worker's block table holds for it (how its row is
    found), and the blocks its compressed cache lives in once the scheduler gave them."""

    settings: dict[str, Any]
    prompt: int
    computed: int
    query: int
    start: int = 0
    tokens: list[int] | None = None
    row: list[int] | None = None
    area: list[int] | None = None


@dataclasses.dataclass
class StepMethods(KVConnectorMetadata):
    """A step's scheduled requests by request id, and the ids of every request holding blocks, scheduled or not."""

    requests: dict[str, Scheduled]
    live: set[str]


# Per worker process, this step's: the scheduled requests (as the connector brought them), which request each row of
# the batch is (found by their blocks at the step's first layer, ``prepare``), the compressed requests whose rows it
# remapped, and the word spans of prompts whose method reads them (read once a step rather than once a layer).
STEP: dict[str, Scheduled] = {}
ROWS: list[str | None] = []
REMAPPED: set[str] = set()
STEP_SPANS: dict[str, torch.Tensor] = {}
# A prompt prefilled in chunks, until its last: (request, layer) -> where its computing began and each computed
# chunk's keys, values and the queries its method may read (a prompt before its computing began is read back from
# the paged cache at its last chunk).
CHUNKS: dict[tuple[str, str], tuple[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
ATTEND_BLOCK = 512  # prompt queries per call when an fp8 pool's prompt attends itself (``attend_prompt``)
# request id -> layer name -> the prompt positions each KV head kept ``[kv_heads, kept]`` (as
# ``KVCompressCache.kept_positions``), for checks against kvcompress's own cache: the last ``KEPT_RECORDS`` requests'
# (keyed by request id since the first block is shared with prefix caching, it is bounded rather than overwritten).
KEPT_POSITIONS: collections.OrderedDict[str, dict[str, torch.Tensor]] = collections.OrderedDict()
KEPT_RECORDS = 64


def rows_of(step: dict[str, Scheduled], table: torch.Tensor, query_lens: list[int], seq_lens: list[int]) -> list:
    """Which scheduled request each row of a step's batch is (None: one the worker needs nothing of): the row whose
    block table starts with the blocks the worker was sent for the request, with its scheduled and seen tokens. A
    block id alone could mislead: a compressed request's freed prompt blocks stay in its row while other requests
    reuse them; so every request's whole row is compared, and ties are settled by elimination or refused."""
    rows: list[str | None] = [None] * len(query_lens)
    candidates: dict[str, set[int]] = {}
    for request, info in step.items():
        if info.row is None or len(info.row) > table.shape[1]:
            continue
        same = (table[:, : len(info.row)] == torch.tensor(info.row, dtype=table.dtype)).all(dim=1).tolist()
        candidates[request] = {r for r, hit in enumerate(same) if hit and query_lens[r] == info.query
                               and seq_lens[r] == info.computed + info.query}
    while candidates:
        settled_now = {request: next(iter(found)) for request, found in candidates.items() if len(found) == 1}
        if not settled_now:
            raise RuntimeError(f"kvcompress: the batch rows of requests {sorted(candidates)} cannot be told apart")
        for request, row in settled_now.items():
            rows[row] = request
            del candidates[request]
        for found in candidates.values():
            found.difference_update(settled_now.values())
    return rows


def step_method(request: str) -> Method:
    return settled(json.dumps(STEP[request].settings, sort_keys=True))


@functools.lru_cache(maxsize=8)
def paged_order(kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """Where vLLM's CPU kernels keep each token's key and value inside a block (their layout is the ISA's own: keys
    transposed on some): for each element of a KV head's ``[block_size, head_size]`` keys then values, token-major,
    its offset in the head's stored ``2 * block_size * head_size`` elements, ``[kv_heads, 2 * block_size *
    head_size]``. Found by writing a block whose elements spell their own index one bit at a time (0 and 1 are exact
    in every dtype) with the kernel's own write, so no layout is assumed."""
    count = block_size * head_size
    index = torch.arange(count).view(block_size, 1, head_size).expand(block_size, kv_heads, head_size)
    stored = torch.zeros(kv_heads, 2 * count, dtype=torch.long)
    for bit in range((2 * count - 1).bit_length()):
        keys, values = (((part >> bit) & 1).to(dtype).contiguous() for part in (index, index + count))
        cache = torch.zeros(1, kv_heads, block_size * 2, head_size, dtype=dtype)
        ops.cpu_attn_reshape_and_cache(keys, values, *cache.chunk(2, dim=2), torch.arange(block_size), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        stored |= (cache[0].reshape(kv_heads, 2 * count) != 0).long() << bit
    return stored.argsort(dim=1)


def read_prompt(kv_cache: torch.Tensor, blocks: torch.Tensor, tokens: int, isa: str) -> tuple[torch.Tensor, ...]:
    """The keys and values ``[tokens, kv_heads, head_size]`` a request's first ``tokens`` positions hold in vLLM's
    CPU paged cache (``kv_cache [blocks, kv_heads, block_size, 2 * head_size]`` in the model's dtype), through
    ``blocks``, its block table row: the prompt a prefix-cache hit spared its prefill."""
    _, kv_heads, block_size, width = kv_cache.shape
    used = -(-tokens // block_size)
    order = paged_order(kv_heads, block_size, width // 2, kv_cache.dtype, isa)
    stored = kv_cache.view(kv_cache.shape[0], kv_heads, -1)[blocks[:used].long()]  # [used, kv_heads, 2 * bs * d]
    ordered = stored.gather(2, order[None].expand(used, -1, -1)).view(used, kv_heads, 2, block_size, width // 2)
    return tuple(ordered[:, :, i].transpose(1, 2).reshape(used * block_size, kv_heads, width // 2)[:tokens]
                 for i in range(2))


class KVCompressCPUImpl(CPUAttentionBackendImpl):
    """CPU attention that compresses each prompt at the end of its prefill, with its request's method, into the
    blocks the scheduler gave it."""

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

    def prepare(self, layer: Any, metadata: Any, block_size: int) -> None:
        """Once a step, at its first layer (the connector's metadata reaches a worker after vLLM built the step's
        attention metadata): find each scheduled request's row, then point compressed requests' rows at their own
        blocks: their new tokens' slots right after their kept tokens, their lengths kept + generated, the
        scheduling recomputed. New tensors replace the metadata's (its own are vLLM's persistent buffers)."""
        if getattr(metadata, "kvcompress_step", False):
            return
        metadata.kvcompress_step = True
        starts = metadata.query_start_loc.tolist()
        query_lens = [starts[r + 1] - starts[r] for r in range(len(starts) - 1)]
        table = metadata.block_table[: len(query_lens)]
        ROWS[:] = rows_of(STEP, table, query_lens, metadata.seq_lens[: len(query_lens)].tolist())
        REMAPPED.clear()
        remapped = [(row, request) for row, request in enumerate(ROWS) if request is not None
                    and STEP[request].area is not None and STEP[request].computed >= STEP[request].prompt]
        if not remapped:
            return
        seq_lens, slots, table = metadata.seq_lens.clone(), metadata.slot_mapping.clone(), metadata.block_table.clone()
        for row, request in remapped:
            info = STEP[request]
            kept, area = kept_count(step_method(request), info.prompt), torch.tensor(info.area, dtype=table.dtype)
            physical = kept + (info.computed - info.prompt) + torch.arange(info.query)  # where its new tokens go
            slots[starts[row] : starts[row + 1]] = (area[physical // block_size].to(slots.dtype) * block_size
                                                    + physical % block_size)
            seq_lens[row] = kept + (info.computed + info.query - info.prompt)
            table[row, : len(info.area)] = area
            REMAPPED.add(request)
        metadata.seq_lens, metadata.slot_mapping, metadata.block_table = seq_lens, slots, table
        metadata.max_seq_len = int(seq_lens[: len(query_lens)].max())
        metadata.scheduler_metadata = self.scheduling(layer, metadata.query_start_loc, seq_lens[: len(query_lens)],
                                                      metadata.causal)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(layer.layer_name) if isinstance(metadata, dict) else None
        if metadata is not None:  # compressed requests write after their kept tokens
            self.prepare(layer, metadata, kv_cache.shape[2])
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
        if attn_metadata is not None and kv_cache.numel():  # (done at the step's first cache write, unless none)
            self.prepare(layer, attn_metadata, kv_cache.shape[2])
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if attn_metadata is None or kv_cache.numel() == 0:
            return output
        starts = attn_metadata.query_start_loc.tolist()
        for row, request in enumerate(ROWS[: len(starts) - 1]):
            if request is None or request in REMAPPED or STEP[request].computed >= STEP[request].prompt:  # decoding
                continue
            info, method = STEP[request], step_method(request)
            compressing = kept_count(method, info.prompt) < info.prompt
            # The step's part of the prompt; after it, a preempted request's recomputed tokens (fed with the prompt).
            ends = min(info.query, info.prompt - info.computed)
            rows, after = slice(starts[row], starts[row] + ends), slice(starts[row] + ends, starts[row + 1])
            needed = method.queries_needed() if compressing else 0
            queries = query[rows] if needed is None else query[rows][ends - min(needed, ends) :]
            chunk = (key[rows], value[rows], queries)
            began, held = (CHUNKS.pop((request, layer.layer_name), (info.computed, []))
                           if info.computed > info.start else (info.start, []))  # a first chunk starts afresh
            done = info.computed + ends >= info.prompt
            if self.coded_pool or done:  # (an earlier chunk of a 16-bit pool needs none of it)
                keys, values, queries = (torch.cat([part[i] for part in (*held, chunk)]) for i in range(3))
            if self.coded_pool:  # the prompt attends itself as computed, as the library's prefill does
                self.attend_prompt(query[rows], keys, values, output[rows])
            if not done:  # an earlier chunk of a prompt prefilled in chunks: held until the last, copied (the keys
                # live in the step's whole projection)
                CHUNKS[(request, layer.layer_name)] = (began, [*held, tuple(part.clone() for part in chunk)])
                continue
            if not compressing or info.area is None:  # (no area: the scheduler found no room, docs/vllm.md)
                continue
            if began > 0:  # the prompt before this prefill began, a prefix-cache hit: read back from the pool
                cached = read_prompt(kv_cache, attn_metadata.block_table[row], began, layer.isa)
                keys, values = torch.cat([cached[0], keys]), torch.cat([cached[1], values])
            area = torch.tensor(info.area, dtype=torch.int32)
            kept = self.compress(layer, request, method, queries, keys, values, kv_cache, area,
                                 self.spans(method, request), key[after], value[after])
            if after.stop > after.start:  # a recomputed request's generated tokens see the cache its decoding saw
                self.attend_kept(layer, query[after], kv_cache, area, kept, output[after])
        return output

    def spans(self, method: Method, request: str) -> torch.Tensor | None:
        """The word spans of ``request``'s prompt, if its method reads them (``[1, prompt]``)."""
        if not method.needs_tokens():
            return None
        if request not in STEP_SPANS:
            tokens = torch.tensor(STEP[request].tokens)[None]
            STEP_SPANS[request] = tokenizer_spans(self.model.tokenizer).span_ids(tokens)
        return STEP_SPANS[request]

    def compress(
        self, layer: Any, request: str, method: Method, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, blocks: torch.Tensor, spans: torch.Tensor | None, later_keys: torch.Tensor,
        later_values: torch.Tensor
    ) -> int:
        """One request's prompt (keys and values ``[tokens, heads, dim]``, the last queries its method reads):
        keep each KV head's tokens in the first slots of ``blocks`` (its own, never a block the prefix cache holds),
        then ``later_keys``/``later_values`` (the tokens a recomputed request had generated) right after them;
        returns how many tokens each head kept."""
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
        KEPT_POSITIONS.setdefault(request, {})[layer.layer_name] = kept[0]
        while len(KEPT_POSITIONS) > KEPT_RECORDS:
            KEPT_POSITIONS.popitem(last=False)
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
        schedule = self.scheduling(layer, starts, lengths, True)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=starts,
            seq_lens=lengths, scale=self.scale, causal=True, alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window, block_table=blocks[None], softcap=self.logits_soft_cap,
            scheduler_metadata=schedule, s_aux=self.sinks, dynamic_causal=None, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype
        )


    def scheduling(self, layer: Any, starts: torch.Tensor, lengths: torch.Tensor, causal: bool) -> torch.Tensor:
        """vLLM's CPU kernel's work split for requests of ``lengths`` tokens whose queries start at ``starts``."""
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=lengths.shape[0], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size, seq_lens=lengths, dtype=self.model.dtype, query_start_loc=starts, causal=causal,
            sliding_window_size=self.sliding_window, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)


class KVCompressCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompressCPUImpl]:
        return KVCompressCPUImpl



class KVCompressConnector(KVConnectorBase_V1):
    """Carries each request's method and blocks from the scheduler to the workers; it moves no KV."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.default = engine_method(vllm_config)
        self.coded_pool = is_quantized_kv_cache(vllm_config.cache_config.cache_dtype)
        self.methods: dict[str, Method] = {}  # scheduler side: request id -> its method
        self.requests: dict[str, Any] = {}  # and vLLM's request (its prompt, its progress)

    # --- the scheduler's side -------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self.methods[request.request_id] = request_method(request, self.default)
        self.requests[request.request_id] = request

    def compresses(self, request: Any) -> bool:
        """Whether ``request``'s method keeps fewer tokens than its prompt has."""
        return kept_count(self.methods[request.request_id], request.num_prompt_tokens) < request.num_prompt_tokens

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # nothing to load from elsewhere

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> StepMethods:
        """Each scheduled request's method, prompt and progress (called before the step advances requests); the
        scheduler adds their blocks (``KVCompressScheduler.schedule``)."""
        requests = {}
        for request_id, query in scheduler_output.num_scheduled_tokens.items():
            method, request = self.methods.get(request_id), self.requests.get(request_id)
            if method is None:
                continue
            prefilling = request.num_computed_tokens < request.num_prompt_tokens
            requests[request_id] = Scheduled(
                {"method": method.name, **method.settings()}, request.num_prompt_tokens, request.num_computed_tokens,
                query, tokens=list(request.prompt_token_ids) if method.needs_tokens() and prefilling else None)
        return StepMethods(requests, set())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.methods.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        return False, None

    # --- a worker's side ------------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: StepMethods) -> None:
        """Before the step's forward (``start_load_kv`` comes after it where no load is synchronous)."""
        super().bind_connector_metadata(connector_metadata)
        STEP.clear()  # this step's only: every scheduled request comes with every step
        STEP.update(connector_metadata.requests)
        STEP_SPANS.clear()
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


@dataclasses.dataclass
class Area:
    """Where a compressed request's cache lives: ``own``, blocks of its own, then the blocks its table gets after its
    prompt's ``prompt`` (the block ids its worker's row starts with, which stay there when the prompt's blocks are
    let go). Either taken from the pool when its prompt's last step is scheduled (appended to its table after the
    prompt, the first of them also to its worker's row, which is how the worker finds it), or, where the pool had no
    room, the prompt's own last blocks that no other request holds, dropped from the prefix cache (``first``: their
    index, the blocks vLLM appends later following them, as they do for any request)."""

    own: list[Any]
    prompt: list[int]
    first: int | None = None
    freed: bool = False

    def blocks(self, table: list[Any]) -> list[int]:
        """The area's block ids, given the request's block table."""
        later = table[len(self.prompt) :]
        return [block.block_id for block in later] if self.first is None else [
            block.block_id for block in (*self.own, *later)]

    def row(self, table: list[Any]) -> list[int]:
        """The block ids its worker's block table row holds."""
        later = table[len(self.prompt) :]
        return [*self.prompt, *[block.block_id for block in (later[:1] if self.first is None else later)]]

    def held(self, table: list[Any]) -> bool:
        """Whether the request still holds its area (vLLM frees a request's blocks when it ends or is preempted)."""
        index = len(self.prompt) if self.first is None else self.first
        return len(table) > index and table[index] is self.own[0]


class KVCompressScheduler(Scheduler):
    """vLLM's scheduler with prefix caching kept on: a compressing request's prompt is prefilled over what the
    prefix cache holds (less the queries its method reads), its kept tokens go to blocks of its own, and once its
    prompt is compressed its prompt's blocks are let go (those the prefix cache holds stay cached for the next
    request), so more requests fit and a shared document is prefilled once.

    vLLM's private state touched here, and only here: the KV cache managers' ``req_to_blocks``,
    ``num_cached_block`` and ``_remove_blocks_in_range``, the block pool's ``get_new_blocks``, the step output's
    block ids, ``running``, ``_preempt_request`` and ``_get_local_prefix_cache_hit`` (docs/vllm.md, "Upstream
    proposal")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.connector, KVCompressConnector):
            raise ValueError("kvcompress in vLLM needs its KV connector (serving.engine_options: kv_transfer_config)")
        self.blocks_before_after: dict[str, tuple[int, int]] = {}  # request -> KV blocks in use before / after
        self.peak_running = 0  # the most requests running at once
        self.areas: dict[str, Area] = {}  # compressed requests' own blocks
        self.hits: dict[str, int] = {}  # where each request's prefill began (its prefix-cache hit)
        self.waiting_room: set[str] = set()  # requests whose compressed cache found no room this step
        self.preempted = 0  # requests preempted for want of room for their compressed cache
        self.coded_pool = self.connector.coded_pool
        self.width = -(-self.vllm_config.model_config.max_model_len // self.block_size)  # a worker's block table row

    @property
    def manager(self) -> Any:
        return self.kv_cache_manager.coordinator.single_type_managers[0]

    def add_request(self, request: Any) -> None:  # bad settings refused by name before vLLM holds the request
        method = scorable(request_method(request, self.connector.default), self.vllm_config.model_config.hf_config)
        if method.needs_tokens() and request.prompt_token_ids is None:
            raise InvalidParameterError(f"kvcompress: {method.name} reads the prompt's words (clustering='spans'), and "
                                        "this prompt came as embeddings; use the setting clustering='pool'")
        super().add_request(request)

    def _get_local_prefix_cache_hit(self, request: Any) -> tuple[Any, int, int, bool]:
        """vLLM's prefix-cache hit, cut so that a compressing request computes the last prompt queries its method
        reads (SnapKV's window; none of a prompt for a method that reads every query, H2O's and ExpectedAttention's)
        and ends on a block; an fp8 pool's requests take none (their prompts attend themselves as computed)."""
        blocks, hit, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        allowed = hit
        if self.coded_pool:
            allowed = 0
        elif request.request_id in self.connector.methods and self.connector.compresses(request):
            needed = self.connector.methods[request.request_id].queries_needed()
            allowed = 0 if needed is None else max(request.num_prompt_tokens - needed, 0)
            allowed -= allowed % self.block_size
        if hit > allowed:
            blocks, hit = self.kv_cache_manager.truncate_computed_blocks(blocks, allowed), allowed
        self.hits[request.request_id] = hit
        return blocks, hit, boundary, diverged

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        step: StepMethods = output.kv_connector_metadata
        tables = self.manager.req_to_blocks
        for request_id in [r for r, area in self.areas.items() if not area.held(tables.get(r, []))]:
            del self.areas[request_id]  # ended or preempted: vLLM freed its blocks
        for request_id, info in step.requests.items():
            request = self.requests[request_id]
            if (request_id not in self.areas and self.connector.compresses(request)
                    and info.computed < request.num_prompt_tokens <= info.computed + info.query):
                self.take_area(request, output)
            area, table = self.areas.get(request_id), tables.get(request_id, [])
            info.start = self.hits.get(request_id, 0)
            info.area = None if area is None else area.blocks(table)
            if self.connector.compresses(request) or (self.coded_pool and info.computed < info.prompt):
                info.row = area.row(table) if area is not None else [block.block_id for block in table]
        step.live = {request_id for request_id in self.connector.methods if tables.get(request_id)}
        return output

    def take_area(self, request: Any, output: Any) -> None:
        """Blocks for the compressed cache of a request whose prompt's last step is scheduled: room for what its
        method keeps and every token it may generate, from the pool, the first appended to its worker's row (in this
        step's output); where the pool has no room, its prompt's own last blocks no other request holds (dropped
        from the prefix cache), if they hold what it keeps; else, once this step gives its first token (from the
        whole prompt, as the library's), it is preempted, as vLLM preempts a request it has no blocks for, and
        recomputed (its prompt from the prefix cache) when there is room."""
        request_id, manager, block_size = request.request_id, self.manager, self.block_size
        kept = kept_count(self.connector.methods[request_id], request.num_prompt_tokens)
        needed = -(-(kept + request.max_tokens) // block_size)
        table = manager.req_to_blocks[request_id]
        prompt = [block.block_id for block in table]
        mine = [i for i, block in enumerate(table) if block.ref_cnt == 1 and not block.is_null]
        if manager.block_pool.get_num_free_blocks() >= needed and len(table) < self.width:
            own = manager.block_pool.get_new_blocks(needed)
            table.extend(own)  # freed with the request, as vLLM frees its blocks
            self.areas[request_id] = Area(own, prompt)
            worker_row(output, request_id).append(own[0].block_id)
        elif mine and mine == list(range(mine[0], len(table))) and len(mine) * block_size >= (
                kept + len(table) * block_size - request.num_prompt_tokens):  # the rest grows as vLLM's table does
            own = table[mine[0] : mine[0] + needed]
            self.kv_cache_manager.evict_blocks({block.block_id for block in own})
            self.areas[request_id] = Area(own, prompt, mine[0])
        else:  # after this step (its first token, from the whole prompt), recomputed once there is room
            self.waiting_room.add(request_id)
            return
        manager.num_cached_block[request_id] = sys.maxsize  # nothing of it offered to the prefix cache from now on

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self.peak_running = max(self.peak_running, len(self.running))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in [r for r in self.running if r.request_id in self.waiting_room]:
            self.waiting_room.discard(request.request_id)
            self.running.remove(request)  # as vLLM preempts a request it has no blocks for (no async scheduling on
            self._preempt_request(request, time.monotonic())  # a CPU: this step's output is in)
            self.preempted += 1
            logger.info("kvcompress: request %s preempted, to be recomputed: no room for its compressed cache",
                        request.request_id)
        self.waiting_room.clear()  # (ended this step)
        for request in self.running:
            area = self.areas.get(request.request_id)
            if area is not None and not area.freed and request.num_computed_tokens >= request.num_prompt_tokens:
                self.release_prompt(request.request_id, area)
        return outputs

    def release_prompt(self, request_id: str, area: Area) -> None:
        """Once a prompt is compressed, let its prompt's blocks go but its area's (vLLM's null block in their place,
        as vLLM frees a sliding window's): those the prefix cache holds stay cached for the next request."""
        manager, count = self.manager, len(area.prompt)
        table = manager.req_to_blocks[request_id]
        before = sum(block is not manager._null_block for block in table[:count])
        if area.first is not None:  # in place: what follows its own blocks, then what precedes them
            manager._remove_blocks_in_range(request_id, area.first + len(area.own), count)
        manager._remove_blocks_in_range(request_id, 0, count if area.first is None else area.first)
        area.freed = True
        self.blocks_before_after.setdefault(request_id, (before, len(area.blocks(table))))  # the first compression


def worker_row(output: Any, request_id: str) -> list[int]:
    """The block ids a step's output appends to a scheduled request's worker row (its first KV cache group's)."""
    for new in output.scheduled_new_reqs:
        if new.req_id == request_id:
            return new.block_ids[0]
    cached = output.scheduled_cached_reqs
    i = cached.req_ids.index(request_id)
    if cached.new_block_ids[i] is None:
        cached.new_block_ids[i] = ([],)
    return cached.new_block_ids[i][0]


class RequestSettings:
    """An ASGI middleware of vLLM's API server (``--middleware``): a request body's ``kvcompress``
    settings are checked by the library's own validation (an HTTP 400 naming the field and its valid
    values otherwise, the server serving on) and passed to the engine in the request's ``vllm_xargs``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        engine = json.loads(os.environ.get(ENGINE_ENV) or "{}")  # where ``kvcompress serve`` started the server:
        self.pool = engine.get("kv_cache_dtype")  # its cache pool's dtype (None: the model's)
        self.default = method_of(engine[FIELD], cache_dtype=self.pool) if FIELD in engine else None  # its method
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
                method = scorable(method_of(payload.pop(FIELD), self.default, self.pool), self.config)
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
