"""The plugin in vLLM's workers: vLLM's CPU attention backend, which finds each scheduled request's row of a step's
batch, points compressed requests' rows at their own blocks, and compresses each prompt at the end of its prefill
(scored with the requests finishing beside it: ``scoring.kept_together``) into the blocks the scheduler gave it."""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch
from transformers import AutoTokenizer
from vllm.config import get_current_vllm_config
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..cache.tokens import spans_for
from ..integrations.transformers.rope import Rotary, rotary_from_config
from ..methods.base import Method
from ..storage.codec import make_codec
from .prompt_keys import HeldPrefixes
from .scoring import Finishing, PromptKeys, PromptValues, kept_together
from .vllm_paged import attend_kept, read_at, read_keys, scheduling
from .vllm_requests import Scheduled, settled
from .vllm_seam import step_metadata


@functools.lru_cache(maxsize=4)
def tokenizer_spans(tokenizer: str) -> Any:
    """Where the tokenizer's words and numbers start (``tokens.TokenSpans``), read once per process."""
    return spans_for(AutoTokenizer.from_pretrained(tokenizer))


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer's name (``model.layers.N.self_attn.attn``) belongs to."""
    return int(name.split("layers.")[1].split(".")[0])


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
HELD = HeldPrefixes()  # per layer, the last prefix-cache hit's keys read back, for the questions that follow
# A choice's key (``Plan.choice``) -> layer name -> the prompt positions each KV head kept ``[kv_heads, kept]``: what a
# later request with the same key keeps (``Recalled``: the scheduler says which to keep and which to let go).
CHOICES: dict[str, dict[str, torch.Tensor]] = {}


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
        candidates[request] = {
            r
            for r, hit in enumerate(same)
            if hit and query_lens[r] == info.query and seq_lens[r] == info.computed + info.query
        }
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
    return settled(STEP[request].settings)


def recalled_choice(request: str, info: Scheduled, layer: str) -> torch.Tensor:
    """The positions an earlier request with ``request``'s choice key kept in ``layer`` (``CHOICES``)."""
    held = CHOICES.get(str(info.choice), {}).get(layer)
    if held is None:  # (the scheduler recalls only what it told the workers to keep and not yet to let go)
        raise RuntimeError(f"kvcompress: request {request} recalls a choice of kept tokens this worker does not hold")
    return held.long()


def finishing_prompt(
    layer: Any,
    kv_cache: torch.Tensor,
    table_row: torch.Tensor,
    began: int,
    computed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spans: torch.Tensor | None,
    info: Scheduled,
    reads: dict[tuple, torch.Tensor],
) -> Finishing:
    """A prompt at the end of its prefill as its method scores it: this prefill's keys, values (``[n, kv_heads,
    dim]``) and queries, after the ``began`` tokens a prefix-cache hit spared it, whose keys are read back from the
    pool once for the questions that follow over the same blocks (``HELD``; ``reads``: this step's and layer's reads)
    and whose values only where kept (a request recalling its choice: its keys too, nothing scored)."""
    keys, values, queries = computed
    block_size = kv_cache.shape[2]
    whole = began - began % block_size
    if whole < began:  # a hit inside a block: its cached tokens there (in the request's copy) read back with the
        # computed ones, so the part held across questions ends on a block the prefix cache shares
        tail = torch.arange(whole, began).expand(keys.shape[1], began - whole)
        row = table_row[: -(-began // block_size)]
        keys, values = (
            torch.cat([read_at(kv_cache, row, tail, layer.isa, part).transpose(0, 1), computed[part]])
            for part in (0, 1)
        )
        began = whole
    if began == 0:
        return Finishing(PromptKeys(0, keys), PromptValues(0, values), queries, spans, info.asked, info.kept)
    blocks = table_row[: -(-began // block_size)]
    cached_values = functools.partial(read_at, kv_cache, blocks, isa=layer.isa, part=1)
    if info.recall:  # (nothing scored: the kept keys read where they lie, as values are)
        cached_keys = functools.partial(read_at, kv_cache, blocks, isa=layer.isa, part=0)
        return Finishing(
            PromptKeys(began, keys, read=cached_keys),
            PromptValues(began, values, cached_values),
            queries,
            spans,
            info.asked,
            info.kept,
        )
    prefix, room = HELD.prefix(
        layer.layer_name,
        tuple(blocks.tolist()),
        began,
        lambda: read_keys(kv_cache, blocks, began, layer.isa),
        reads,
        kv_cache.nbytes,
    )
    return Finishing(
        PromptKeys(began, keys, prefix, room),
        PromptValues(began, values, cached_values),
        queries,
        spans,
        info.asked,
        info.kept,
    )


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
        plain = (
            self.sliding_window == -1 and not self.logits_soft_cap and self.sinks is None and self.alibi_slopes is None
        )
        if self.coded_pool and not plain:  # what check_pool reads from the config, and ALiBi
            raise ValueError(
                f"kvcompress: --kv-cache-dtype {self.kv_cache_dtype} cannot be served for a model whose "
                "attention has sliding windows, soft-capping, sinks or ALiBi; valid: auto"
            )

    def layer_rotary(self, layer: Any) -> Rotary | None:
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
        remapped = [
            (row, request)
            for row, request in enumerate(ROWS)
            if request is not None and STEP[request].area is not None and STEP[request].computed >= STEP[request].prompt
        ]
        if not remapped:
            return
        seq_lens, slots, table = metadata.seq_lens.clone(), metadata.slot_mapping.clone(), metadata.block_table.clone()
        for row, request in remapped:
            info = STEP[request]
            kept, area = info.kept, torch.tensor(info.area, dtype=table.dtype)
            physical = kept + (info.computed - info.prompt) + torch.arange(info.query)  # where its new tokens go
            slots[starts[row] : starts[row + 1]] = (
                area[physical // block_size].to(slots.dtype) * block_size + physical % block_size
            )
            seq_lens[row] = kept + (info.computed + info.query - info.prompt)
            table[row, : area.shape[0]] = area
            REMAPPED.add(request)
        metadata.seq_lens, metadata.slot_mapping, metadata.block_table = seq_lens, slots, table
        metadata.max_seq_len = int(seq_lens[: len(query_lens)].max())
        metadata.scheduler_metadata = scheduling(
            self, layer, metadata.query_start_loc, seq_lens[: len(query_lens)], metadata.causal, self.model.dtype
        )

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        metadata = step_metadata(layer.layer_name)
        if metadata is not None:  # compressed requests write after their kept tokens
            self.prepare(layer, metadata, kv_cache.shape[2])
            slot_mapping = metadata.slot_mapping[: slot_mapping.shape[0]]
        self.write_pool(layer, key, value, kv_cache, slot_mapping)

    def write_pool(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """vLLM's write into the pool (every write of the plugin's: a held prefix whose blocks it reaches is dropped);
        an fp8 pool gets each element rounded to its nearest e4m3 value first (the CPU build's cast truncates toward
        zero; rounded here, the pool holds what the library's ``fp8`` codec and vLLM's CUDA cast hold, and the cast of
        an e4m3 value is exact)."""
        HELD.forget(str(layer.layer_name), slot_mapping, kv_cache.shape[2])
        if self.coded_pool:
            codec = make_codec("fp8", key.shape[-1], key.dtype)
            key, value = (codec.decode(codec.encode(t)) for t in (key, value))
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: Any = None,
        output_block_scale: Any = None,
    ) -> torch.Tensor:
        if attn_metadata is not None and kv_cache.numel():  # (done at the step's first cache write, unless none)
            self.prepare(layer, attn_metadata, kv_cache.shape[2])
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if attn_metadata is None or kv_cache.numel() == 0:
            return output
        starts = attn_metadata.query_start_loc.tolist()
        finishing: dict[str, list[tuple[slice, str, Finishing]]] = {}  # the step's prompts to compress, by settings
        reads: dict[tuple, torch.Tensor] = {}  # cached prompt parts' keys read back this step, by their blocks
        for row, request in enumerate(ROWS[: len(starts) - 1]):
            if request is None or request in REMAPPED or STEP[request].computed >= STEP[request].prompt:  # decoding
                continue
            info, method = STEP[request], step_method(request)
            compressing = info.kept < info.prompt
            # The step's part of the prompt; after it, a preempted request's recomputed tokens (fed with the prompt).
            ends = min(info.query, info.prompt - info.computed)
            rows, after = slice(starts[row], starts[row] + ends), slice(starts[row] + ends, starts[row + 1])
            needed = method.queries_needed(info.asked) if compressing and not info.recall else 0
            queries = query[rows] if needed is None else query[rows][ends - min(needed, ends) :]
            chunk = (key[rows], value[rows], queries)
            first = info.computed <= info.start  # a first chunk starts afresh
            began, held = (info.start, []) if first else CHUNKS.pop((request, layer.layer_name), (info.computed, []))
            done = info.computed + ends >= info.prompt
            if self.coded_pool or done:  # (an earlier chunk of a 16-bit pool needs none of it)
                keys, values, queries = (torch.cat([part[i] for part in (*held, chunk)]) for i in range(3))
            if self.coded_pool:  # the prompt attends itself as computed, as the library's prefill does
                self.attend_prompt(query[rows], keys, values, output[rows])
            if not done:  # an earlier chunk of a prompt prefilled in chunks: held until the last, copied (the keys
                # live in the step's whole projection)
                computed_keys, computed_values, computed_queries = chunk
                copied = (computed_keys.clone(), computed_values.clone(), computed_queries.clone())
                CHUNKS[(request, layer.layer_name)] = (began, [*held, copied])
                continue
            if not compressing or info.area is None:  # (no area: the scheduler found no room, docs/vllm.md)
                continue
            spans = None if info.recall else self.spans(method, request)
            if spans is not None and spans.shape[-1] != began + keys.shape[0]:  # (never score by another's words)
                raise RuntimeError(
                    f"kvcompress: a prompt of {began + keys.shape[0]} tokens came with {spans.shape[-1]} token ids"
                )
            prompt = finishing_prompt(
                layer, kv_cache, attn_metadata.block_table[row], began, (keys, values, queries), spans, info, reads
            )
            finishing.setdefault(info.settings, []).append((after, request, prompt))
        for group in finishing.values():
            self.compress_together(layer, group, query, key, value, kv_cache, output)
        return output

    def compress_together(
        self,
        layer: Any,
        group: list[tuple[slice, str, Finishing]],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Choose what the prompts one method finishes in this step keep (``kept_together``: each scored alone, chosen
        together; a request recalling an earlier one's choice takes it, ``CHOICES``), and keep each one's choice in
        its area."""
        method = step_method(group[0][1])
        rotary = self.layer_rotary(layer) if method.needs_rotary() else None
        scored = [prompt for _, request, prompt in group if not STEP[request].recall]
        chosen = iter(kept_together(method, scored, self.scale, rotary, self.sinks) if scored else [])
        for after, request, prompt in group:
            info = STEP[request]
            positions = recalled_choice(request, info, layer.layer_name) if info.recall else next(chosen)
            if info.choice is not None and not info.recall:
                CHOICES.setdefault(info.choice, {})[layer.layer_name] = positions.to(torch.int32)
            area = torch.tensor(info.area, dtype=torch.int32)
            self.keep(layer, request, prompt, positions, kv_cache, area, key[after], value[after])
            if after.stop > after.start:  # a recomputed request's generated tokens see the cache its decoding saw
                attend_kept(self, layer, query[after], kv_cache, area, prompt.kept, output[after], self.model.dtype)

    def spans(self, method: Method, request: str) -> torch.Tensor | None:
        """The word spans of ``request``'s prompt, if its method reads them (``[1, prompt]``)."""
        if not method.needs_tokens():
            return None
        if request not in STEP_SPANS:
            tokens = torch.tensor(STEP[request].tokens)[None]
            STEP_SPANS[request] = tokenizer_spans(self.model.tokenizer).span_ids(tokens)
        return STEP_SPANS[request]

    def keep(
        self,
        layer: Any,
        request: str,
        prompt: Finishing,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        later_keys: torch.Tensor,
        later_values: torch.Tensor,
    ) -> None:
        """Write one request's kept tokens (``positions [kv_heads, kept]`` of its prompt) in the first slots of
        ``blocks`` (its own, never a block the prefix cache holds), then ``later_keys``/``later_values`` (the tokens
        a recomputed request had generated) right after them."""
        block_size = kv_cache.shape[2]
        slots = torch.arange(positions.shape[1] + later_keys.shape[0])
        slot_mapping = blocks[slots // block_size].to(torch.long) * block_size + slots % block_size
        # slot s of head h holds the token positions[h, s]
        keys = torch.cat([prompt.keys.at(positions).transpose(0, 1), later_keys])
        values = torch.cat([prompt.values.at(positions).transpose(0, 1), later_values])
        self.write_pool(layer, keys, values, kv_cache, slot_mapping)
        KEPT_POSITIONS.setdefault(request, {})[layer.layer_name] = positions
        while len(KEPT_POSITIONS) > KEPT_RECORDS:
            KEPT_POSITIONS.popitem(last=False)

    def attend_prompt(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, output: torch.Tensor
    ) -> None:
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


class KVCompressCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVCompressCPUImpl]:
        return KVCompressCPUImpl
