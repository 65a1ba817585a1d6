"""The papers' speed headline, measured against transformers' own ``model.generate`` on the same model and tokens.

SnapKV's abstract (and its Sec. 5.1, Fig. 7): at 16K-token inputs, batch 2 on an A100, a 3.6x faster generation
and 8.2x the memory efficiency of the full cache. This runs, in one process and on one model: transformers'
``model.generate`` with its default cache (greedy; a ``StoppingCriteria`` stamps each token, so the time to the
first token and every later token's time come from generate itself), the same with a 1-token prompt (the step
that reads the weights and nearly no cache: the ceiling on how fast any cache can decode here), then kvcompress's
grid (``speed.run_speed``: each method's prefill, which yields the first token, and its decoding steps) on the same
prompts (``speed.prompt_ids``). The reference runs first, on a model no kvcompress cache has touched (attaching
switches its attention and wraps its modules). Results: ``headline.json`` (the reference rows, the grid's
``speed.json`` beside it) and ``headline.png``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm
from transformers import GenerationMixin, PreTrainedModel, StoppingCriteria

from .device import Timer, is_oom, machine, oom_figures, peak_bytes, reset_peak
from .journal import Journal
from .speed import SpeedGrid, prompt_ids, run_speed

PAPER = {
    "source": "SnapKV (Li et al., 2024), abstract and Sec. 5.1: Mistral-7B on an A100 80GB",
    "prompt_tokens": 16384,
    "batch": 2,
    "decode_speedup": 3.6,
    "memory_ratio": 8.2,
}
# ShadowKV's paper setting: a 1.56% sparse budget, 48 outliers, rank 15.6% of the key width
SHADOWKV_PAPER = "shadowkv:ratio=0.0156:outliers=48:rank_error=none"
METHODS = ["full", "snapkv:budget=1024", "snapkv:budget=2048", SHADOWKV_PAPER]
PRESETS: dict[str, dict] = {
    # The embedded model's shape (random weights, positions to 40K) on the CPU this project tests on.
    "cpu": {
        "model": "smollm2-135m-long",
        "methods": METHODS,
        "lengths": [4096, 16384, 32768],
        "batches": [1, 2],
        "steps": 16,
        "warmup": 3,
    },
    # Llama-3.1-8B's shape (random bf16 weights) on one GPU.
    "gpu": {
        "model": "llama-3.1-8b",
        "methods": METHODS,
        "lengths": [4096, 16384, 32768],
        "batches": [1, 2],
        "steps": 32,
        "warmup": 5,
    },
}
REFERENCE, CEILING = "transformers generate", "weights only"


class StepClock(StoppingCriteria):
    """Stamps the time each generated token is known (after the device finishes it); never stops generation."""

    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.stamps.append(self.timer.start())
        return cast(torch.BoolTensor, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device))


@torch.inference_mode()
def measure_generate(model: PreTrainedModel, name: str, length: int, batch: int, steps: int, warmup: int) -> dict:
    """transformers' ``model.generate`` (default cache, greedy) on ``speed.prompt_ids``' tokens: time to the first
    token, the median time of the ``steps`` tokens after ``warmup`` more, the cache's bytes (from its tensors)."""
    device = model.device
    row: dict = {"method": name, "prompt_tokens": length, "batch": batch}
    timer = Timer(device)
    try:
        reset_peak(device)
        ids = torch.tensor(prompt_ids(model, length, batch), device=device)
        clock = StepClock(timer)
        new = 1 + warmup + steps
        start = timer.start()
        out = cast(GenerationMixin, model).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            stopping_criteria=[clock],
            pad_token_id=0,
            return_dict_in_generate=True,
        )
        gaps = [timer.between(a, b) for a, b in zip(clock.stamps, clock.stamps[1:])]
        decode_ms = statistics.median(gaps[warmup:])
        cache = getattr(out, "cache", None) or out.past_key_values  # 5.24 names it cache, 5.17 past_key_values
        kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        row.update(
            status="ok",
            ttft_s=timer.between(start, clock.stamps[0]) / 1000,
            decode_ms_per_token=decode_ms,
            tokens_per_s=batch * 1000 / decode_ms,
            kv_device_bytes=kv,
            peak_bytes=peak_bytes(device),
        )
        del out, cache
    except (RuntimeError, MemoryError) as error:
        if not is_oom(error):
            raise
        row.update(oom_figures(error))
    finally:
        reset_peak(device)
    return row


@torch.inference_mode()
def warm_up(model: PreTrainedModel, length: int, batch: int) -> None:
    """One untimed ``generate`` of a token at this shape (the allocator's and kernels' first use)."""
    try:
        ids = torch.tensor(prompt_ids(model, length, batch), device=model.device)
        cast(GenerationMixin, model).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0
        )
    except (RuntimeError, MemoryError) as error:
        if not is_oom(error):
            raise
    finally:
        reset_peak(model.device)


def untouched(model: PreTrainedModel) -> None:
    """Raise unless no kvcompress cache has attached to ``model`` (its reference would not be transformers' own)."""
    if getattr(model, "_kvcompress_input_check", False):
        raise ValueError(
            "the headline's reference needs a model no kvcompress cache has attached to (attaching "
            "switches its attention and wraps its modules): build a fresh one"
        )


def run_headline(
    model: PreTrainedModel,
    methods: list[str],
    lengths: list[int],
    batches: list[int],
    out_dir: str | Path,
    steps: int = 16,
    warmup: int = 3,
    model_name: str = "",
    progress: bool = True,
    compile: bool = False,
) -> dict:
    """Measure the reference and the ceiling, then kvcompress's grid, and compare them per prompt length and batch;
    writes ``headline.json`` and ``headline.png`` (and the grid's own files) to ``out_dir``; reruns resume."""
    untouched(model)
    out = Path(out_dir)
    settings = {"model": model_name, "lengths": lengths, "batches": batches, "steps": steps, "warmup": warmup}
    journal = Journal(out / "reference_rows.jsonl", settings)
    shapes = [(CEILING, 1, b) for b in batches] + [(REFERENCE, n, b) for n in lengths for b in batches]
    reference = []
    for name, n, b in tqdm(shapes, desc="transformers", disable=not progress, unit="run"):

        def run(name=name, n=n, b=b) -> dict:
            if warmup > 0:  # an untimed first prefill of this shape, as the grid warms up each shape
                warm_up(model, n, b)
            return measure_generate(model, name, n, b, steps, warmup)

        reference.append(journal.measure((None, name, n, b, 0), run))
    grid = run_speed(
        model,
        SpeedGrid(methods, lengths, batches, steps=steps, warmup=warmup, model_name=model_name, compile=compile),
        out,
        progress=progress,
    )
    report = {
        "machine": machine(model.device),
        "model": model_name,
        "dtype": str(next(model.parameters()).dtype),
        "settings": {**settings, "methods": methods, "compile": compile},
        "paper": PAPER,
        "reference": reference,
        "rows": compare(reference, grid["rows"]),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "headline.json").write_text(json.dumps(report, indent=2))
    plot_headline(report, out / "headline.png")
    return report


def compare(reference: list[dict], rows: list[dict]) -> list[dict]:
    """Each kvcompress row beside transformers' at its prompt length and batch: time to the first token (the
    prefill, whose logits give it) as a ratio, the decoding speedup, the KV memory ratio (transformers' cache bytes
    over the method's device bytes) and the peak's (weights and everything else included), and the ceiling's
    speedup (transformers' step over the weights-only step)."""
    by_shape = {
        (r["prompt_tokens"], r["batch"]): r for r in reference if r["method"] == REFERENCE and r["status"] == "ok"
    }
    ceiling = {r["batch"]: r for r in reference if r["method"] == CEILING and r["status"] == "ok"}
    compared = []
    for row in rows:
        base = by_shape.get((row["prompt_tokens"], row["batch"]))
        if row["status"] != "ok" or base is None:
            compared.append({key: row[key] for key in ("method", "prompt_tokens", "batch", "status")})
            continue
        floor = ceiling.get(row["batch"])
        compared.append(
            {
                "method": row["method"],
                "prompt_tokens": row["prompt_tokens"],
                "batch": row["batch"],
                "status": "ok",
                "ttft_s": row["prefill_s"],
                "ttft_vs_transformers": row["prefill_s"] / base["ttft_s"],
                "decode_ms_per_token": row["decode_ms_per_token"],
                "transformers_ms_per_token": base["decode_ms_per_token"],
                "decode_speedup": base["decode_ms_per_token"] / row["decode_ms_per_token"],
                "kv_device_bytes": row["kv_device_bytes"],
                "memory_ratio": base["kv_device_bytes"] / row["kv_device_bytes"],
                "peak_bytes": row["peak_bytes"],
                "peak_ratio": base["peak_bytes"] / row["peak_bytes"],
                "ceiling_ms_per_token": floor and floor["decode_ms_per_token"],
                "ceiling_speedup": floor and base["decode_ms_per_token"] / floor["decode_ms_per_token"],
            }
        )
    return compared


def plot_headline(report: dict, path: Path) -> None:
    """Two panels per batch: decoding speedup over transformers' generate (the paper's 3.6x and the weights-only
    ceiling drawn) and time to the first token as a ratio to transformers', against the prompt length."""
    import matplotlib  # noqa: PLC0415 - only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after its backend is chosen

    ok = [r for r in report["rows"] if r["status"] == "ok"]
    batches = sorted({r["batch"] for r in ok}) or [1]
    fig, axes = plt.subplots(2, len(batches), figsize=(4.6 * len(batches), 6.4), squeeze=False)
    for column, batch in enumerate(batches):
        speed, ttft = axes[0, column], axes[1, column]
        for method in dict.fromkeys(r["method"] for r in ok):
            points = sorted(
                (r["prompt_tokens"], r["decode_speedup"], r["ttft_vs_transformers"])
                for r in ok
                if r["method"] == method and r["batch"] == batch
            )
            if points:
                lengths, speedups, ratios = zip(*points)
                speed.plot(lengths, speedups, marker="o", label=method)
                ttft.plot(lengths, ratios, marker="o", label=method)
        ceiling = sorted(
            {(r["prompt_tokens"], r["ceiling_speedup"]) for r in ok if r["batch"] == batch and r["ceiling_speedup"]}
        )
        if ceiling:
            speed.plot(*zip(*ceiling), linestyle=":", color="black", label="ceiling (weights-only step)")
        if batch == PAPER["batch"]:
            speed.scatter(
                [PAPER["prompt_tokens"]],
                [PAPER["decode_speedup"]],
                marker="*",
                s=120,
                color="red",
                label="SnapKV paper (A100)",
            )
        speed.axhline(1.0, color="grey", linewidth=0.8)
        ttft.axhline(1.0, color="grey", linewidth=0.8)
        speed.set_title(f"batch {batch}: decoding speedup over transformers", fontsize=9)
        ttft.set_title(f"batch {batch}: time to first token / transformers'", fontsize=9)
        for ax in (speed, ttft):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.grid(alpha=0.3)
        speed.set_ylim(bottom=0)
    axes[0, 0].legend(fontsize=7)
    device = report["machine"].get("gpu", report["machine"]["device"])
    fig.suptitle(f"{report['model']} ({report['dtype']}) on {device}, torch {report['machine']['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
