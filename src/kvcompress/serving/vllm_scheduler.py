"""The plugin in vLLM's scheduler: prefix caching kept on, each compressing request's hit cut to what its method
reads, its compressed cache in blocks of its own, its prompt's blocks let go once compressed."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from ..methods.fields import InvalidParameterError
from . import vllm_seam as seam
from .settings import scorable
from .vllm_plugin import KVCompressConnector
from .vllm_requests import Recalled, StepMethods, request_plan

logger = init_logger(__name__)


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
        return (
            [block.block_id for block in later]
            if self.first is None
            else [block.block_id for block in (*self.own, *later)]
        )

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

    vLLM's private state it touches goes through ``vllm_seam``, but for the override of
    ``_get_local_prefix_cache_hit`` (docs/vllm.md, "Upstream proposal", item 4)."""

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
        self.recalled = Recalled()  # the choices of kept tokens the workers hold, by request key
        self.coded_pool = self.connector.coded_pool
        self.width = -(-self.vllm_config.model_config.max_model_len // self.block_size)  # a worker's block table row

    def add_request(self, request: Any) -> None:  # bad settings refused by name before vLLM holds the request
        method = scorable(request_plan(request, self.connector.default).method, self.vllm_config.model_config.hf_config)
        if method.needs_tokens() and request.prompt_token_ids is None:
            raise InvalidParameterError(
                f"kvcompress: {method.name} reads the prompt's words (clustering='spans'), and "
                "this prompt came as embeddings; use the setting clustering='pool'"
            )
        super().add_request(request)

    def _get_local_prefix_cache_hit(self, request: Any) -> tuple[Any, int, int, bool]:
        """vLLM's prefix-cache hit, cut so that a compressing request computes the last prompt queries its method
        reads (SnapKV's window; none of a prompt for a method that reads every query, H2O's and ExpectedAttention's),
        and no more: a cut inside a block takes that block's earlier tokens from the cache (vLLM copies the block for
        the request, as for any hit that ends inside one); unless the workers hold its choice already (``Recalled``).
        An fp8 pool's requests take none (their prompts attend themselves as computed)."""
        blocks, hit, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        allowed = hit
        if self.coded_pool:
            allowed = 0
        elif (
            request.request_id in self.connector.plans
            and self.connector.compresses(request)
            and not self.recalled.recall(request.request_id, self.connector.plans[request.request_id].choice)
        ):
            plan = self.connector.plans[request.request_id]
            needed = plan.method.queries_needed(plan.asked)
            allowed = 0 if needed is None else max(request.num_prompt_tokens - needed, 0)
        if hit > allowed:  # (ending inside a block: vLLM gives the request its own copy of that block, copy-on-write)
            whole = -(-allowed // self.block_size) * self.block_size
            blocks, hit = self.kv_cache_manager.truncate_computed_blocks(blocks, whole), allowed
        self.hits[request.request_id] = hit
        return blocks, hit, boundary, diverged

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        step: StepMethods = output.kv_connector_metadata
        tables = seam.block_tables(self)
        for request_id in [r for r, area in self.areas.items() if not area.held(tables.get(r, []))]:
            del self.areas[request_id]  # ended or preempted: vLLM freed its blocks
        for request_id, info in step.requests.items():
            request, plan = self.requests[request_id], self.connector.plans[request_id]
            info.recall = plan.choice is not None and self.recalled.using.get(request_id) == plan.choice
            if info.recall:  # (nothing scored: no token ids)
                info.choice, info.tokens = plan.choice, None
            if (
                request_id not in self.areas
                and self.connector.compresses(request)
                and info.computed < request.num_prompt_tokens <= info.computed + info.query
            ):
                taken = self.take_area(request, output)
                if taken and not info.recall and plan.choice is not None:  # its workers keep what it keeps
                    info.choice = plan.choice
                    self.recalled.recorded(plan.choice)
            area, table = self.areas.get(request_id), tables.get(request_id, [])
            info.start = self.hits.get(request_id, 0)
            info.area = None if area is None else area.blocks(table)
            if self.connector.compresses(request) or (self.coded_pool and info.computed < info.prompt):
                info.row = area.row(table) if area is not None else [block.block_id for block in table]
        self.recalled.done(  # (vLLM advanced each scheduled request's computed tokens already)
            {
                r
                for r in self.recalled.using
                if r in self.requests and self.requests[r].num_computed_tokens < self.requests[r].num_prompt_tokens
            }
        )
        step.live = {request_id for request_id in self.connector.plans if tables.get(request_id)}
        step.forget = self.recalled.tell()
        return output

    def take_area(self, request: Any, output: Any) -> bool:
        """Blocks for the compressed cache of a request whose prompt's last step is scheduled: room for what its
        method keeps and every token it may generate, from the pool, the first appended to its worker's row (in this
        step's output); where the pool has no room, its prompt's own last blocks no other request holds (dropped
        from the prefix cache), if they hold what it keeps; else, once this step gives its first token (from the
        whole prompt, as the library's), it is preempted, as vLLM preempts a request it has no blocks for, and
        recomputed (its prompt from the prefix cache) when there is room. Whether it has its area."""
        request_id, block_size = request.request_id, self.block_size
        kept = self.connector.plans[request_id].kept
        needed = -(-(kept + request.max_tokens) // block_size)
        table = seam.table_of(self, request_id)
        prompt = [block.block_id for block in table]
        mine = [i for i, block in enumerate(table) if block.ref_cnt == 1 and not block.is_null]
        if seam.free_blocks(self) >= needed and len(table) < self.width:
            self.areas[request_id] = Area(seam.side_blocks(self, output, request_id, needed), prompt)
        elif (
            mine
            and mine == list(range(mine[0], len(table)))
            and len(mine) * block_size >= (kept + len(table) * block_size - request.num_prompt_tokens)
        ):  # the rest grows as vLLM's table does
            own = table[mine[0] : mine[0] + needed]
            seam.evict(self, own)
            self.areas[request_id] = Area(own, prompt, mine[0])
        else:  # after this step (its first token, from the whole prompt), recomputed once there is room
            self.waiting_room.add(request_id)
            return False
        seam.stop_caching(self, request_id)  # nothing of it offered to the prefix cache from now on
        return True

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self.peak_running = max(self.peak_running, len(self.running))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in [r for r in self.running if r.request_id in self.waiting_room]:
            self.waiting_room.discard(request.request_id)
            seam.preempt(self, request)
            self.preempted += 1
            logger.info(
                "kvcompress: request %s preempted, to be recomputed: no room for its compressed cache",
                request.request_id,
            )
        self.waiting_room.clear()  # (ended this step)
        for request in self.running:
            area = self.areas.get(request.request_id)
            if area is not None and not area.freed and request.num_computed_tokens >= request.num_prompt_tokens:
                self.release_prompt(request.request_id, area)
        return outputs

    def release_prompt(self, request_id: str, area: Area) -> None:
        """Once a prompt is compressed, let its prompt's blocks go but its area's (vLLM's null block in their place,
        as vLLM frees a sliding window's): those the prefix cache holds stay cached for the next request."""
        count = len(area.prompt)
        table = seam.table_of(self, request_id)
        before = seam.held(self, table[:count])
        if area.first is not None:  # in place: what follows its own blocks, then what precedes them
            seam.free_range(self, request_id, area.first + len(area.own), count)
        seam.free_range(self, request_id, 0, count if area.first is None else area.first)
        area.freed = True
        self.blocks_before_after.setdefault(request_id, (before, len(area.blocks(table))))  # the first compression
