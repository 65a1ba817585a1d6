"""Speed and memory: decode latency vs context, throughput vs batch, peak memory, the longest context
and largest batch that fit, and a bandwidth view of each decoding step.

Timing does not depend on weight values, so models come from architecture presets with random weights
(``kvcompress.models.ARCHITECTURES``), a config file, or the embedded model. Every run is a fresh prefill (so memory
peaks are each method's own; each shape is first prefilled once, untimed) followed by ``warmup + steps`` single-token
decoding steps; the decode figure is the median step. Runs that run out of memory are recorded as ``oom``, not raised.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from ..cache.kv_cache import KVCompressCache
from ..cache.tokens import TokenSpans
from ..generation.conversation import Lead
from ..generation.decode import Compile, DecodeState, StepRunner, greedy_step
from ..generation.feed import PREFILL_TOKENS, prefill_groups
from ..methods import Method, method_from_spec
from ..methods.fields import InvalidParameterError, setting
from .audit import StepAudit, audit_step, fetch_overlap_times, transformers_step_ops
from .device import Timer, copy_bandwidth, host_available, is_oom, machine, oom_figures, reset_peak
from .figures import decode_figures, hidden_vector_bytes, peak_slopes, weight_bytes, with_repeats
from .journal import Journal
from .limits import fits_memory, search_limits

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


class StandInLead(Lead):
    """What introduces a piece of an observation pass (KVzip's repeat instruction) to a random-weight
    model without a tokenizer: a token per word of the instruction, then the tokens before the piece;
    random prompts have no opening."""

    def introduce(self, row: int, text: str, before: list[int]) -> list[int]:
        return [11] * len(text.split()) + before


stand_in_lead = StandInLead()


def prompt_ids(model: PreTrainedModel, length: int, batch: int) -> list[list[int]]:
    """The random prompts of a run of this shape: the same tokens for every method and for transformers' reference."""
    generator = torch.Generator().manual_seed(length * 31 + batch)
    return torch.randint(10, model.config.get_text_config().vocab_size, (batch, length), generator=generator).tolist()


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
        reset_peak(device)
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
        if not is_oom(error):
            raise
        row.update(oom_figures(error))
    finally:
        del cache, ids
        reset_peak(device)
    return row


def _prefill(
    model: PreTrainedModel, method: Method, ids: list[list[int]], prefill_tokens: int | None
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
    audit = audit_step(lambda: greedy_step(model, cache, state))
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
        if not is_oom(error):
            raise
    finally:
        reset_peak(model.device)


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
            raise InvalidParameterError(
                setting(name) + " is not a valid setting; valid: an integer of at least 1", **{name: value}
            )
    limit = model.config.get_text_config().max_position_embeddings
    decode_steps = grid.steps + grid.warmup
    too_long = [n for n in grid.lengths if n + decode_steps + 1 > limit]
    if too_long:
        raise ValueError(
            f"prompt lengths {too_long} plus {decode_steps + 1} decoding steps exceed the model's context "
            f"of {limit} tokens"
        )
    return limit


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
    settings = grid.settings()
    journal = Journal(Path(out_dir) / "rows.jsonl", settings)
    bandwidth = copy_bandwidth(model.device)

    def measured(spec: str, n: int, b: int, steps: int, warmup: int) -> dict:
        method = built[spec]
        return measure(
            model, method, spec, n, b, steps, warmup, bandwidth, options, grid.prefill_tokens, grid.replicate
        )

    def run(spec: str, n: int, b: int, r: int) -> dict:
        if r == 0 and spec == grid.methods[0] and grid.warmup > 0:  # warmup=0: no untimed prefill (memory curves)
            warm_up(model, built[spec], n, b, grid.prefill_tokens)
        return measured(spec, n, b, grid.steps, grid.warmup)

    rows = run_grid(run, journal, grid.methods, grid.lengths, grid.batches, grid.repeats, bandwidth, progress)
    report = {
        "machine": machine(model.device),
        "model": grid.model_name,
        "dtype": str(next(model.parameters()).dtype),
        "weight_bytes": weight_bytes(model),
        "device_bandwidth": bandwidth,
        "settings": settings,
        "rows": rows,
        "transformers_ops_per_step": transformers_step_ops(model),
    }
    for row in rows:
        if row["status"] == "ok":
            row["ops_vs_transformers"] = row["ops_per_step"] / report["transformers_ops_per_step"]
    report["peak_slopes"] = peak_slopes(rows, hidden_vector_bytes(model))
    if grid.searching:

        def fits(kind: str, spec: str, n: int, b: int) -> dict:
            row = journal.measure((kind, spec, n, b, 0), lambda: measured(spec, n, b, 2, 1))
            return {**row, "fits": fits_memory(row, grid.max_memory)}

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
    from .plots import plot_speed  # noqa: PLC0415 - only to draw

    plot_speed(report, out)
