"""Speed and memory: decode latency vs context, throughput vs batch, peak memory, the longest context
and largest batch that fit, and a bandwidth view of each decoding step.

Timing does not depend on weight values, so models come from architecture presets with random weights
(``kvcompress.models.ARCHITECTURES``), a config file, or the embedded model. Every run is a fresh prefill (so memory
peaks are each method's own; each shape is first prefilled once, untimed) followed by ``warmup + steps`` single-token
decoding steps; the decode figure is the median step. Runs that run out of memory are recorded as ``oom``, not raised.
"""

from __future__ import annotations

import csv
import ctypes
import gc
import json
import platform
import resource
import statistics
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..cache.kv_cache import KVCompressCache, cache_keyword
from ..cache.layer import KVLayer
from ..cache.tokens import TokenSpans
from ..generation.conversation import Lead
from ..generation.decode import Compile, DecodeState, StepRunner, greedy_step
from ..generation.feed import PREFILL_TOKENS, prefill_groups
from ..methods import Method, method_from_spec
from ..storage import attention
from ..storage.offload import ChunkStore
from ..storage.tensors import synced_clock

# ops that hand a tensor's value to the host
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}

PRESETS: dict[str, dict] = {
    # The CPU check: the embedded model's shape, 1K-8K prompts (8000 leaves room to decode in 8K).
    "quick": {
        "model": "smollm2-135m",
        "methods": ["full", "snapkv", "shadowkv:budget=2048"],
        "lengths": [1024, 2048, 4096, 8000],
        "batches": [1],
        "budget": 1024,
        "steps": 16,
        "warmup": 3,
    },
    # SnapKV Fig. 7 / ShadowKV Table 4 shapes on one GPU.
    "gpu": {
        "model": "llama-3.1-8b",
        "methods": ["full", "snapkv", "shadowkv"],
        "lengths": [16384, 32768, 65536, 131000],
        "batches": [1, 2, 4, 8],
        "budget": 2048,
        "steps": 32,
        "warmup": 5,
    },
}


# compiled decoding: the step that compiles, and on a GPU the warm-up and the capture of its CUDA graph
COMPILING_STEPS = 3


def machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
    return info


def copy_bandwidth(device: torch.device, megabytes: int = 256) -> float:
    """Measured memory bandwidth in bytes/s: best of 5 large copies, counting bytes read and written."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = synced_clock(device)
        target.copy_(source)
        best = min(best, synced_clock(device) - start)
    return 2 * source.numel() * 4 / best


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _return_free_memory()
        try:  # Linux: "5" resets the process's peak resident set size (VmHWM)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def _return_free_memory() -> None:
    """Hand the C allocator's free pages back to the system (glibc), so that a run's resident-set
    peak is not inflated by what earlier, larger runs freed but the process kept."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_available() -> int:
    """Bytes of host memory the system can still give (``MemAvailable``; unlimited where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(error).lower()


def oom_figures(error: BaseException) -> dict:
    """A row's record of an out-of-memory run: the allocator's first line (how much it asked for, how
    much was free) and the innermost kvcompress line that asked, so a report says where, not only that."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "kvcompress" in frame.filename]
    where = f"{frames[-1].filename.rsplit('kvcompress', 1)[-1].lstrip('/')}:{frames[-1].lineno}" if frames else None
    return {
        "status": "oom",
        "error": str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__,
        "where": where,
    }


@dataclass
class Timer:
    """Wall-clock timing with CUDA events on a GPU (no host sync inside the timed region)."""

    device: torch.device

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms_since(self, start) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return 1000 * (time.perf_counter() - start)

    def between(self, start, end) -> float:
        """Milliseconds from one ``start()`` stamp to a later one."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return 1000 * (end - start)


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
    store = getattr(policy, "store", None)
    if not isinstance(store, ChunkStore) or not store.offloaded or not policy.steps:
        return None
    chosen = policy.selected
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


class StandInLead(Lead):
    """What introduces a piece of an observation pass (KVzip's repeat instruction) to a random-weight
    model without a tokenizer: a token per word of the instruction, then the tokens before the piece;
    random prompts have no opening."""

    def introduce(self, row: int, text: str, before: list[int]) -> list[int]:
        return [11] * len(text.split()) + before


stand_in_lead = StandInLead()


def weight_bytes(model: PreTrainedModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prompt_ids(model: PreTrainedModel, length: int, batch: int) -> list[list[int]]:
    """The random prompts of a run of this shape: the same tokens for every method and for transformers' reference."""
    generator = torch.Generator().manual_seed(length * 31 + batch)
    return torch.randint(10, model.config.get_text_config().vocab_size, (batch, length), generator=generator).tolist()


def decode_figures(
    model: PreTrainedModel,
    stats: dict,
    times: list[float],
    prefill_ms: float,
    batch: int,
    bandwidth: float,
    audit: StepAudit,
) -> dict:
    """A run's figures from its timed steps (``times``, ms) and its cache's ``stats``: speed, memory, bytes read
    per step against the machine's bandwidth, and the step's ops."""
    decode_ms = statistics.median(times)
    read = weight_bytes(model) + stats["bytes_read_per_step"]
    return dict(
        prefill_s=prefill_ms / 1000,
        compress_share=stats["compress_s"] / (prefill_ms / 1000),
        **step_figures(decode_ms, batch, read, bandwidth),
        kv_device_bytes=stats["device_bytes"],
        kv_full_bytes=stats["kv_bytes_full"],
        offloaded_bytes=stats["offloaded_bytes"],
        peak_bytes=_peak_bytes(model.device),
        held_bytes=weight_bytes(model) + stats["device_bytes"],
        bytes_read_per_step=read,
        bound_ms_per_token=read / bandwidth * 1000,
        ops_per_step=audit.total,
        host_reads_per_step=sum(audit.host_reads.values()),
        sdpa=attention.sdpa_choices(),
        sdpa_graphed=attention.sdpa_choices(graphed=True),
    )


def step_figures(decode_ms: float, batch: int, read: int, bandwidth: float) -> dict:
    """What follows from a decoding step's time: tokens per second, and the bandwidth its ``read`` bytes took."""
    return dict(
        decode_ms_per_token=decode_ms,
        tokens_per_s=batch * 1000 / decode_ms,
        achieved_bandwidth=read / (decode_ms / 1000),
        bandwidth_fraction=read / (decode_ms / 1000) / bandwidth,
    )


def timed_steps(runner: StepRunner, timer: Timer, run: int, wanted: int) -> list[float]:
    """Milliseconds of up to ``wanted`` decoding steps of at most ``run``: a step that compiled (a new bucket) is
    timed as compile_s, never as decoding."""
    times: list[float] = []
    for _ in range(run):
        if len(times) == wanted:
            break
        start, compiled = timer.start(), runner.compile_steps
        runner.step()
        if runner.compile_steps == compiled:
            times.append(timer.ms_since(start))
    return times


# inference mode: a prefill that recorded autograd history would keep every layer's activations (random
# weights may require grad) and skip the blocked prefill: out of memory at 32K on the 8B shape (H100, 11-26)
@torch.inference_mode()
def measure(
    model: PreTrainedModel,
    method: Method,
    name: str,
    length: int,
    batch: int,
    steps: int,
    warmup: int,
    bandwidth: float,
    compile: Compile | None = None,
    prefill_tokens: int | None = PREFILL_TOKENS,
    replicate: bool = False,
) -> dict:
    """One run: prefill ``batch`` random prompts of ``length`` tokens (in groups of rows of at most
    ``prefill_tokens`` tokens, see ``generation.prefill_groups``; with ``replicate``, one prompt whose
    compressed cache is then copied to every row), then decode greedily (eagerly, or with
    ``compile``); never raises on OOM."""
    device = model.device
    row: dict = {
        "method": name,
        "method_params": method.describe(),
        "prompt_tokens": length,
        "batch": batch,
        "compiled": compile is not None,
        "replicated": replicate,
    }
    timer = Timer(device)
    cache = ids = None
    try:
        _reset_peak(device)
        ids = prompt_ids(model, length, batch)
        start = timer.start()
        cache, logits = _prefill(model, method, ids[:1] if replicate else ids, prefill_tokens)
        prefill_ms = timer.ms_since(start)
        if replicate and batch > 1:  # the decoding and the memory of a batch, without its prefill
            needed = 2 * batch * cache.stats()["offloaded_bytes"]  # the copies, and the rows being copied
            if needed > host_available():  # the OS would kill the process, not raise
                row.update(status="oom", oom="host memory", host_bytes_needed=needed)
                return row
            cache.batch_repeat_interleave(batch)
            logits = logits.expand(batch, -1)
        times, audit, compile_s = _decode(model, cache, logits, length, steps, warmup, compile, timer)
        stats = cache.stats()
        row.update(
            status="ok", **decode_figures(model, stats, times, prefill_ms, batch, bandwidth, audit), compile_s=compile_s
        )
        overlap = fetch_overlap_times(cache.layers[len(cache.layers) // 2], timer)
        if overlap is not None:
            row.update(overlap, value_fetch=stats.get("value_fetch"), chunk_hit_rate=stats.get("chunk_hit_rate"))
    except (RuntimeError, MemoryError) as error:
        if not _is_oom(error):
            raise
        row.update(oom_figures(error))
    finally:
        del cache, ids
        _reset_peak(device)
    return row


def _prefill(
    model: PreTrainedModel, method: Method, ids: torch.Tensor, prefill_tokens: int | None
) -> tuple[KVCompressCache, torch.Tensor]:
    """``ids`` prefilled with ``method``'s cache in groups of rows of at most ``prefill_tokens`` tokens: the cache and
    the last logits."""
    spans = TokenSpans.every(model.config.get_text_config().vocab_size)
    feeder, logits = prefill_groups(
        model, lambda: method.make_cache(model, spans), ids, 0, prefill_tokens, stand_in_lead
    )
    return feeder.cache, logits


def _decode(
    model: PreTrainedModel,
    cache: KVCompressCache,
    logits: torch.Tensor,
    length: int,
    steps: int,
    warmup: int,
    compile: Compile | None,
    timer: Timer,
) -> tuple[list[float], StepAudit, float | None]:
    """Greedy decoding after a prefill of ``length`` tokens: the first step eager (it times the SDPA kernels), one
    more eager with its ops counted (the audit), then the run; the times of the last ``steps``, the audit and the
    seconds compiling took (None: eager)."""
    buckets = compile is not None  # the shapes generate(compile=True) gives this request: its bucket's graph
    run = warmup + steps + COMPILING_STEPS  # steps that compile (and, on a GPU, warm up and capture) are not timed
    batch = logits.shape[0]
    state = DecodeState.start(logits, torch.full((batch,), length, device=model.device), run + 3, set(), buckets)
    cache.reserve(run + 2, buckets)
    runner = StepRunner(model, cache, state, compile)
    runner.step()
    audit = audit_step(lambda held=cache: greedy_step(model, held, state))
    times = timed_steps(runner, timer, run, warmup + steps)
    return times[warmup:], audit, runner.compile_s if compile is not None else None


@torch.inference_mode()
def warm_up(model: PreTrainedModel, method: Method, length: int, batch: int, prefill_tokens: int | None) -> None:
    """One untimed prefill of this shape with ``method`` (as the timed run prefills: a full cache
    would need far more memory at long prompts), so the first timed run does not pay the allocator's
    and kernels' first-use costs (seen as 2-5x slower first prefills on CPU)."""
    try:
        ids = torch.randint(10, model.config.get_text_config().vocab_size, (batch, length)).tolist()
        spans = TokenSpans.every(model.config.get_text_config().vocab_size)
        prefill_groups(model, lambda: method.make_cache(model, spans), ids, 0, prefill_tokens, stand_in_lead)
    except (RuntimeError, MemoryError) as error:
        if not _is_oom(error):
            raise
    finally:
        _reset_peak(model.device)


def _fits(row: dict, max_memory: int | None) -> bool:
    return row["status"] == "ok" and (max_memory is None or row["peak_bytes"] <= max_memory)


def search_limit(try_size, start: int, limit: int, granularity: int) -> tuple[int | None, list[dict]]:
    """Largest size in [start, limit] for which ``try_size(size)`` returns a fitting row: doubling,
    then bisection to ``granularity``. Returns (size or None, every row tried)."""
    tried: list[dict] = []
    good, bad, size = None, None, start
    while size <= limit:
        row = try_size(size)
        tried.append(row)
        if row["fits"]:
            good, size = size, size * 2
        else:
            bad = size
            break
    if good is None:
        return None, tried
    if bad is None and good < limit:
        row = try_size(limit)
        tried.append(row)
        if row["fits"]:
            return limit, tried
        bad = limit
    while bad is not None and bad - good > granularity:
        middle = (good + bad) // 2 // granularity * granularity or good + granularity
        if middle <= good or middle >= bad:
            break
        row = try_size(middle)
        tried.append(row)
        good, bad = (middle, bad) if row["fits"] else (good, middle)
    return good, tried


class Journal:
    """Rows measured so far, one JSON line each in ``rows.jsonl``, so an interrupted run resumes.
    The first line holds the settings; a rerun with other settings is refused, not mixed in."""

    def __init__(self, path: Path, settings: dict) -> None:
        self.path, self.rows = path, {}
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and json.loads(lines[0]).get("settings") != json.loads(json.dumps(settings)):
            raise ValueError(
                f"{path} holds a run with other settings; use another --out folder (or delete it) to start a new run"
            )
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interrupt: measured again
                continue
            self.rows[self.key(row)] = row
        path.write_text("".join(json.dumps(x) + "\n" for x in [{"settings": settings}, *self.rows.values()]))

    @staticmethod
    def key(row: dict) -> tuple:
        return row.get("search"), row["method"], row["prompt_tokens"], row["batch"], row.get("repeat", 0)

    def measure(self, key: tuple, run) -> dict:
        """The row for ``key`` (search, method, prompt tokens, batch, repeat): from the journal, or ``run()`` and
        recorded."""
        if key not in self.rows:
            row = run()
            if key[0]:
                row = {"search": key[0], **row}
            if key[4]:
                row["repeat"] = key[4]
            self.rows[key] = row
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        return self.rows[key]


def _check_grid(model: PreTrainedModel, grid: SpeedGrid) -> int:
    """Refuse, in one line, a grid this model or machine cannot run; return the model's context length."""
    if grid.searching and model.device.type == "cpu" and grid.max_memory is None:
        raise ValueError(
            "on a CPU the limit searches need max_memory (bytes): running out of RAM kills the process "
            "instead of raising"
        )
    for name in ("search_step", "batch_limit", "prefill_tokens", "repeats"):
        value = getattr(grid, name)
        if name == "prefill_tokens":
            value = value or 1  # None: all rows at once
        if value < 1:
            raise ValueError(f"{name}={value} is not a valid setting; valid: an integer of at least 1")
    limit = model.config.get_text_config().max_position_embeddings
    decode_steps = grid.steps + grid.warmup
    too_long = [n for n in grid.lengths if n + decode_steps + 1 > limit]
    if too_long:
        raise ValueError(
            f"prompt lengths {too_long} plus {decode_steps + 1} decoding steps exceed the model's context "
            f"of {limit} tokens"
        )
    return limit


def search_limits(
    fits: Callable[[str, str, int, int], dict],
    methods: list[str],
    max_context: bool,
    max_batch: bool,
    lengths: list[int],
    batches: list[int],
    context_limit: int,
    search_step: int,
    batch_limit: int,
) -> list[dict]:
    """Each method's longest prompt at the first batch size (``max_context``) and largest batch at the first length
    (``max_batch``), by ``search_limit`` over ``fits(kind, spec, length, batch)``."""
    limits = []
    for spec in methods:
        if max_context:
            size, tried = search_limit(
                lambda n: fits("max_context", spec, n, batches[0]), min(lengths), context_limit, search_step
            )
            limits.append({"method": spec, "kind": "max_context", "batch": batches[0], "value": size, "tried": tried})
        if max_batch:
            size, tried = search_limit(lambda b: fits("max_batch", spec, lengths[0], b), 1, batch_limit, 1)
            limits.append(
                {"method": spec, "kind": "max_batch", "prompt_tokens": lengths[0], "value": size, "tried": tried}
            )
    return limits


@dataclass(frozen=True)
class SpeedGrid:
    """What ``bench speed`` runs: every method (a spec, ``name[:field=value...]``) at every prompt length and batch.

    ``budget`` applies to every method with a budget whose spec sets none; ``steps`` timed decoding steps after
    ``warmup`` untimed ones; ``find_max_context`` / ``find_max_batch`` search the limits, within ``max_memory``
    bytes (needed on a CPU), prompts ``search_step`` tokens apart, batches up to ``batch_limit`` (each try a full
    prefill of that batch); ``compile`` decodes with the compiled step (``kvc.generate(compile=True)``); a batch is
    prefilled in groups of rows of at most ``prefill_tokens`` tokens (None: all rows at once); ``replicate``
    prefills one prompt and copies its compressed cache to every row (decoding and memory of a batch at the cost of
    one prefill: batch searches at long prompts); ``repeats`` runs the grid that many times, the methods' order
    reversed every other time, each row its median step over the repeats with every repeat's (``decode_ms_runs``)."""

    methods: list[str]
    lengths: list[int]
    batches: list[int]
    budget: int | None = None
    steps: int = 16
    warmup: int = 3
    find_max_context: bool = False
    find_max_batch: bool = False
    max_memory: int | None = None
    model_name: str = ""
    search_step: int = 1024
    batch_limit: int = 1024
    compile: bool = False
    prefill_tokens: int | None = PREFILL_TOKENS
    replicate: bool = False
    repeats: int = 1

    @property
    def searching(self) -> bool:
        return self.find_max_context or self.find_max_batch

    def settings(self) -> dict[str, Any]:
        """As a report records them (``repeats`` only where the grid repeats)."""
        settings = {("model" if name == "model_name" else name): value for name, value in asdict(self).items()}
        if self.repeats == 1:
            del settings["repeats"]
        return settings


def run_speed(model: PreTrainedModel, grid: SpeedGrid, out_dir: str | Path, progress: bool = True) -> dict:
    """Run ``grid`` (and its limit searches), write ``speed.json``, ``speed.csv`` and plots; return the report.
    Rerunning with the same ``out_dir`` resumes."""
    limit = _check_grid(model, grid)
    built = {spec: method_from_spec(spec, budget=grid.budget) for spec in grid.methods}
    options = Compile() if grid.compile else None
    journal = Journal(Path(out_dir) / "rows.jsonl", grid.settings())
    bandwidth = copy_bandwidth(model.device)

    def run(spec: str, n: int, b: int, r: int, steps: int = grid.steps, warmup: int = grid.warmup) -> dict:
        if r == 0 and spec == grid.methods[0] and warmup > 0:  # warmup=0: no untimed prefill either (memory curves)
            warm_up(model, built[spec], n, b, grid.prefill_tokens)
        method = built[spec]
        return measure(
            model, method, spec, n, b, steps, warmup, bandwidth, options, grid.prefill_tokens, grid.replicate
        )

    rows = run_grid(run, journal, grid.methods, grid.lengths, grid.batches, grid.repeats, bandwidth, progress)
    report = {
        "machine": machine(model.device),
        "model": grid.model_name,
        "dtype": str(next(model.parameters()).dtype),
        "weight_bytes": weight_bytes(model),
        "device_bandwidth": bandwidth,
        "settings": grid.settings(),
        "rows": rows,
        "transformers_ops_per_step": transformers_step_ops(model),
    }
    for row in rows:
        if row["status"] == "ok":
            row["ops_vs_transformers"] = row["ops_per_step"] / report["transformers_ops_per_step"]
    report["peak_slopes"] = peak_slopes(rows, hidden_vector_bytes(model))
    if grid.searching:

        def fits(kind: str, spec: str, n: int, b: int) -> dict:
            row = journal.measure((kind, spec, n, b, 0), lambda: run(spec, n, b, 1, steps=2, warmup=1))
            return {**row, "fits": _fits(row, grid.max_memory)}

        report["limits"] = search_limits(
            fits,
            grid.methods,
            grid.find_max_context,
            grid.find_max_batch,
            grid.lengths,
            grid.batches,
            limit - 8,
            grid.search_step,
            grid.batch_limit,
        )
    write_report(report, Path(out_dir))
    return report


def run_grid(
    run: Callable[[str, int, int, int], dict],
    journal: Journal,
    methods: list[str],
    lengths: list[int],
    batches: list[int],
    repeats: int,
    bandwidth: float,
    progress: bool,
) -> list[dict]:
    """Every (method, length, batch) run ``repeats`` times through the journal, one row each (``with_repeats``). A
    repeat runs the methods in the other order: a drift over the run (heat, other work) falls on both ends."""
    grid = [
        (spec, n, b, r)
        for r in range(repeats)
        for b in batches
        for n in lengths
        for spec in (methods if r % 2 == 0 else methods[::-1])
    ]
    runs: dict[tuple, list[dict]] = {}
    for spec, n, b, r in tqdm(grid, desc="speed", disable=not progress, unit="run"):
        row = journal.measure((None, spec, n, b, r), lambda spec=spec, n=n, b=b, r=r: run(spec, n, b, r))
        runs.setdefault((spec, n, b), []).append(row)
    return [with_repeats(repeated, bandwidth) for repeated in runs.values()]


def with_repeats(rows: list[dict], bandwidth: float) -> dict:
    """One run's row from its repeats: the first's figures, its step time the median of theirs (each repeat's in
    ``decode_ms_runs``), and the speed figures that follow from it."""
    row = dict(rows[0])
    times = [r["decode_ms_per_token"] for r in rows if r["status"] == "ok"]
    if len(rows) == 1 or len(times) < len(rows):
        return row
    row.update(
        decode_ms_runs=times,
        **step_figures(statistics.median(times), row["batch"], row["bytes_read_per_step"], bandwidth),
    )
    return row


def hidden_vector_bytes(model: PreTrainedModel) -> int:
    """Bytes of one token's hidden state: the unit a prefill's memory per prompt token is counted in."""
    return model.config.get_text_config().hidden_size * next(model.parameters()).element_size()


def peak_slopes(rows: list[dict], vector_bytes: int) -> list[dict]:
    """Per method and batch with two or more prompt lengths: how the peak grows per prompt token
    between the shortest and the longest that ran, in bytes and in hidden-sized vectors."""
    slopes = []
    for method, batch in dict.fromkeys((r["method"], r["batch"]) for r in rows):
        ok = sorted(
            (r["prompt_tokens"], r["peak_bytes"])
            for r in rows
            if r["method"] == method and r["batch"] == batch and r["status"] == "ok"
        )
        if len(ok) >= 2 and ok[-1][0] > ok[0][0]:
            per_token = (ok[-1][1] - ok[0][1]) / ((ok[-1][0] - ok[0][0]) * batch)
            slopes.append(
                {
                    "method": method,
                    "batch": batch,
                    "from_tokens": ok[0][0],
                    "to_tokens": ok[-1][0],
                    "bytes_per_token": per_token,
                    "hidden_vectors_per_token": per_token / vector_bytes,
                }
            )
    return slopes


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(report, indent=2))
    fields = sorted(
        {key for row in report["rows"] for key in row},
        key=lambda k: list(report["rows"][0]).index(k) if k in report["rows"][0] else 99,
    )
    with open(out / "speed.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(report["rows"])
    plot_speed(report, out)


def plot_speed(report: dict, out: Path) -> None:
    """decode_latency.png: ms/token vs prompt length per method, a panel per batch (SnapKV Fig. 7);
    throughput.png: tokens/s vs batch per method, a panel per length (ShadowKV Table 4's axis);
    peak_memory.png: peak memory vs prompt length per method, a panel per batch."""
    import matplotlib  # noqa: PLC0415 - only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after its backend is chosen

    ok = [{**r, "peak_gib": r["peak_bytes"] / 2**30} for r in report["rows"] if r["status"] == "ok"]
    methods = list(dict.fromkeys(r["method"] for r in report["rows"]))
    for name, panel_key, x_key, y_key, x_label, y_label in (
        ("decode_latency.png", "batch", "prompt_tokens", "decode_ms_per_token", "prompt tokens", "decode ms/token"),
        ("throughput.png", "prompt_tokens", "batch", "tokens_per_s", "batch size", "tokens/s"),
        ("peak_memory.png", "batch", "prompt_tokens", "peak_gib", "prompt tokens", "peak memory (GiB)"),
    ):
        panels = sorted({r[panel_key] for r in report["rows"]})
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
        for ax, panel in zip(axes.flat, panels):
            for method in methods:
                points = sorted((r[x_key], r[y_key]) for r in ok if r["method"] == method and r[panel_key] == panel)
                if points:
                    ax.plot(*zip(*points), marker="o", label=method)
            for r in report["rows"]:
                if r["status"] == "oom" and r[panel_key] == panel:
                    ax.axvline(r[x_key], color="red", alpha=0.2)
            ax.set_title(f"{panel_key.replace('_', ' ')} {panel}", fontsize=10)
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        fig.suptitle(
            f"{report['model']} ({report['dtype']}) on {report['machine'].get('gpu', report['machine']['device'])}; "
            "red: out of memory",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
