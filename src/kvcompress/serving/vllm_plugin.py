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

import atexit
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from .launch import quiet_teardown
from .settings import ENGINE_ENV
from .vllm_requests import Plan, Scheduled, StepMethods, engine_method, request_plan
from .vllm_worker import CHOICES, CHUNKS, STEP, STEP_SPANS, KVCompressCPUBackend


def register() -> None:
    """The ``vllm.general_plugins`` entry point: use kvcompress's backend where vLLM uses CPU_ATTN."""
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{KVCompressCPUBackend.__module__}.KVCompressCPUBackend")
    if ENGINE_ENV in os.environ:  # a process of `kvcompress serve`'s server (its engine's too): a quiet teardown
        atexit.register(quiet_teardown)


class KVCompressConnector(KVConnectorBase_V1):
    """Carries each request's method and blocks from the scheduler to the workers; it moves no KV."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.default = engine_method(vllm_config)
        self.coded_pool = is_quantized_kv_cache(vllm_config.cache_config.cache_dtype)
        self.plans: dict[str, Plan] = {}  # scheduler side: request id -> its compression
        self.requests: dict[str, Any] = {}  # and vLLM's request (its prompt, its progress)

    # --- the scheduler's side -------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self.plans[request.request_id] = request_plan(request, self.default)
        self.requests[request.request_id] = request

    def compresses(self, request: Any) -> bool:
        """Whether ``request``'s method keeps fewer tokens than its prompt has."""
        return self.plans[request.request_id].compresses(request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # nothing to load from elsewhere

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> StepMethods:
        """Each scheduled request's method, prompt and progress (called before the step advances requests); the
        scheduler adds their blocks (``KVCompressScheduler.schedule``)."""
        requests = {}
        for request_id, query in scheduler_output.num_scheduled_tokens.items():
            plan, request = self.plans.get(request_id), self.requests.get(request_id)
            if plan is None or request is None:
                continue
            prefilling = request.num_computed_tokens < request.num_prompt_tokens
            requests[request_id] = Scheduled(
                plan.settings,
                request.num_prompt_tokens,
                request.num_computed_tokens,
                query,
                plan.kept,
                plan.asked,
                tokens=list(request.prompt_token_ids) if plan.method.needs_tokens() and prefilling else None,
            )
        return StepMethods(requests, set())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.plans.pop(request.request_id, None)
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
        for choice in connector_metadata.forget:
            CHOICES.pop(choice, None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
