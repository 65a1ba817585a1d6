"""What one decoding step does, counted: its ops and fused kernels, the values it hands to the host (each one a
synchronization), transformers' own step's ops, and how much of an offloaded store's fetch its work hides."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, PreTrainedModel

from ..cache.kv_cache import cache_keyword
from ..cache.layer import KVLayer
from ..methods.sparse import SparseDecodePolicy
from .device import Timer

# ops that hand a tensor's value to the host
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}


class OverlapProbe(NamedTuple):
    """Parts of a decoding step timed apart: a read from an offload store alone, the work the step overlaps with it
    alone, and both as the step runs them (``concurrent``: on a side stream)."""

    fetch: Callable[[], Any]
    work: Callable[[], Any]
    both: Callable[[], Any]
    concurrent: bool


def overlap_probe(layer: KVLayer) -> OverlapProbe | None:
    """For a layer that reads an offload store while decoding (a sparse method's policy: its ``store``, the chunks
    its last step ``selected`` and the keys it ``rebuild_keys`` meanwhile), the parts of its last step; None before
    a step."""
    policy = layer.policy
    if not isinstance(policy, SparseDecodePolicy) or policy.store is None or not policy.store.offloaded:
        return None
    store, chosen = policy.store, policy.selected
    if chosen is None or not policy.steps:
        return None
    return OverlapProbe(
        fetch=lambda: store.fetch(chosen, None, None, None, overlap=lambda: None),
        work=lambda: policy.rebuild_keys(chosen),
        both=lambda: store.fetch(chosen, None, None, None, overlap=lambda: policy.rebuild_keys(chosen)),
        concurrent=store.stream is not None,
    )


def fetch_overlap_times(layer: KVLayer, timer: Timer, repeats: int = 10) -> dict | None:
    """For a layer that reads an offload store while decoding (``overlap_probe``): median ms
    of the store read alone (every selected chunk, no reuse), the work overlapped with it alone
    (ShadowKV: the key rebuild), and both as a decoding step runs them. ``fetch_hidden`` is the share
    of the read's time that overlapping removes from the step, (fetch + work - both) / fetch,
    between 0 and 1; None without a side stream (on a CPU both run in order: any difference is noise)."""
    probe = overlap_probe(layer)
    if probe is None:
        return None

    def median_ms(run) -> float:
        times = []
        for _ in range(repeats):
            start = timer.start()
            run()
            times.append(timer.ms_since(start))
        return statistics.median(times)

    fetch, work, both = median_ms(probe.fetch), median_ms(probe.work), median_ms(probe.both)
    return {
        "layer_fetch_ms": fetch,
        "layer_work_ms": work,
        "layer_fetch_and_work_ms": both,
        "fetch_hidden": min(1.0, max(0.0, (fetch + work - both) / max(fetch, 1e-9))) if probe.concurrent else None,
    }


class StepAudit(TorchDispatchMode):
    """The ops a step dispatches, by name (a fused ``kvcompress`` op counts once: it launches one
    kernel on a GPU), and those that read a value back to the host (``HOST_READS``, or a copy from a
    GPU to the host), which would stall the host until the GPU caught up. ``record_fused`` keeps the
    fused ops' inputs (``fused_calls``), so their torch implementations can be counted too."""

    def __init__(self, record_fused: bool = False) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.host_reads: Counter = Counter()
        self.record_fused = record_fused
        self.fused_calls: list[tuple[str, tuple[tuple, dict]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if self.record_fused and name.startswith("kvcompress."):
            self.fused_calls.append(
                (name, (tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs or {})))
            )
        out = func(*args, **(kwargs or {}))
        asynchronous = (
            name == "aten.copy_"
            and bool(args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking"))
            and args[0].is_pinned()
        )
        to_host = (
            name in ("aten._to_copy", "aten.copy_")
            and isinstance(out, torch.Tensor)
            and out.device.type == "cpu"
            and not asynchronous
            and any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
        )
        if name.split(".")[-1] in HOST_READS or to_host:
            self.host_reads[name] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def audit_step(step: Callable[[], Any], record_fused: bool = False) -> StepAudit:
    """Run one step under a ``StepAudit``."""
    with StepAudit(record_fused) as audit:
        step()
    return audit


@torch.inference_mode()
def transformers_step_ops(model: PreTrainedModel) -> int:
    """Ops one decoding step of plain transformers dispatches (its own cache, after a 16-token prompt): the
    reference."""
    cache = DynamicCache(config=model.config)
    ids = torch.randint(10, model.config.get_text_config().vocab_size, (1, 16), device=model.device)
    keyword = cache_keyword(model)
    token = model(ids, **{keyword: cache}, logits_to_keep=1).logits[:, -1:].argmax(-1)
    return audit_step(lambda: model(token, **{keyword: cache}, logits_to_keep=1)).total
