"""What the command line prints of each command's results: tables and lines built from what the library returns
(a result's stats, the methods' fields, a benchmark's rows), so the command line (cli/) only parses, checks and calls.

Each function returns the renderables in order (``rich`` tables and strings); the caller prints them.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ..methods import METHODS, field_specs


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def fmt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def stats_table(stats: dict) -> Table:
    """A generation's stats (``Result.stats``), one row each."""
    table = Table("stat", "value", title="KV cache")
    for key, value in stats.items():
        if key == "kv_tokens_per_layer":
            value = f"{min(value)}..{max(value)} (per KV head, {len(value)} layers)"
        elif key.startswith("kv_bytes"):
            value = f"{value} ({mib(value)})"
        elif isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(key, str(value))
    return table


def compressed(out: str, size: int, stats: dict) -> str:
    """What ``kvcompress compress`` wrote (``size``: the file's bytes) and how to ask it."""
    return (
        f"wrote {out}: {mib(size)} for {stats['prompt_tokens']} prompt tokens ({mib(stats['device_bytes'])} on "
        f"the device, {mib(stats['offloaded_bytes'])} offloaded; compressed in {stats['compress_s']:.1f} s); "
        f"ask with: kvcompress generate --past {out} --prompt QUESTION"
    )


def methods() -> list[Any]:
    """Every method with its flags: default, valid values, what each sets."""
    shown: list[Any] = []
    for name, cls in METHODS.items():
        summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", "")
        table = Table("flag", "default", "valid", "what it sets", title=f"{name}: {summary}", title_justify="left")
        defaults = cls().settings()
        for spec in field_specs(cls):
            default = defaults.get(spec.name)
            table.add_row(spec.flag, "-" if default is None else str(default), spec.valid(), spec.help)
        shown.append(table if table.rows else f"{name}: {summary} (no settings)")
    return shown


def demo(rows: list[Any]) -> list[Any]:
    """The demo's answers and what each method held."""
    table = Table(
        "method",
        "answer ends",
        "correct",
        "KV/head",
        "KV kept",
        "of full",
        "on device",
        "prefill s",
        "ms/token",
        title="kvcompress demo",
    )
    for row in rows:
        s = row.stats
        table.add_row(
            row.label,
            row.answer[-24:],
            "yes" if row.correct else "no",
            str(max(s["kv_tokens_per_layer"])),
            mib(s["kv_bytes_kept"]),
            f"{100 * s['kv_kept_fraction']:.1f}%",
            mib(s["device_bytes"]),
            f"{s['prefill_s']:.2f}",
            ms(s["decode_ms_per_token"]),
        )
    first = rows[0].stats
    return [
        table,
        f"prompt: {first['prompt_tokens']} tokens; full KV cache {mib(first['kv_bytes_full'])}; on device: "
        "kept tokens plus room for the tokens to generate and each method's index",
    ]


def accuracy(rows: list[dict]) -> Table:
    """``bench accuracy``'s summary, a row per task, method and budget."""
    table = Table(
        "task",
        "method",
        "budget",
        "n",
        "score",
        "retained",
        "top-1 agr.",
        "KL",
        "KV kept",
        "device",
        title="accuracy summary",
    )
    for row in rows:
        table.add_row(
            row["task"],
            row["label"],
            fmt(row["budget"]),
            str(row["samples"]),
            fmt(row["score"]),
            fmt(row["retained"]),
            fmt(row["top1_agreement"]),
            fmt(row["kl"]),
            f"{row['kv_kept_fraction']:.1%}",
            f"{row['device_fraction']:.1%}",
        )
    return table


def machine(model: str, report: dict, weights: bool = False) -> str:
    """The model and the machine a benchmark ran on."""
    info = report["machine"]
    size = f", weights {mib(report['weight_bytes'])}" if weights else ""
    return (
        f"{model} ({report['dtype']}{size}) on {info.get('gpu', info['device'])}, torch {info['torch']}, "
        f"transformers {info['transformers']}, {info['cpu_threads']} threads"
    )


def headline(model: str, report: dict, compiled: bool, out: str) -> list[Any]:
    """``bench headline``: transformers' own runs, kvcompress's grid against them, the paper's figures."""
    shown: list[Any] = [machine(model, report)]
    for row in report["reference"]:
        if row["status"] == "ok":
            shown.append(
                f"{row['method']}: {row['prompt_tokens']} tokens x {row['batch']}: first token "
                f"{row['ttft_s']:.2f} s, {row['decode_ms_per_token']:.1f} ms/token, "
                f"KV {mib(row['kv_device_bytes'])}"
            )
    table = Table(
        "method",
        "prompt",
        "batch",
        "TTFT s",
        "TTFT ratio",
        "ms/token",
        "transformers",
        "speedup",
        "ceiling",
        "KV MiB",
        "memory",
        "peak",
        title="against transformers' generate" + (" (compiled decoding)" if compiled else ""),
    )
    for r in report["rows"]:
        if r["status"] != "ok":
            table.add_row(r["method"], str(r["prompt_tokens"]), str(r["batch"]), r["status"], *["-"] * 8)
            continue
        table.add_row(
            r["method"],
            str(r["prompt_tokens"]),
            str(r["batch"]),
            f"{r['ttft_s']:.2f}",
            f"{r['ttft_vs_transformers']:.2f}x",
            f"{r['decode_ms_per_token']:.1f}",
            f"{r['transformers_ms_per_token']:.1f}",
            f"{r['decode_speedup']:.2f}x",
            fmt(r["ceiling_speedup"] and f"{r['ceiling_speedup']:.2f}x"),
            f"{r['kv_device_bytes'] / 2**20:.1f}",
            f"{r['memory_ratio']:.1f}x",
            f"{r['peak_ratio']:.2f}x",
        )
    paper = report["paper"]
    return [
        *shown,
        table,
        f"the paper: {paper['decode_speedup']}x decoding and {paper['memory_ratio']}x memory at "
        f"{paper['prompt_tokens']} tokens, batch {paper['batch']} ({paper['source']}); ceiling: transformers' step "
        "over the weights-only step",
        *out_of_memory_lines(report["reference"] + report["rows"]),
        f"wrote {out}/headline.json, headline.png, speed.json",
    ]


SPEED_COLUMNS = (
    "method",
    "prompt",
    "batch",
    "prefill s",
    "compress",
    "ms/token",
    "bound ms",
    "tokens/s",
    "KV dev MiB",
    "offload MiB",
    "peak MiB",
    "GB/s read",
    "of copy bw",
    "ops/step",
)


def _speed_table(report: dict, compiled: bool) -> Table:
    """``bench speed``'s grid, a row per (method, prompt, batch); in brackets the decoding time's spread."""
    table = Table(*SPEED_COLUMNS, title="speed" + (" (compiled decoding)" if compiled else ""))
    for r in report["rows"]:
        if r["status"] != "ok":
            table.add_row(r["method"], str(r["prompt_tokens"]), str(r["batch"]), r["status"], *["-"] * 10)
            continue
        spread = f" ({min(r['decode_ms_runs']):.1f}-{max(r['decode_ms_runs']):.1f})" if "decode_ms_runs" in r else ""
        table.add_row(
            r["method"],
            str(r["prompt_tokens"]),
            str(r["batch"]),
            f"{r['prefill_s']:.2f}",
            f"{r['compress_share']:.1%}",
            f"{r['decode_ms_per_token']:.1f}{spread}",
            f"{r['bound_ms_per_token']:.1f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['kv_device_bytes'] / 2**20:.1f}",
            f"{r['offloaded_bytes'] / 2**20:.1f}",
            f"{r['peak_bytes'] / 2**20:.0f}",
            f"{r['achieved_bandwidth'] / 1e9:.1f}",
            f"{r['bandwidth_fraction']:.0%}",
            f"{r['ops_per_step']} ({r['ops_vs_transformers']:.2f}x)",
        )
    return table


def speed(model: str, report: dict, compiled: bool, out: str) -> list[Any]:
    """``bench speed``: the grid, the peak's slope per prompt token, offload overlaps and the limits searched."""
    shown: list[Any] = [
        f"{machine(model, report, weights=True)}; measured copy bandwidth {report['device_bandwidth'] / 1e9:.1f} GB/s",
        _speed_table(report, compiled),
    ]
    repeats = report["settings"].get("repeats", 1)
    if repeats > 1:
        shown.append(
            f"ms/token: the median of {repeats} runs of the grid, the methods' order reversed every other run "
            "(in brackets: the fastest and slowest run)"
        )
    for slope in report.get("peak_slopes", []):
        shown.append(
            f"{slope['method']} x {slope['batch']}: the peak grows {slope['bytes_per_token'] / 1024:.2f} KiB "
            f"per prompt token ({slope['hidden_vectors_per_token']:.2f} hidden-sized vectors) from "
            f"{slope['from_tokens']} to {slope['to_tokens']} tokens"
        )
    for r in (r for r in report["rows"] if "fetch_hidden" in r):
        share = r["fetch_hidden"]
        hidden = "no side stream here" if share is None else format(share, ".0%") + " of the fetch hidden"
        shown.append(
            f"{r['method']} {r['prompt_tokens']} x {r['batch']}: one layer's store read "
            f"{r['layer_fetch_ms']:.3f} ms ({r['value_fetch']}), the work overlapped with it "
            f"{r['layer_work_ms']:.3f} ms, both {r['layer_fetch_and_work_ms']:.3f} ms: {hidden}; chunk hit "
            f"rate {fmt(r['chunk_hit_rate'])}"
        )
    for limit in report.get("limits", []):
        shown.append(f"{limit['method']}: {limit['kind']} = {limit['value']} ({len(limit['tried'])} runs tried)")
    shown.extend(out_of_memory_lines(report["rows"]))
    return [*shown, f"wrote {out}/speed.json, speed.csv, decode_latency.png, throughput.png, peak_memory.png"]


def out_of_memory_lines(rows: list[dict]) -> list[str]:
    """One line per run that ran out of device memory: what the allocator said and where."""
    return [
        f"{r['method']} {r['prompt_tokens']} x {r['batch']}: out of memory at {r['where']}: {r['error']}"
        for r in rows
        if r.get("status") == "oom" and r.get("error")
    ]


def shared_context(summary: dict, out: str) -> list[Any]:
    """``bench shared-context``: per mode, each method's answers right by turn, and against the full cache's."""
    shown: list[Any] = []
    for mode, methods in summary.items():
        turns = max((len(row["score"]) for row in methods.values()), default=0)
        table = Table(
            "method", *(f"turn {t + 1}" for t in range(turns)), title=f"{mode}: answers right (of the full cache's)"
        )
        for spec, row in methods.items():
            table.add_row(
                spec, *(f"{s:.2f}" + ("" if f is None else f" ({f:.2f})") for s, f in zip(row["score"], row["of_full"]))
            )
        shown.append(table)
        measured = {spec: row for spec, row in methods.items() if "agreement" in row}
        if measured:
            agreed = Table(
                "method",
                *(f"turn {t + 1}" for t in range(turns)),
                title=f"{mode}: the full cache's answer teacher-forced, top-1 agreement [95% interval]",
            )
            for spec, row in measured.items():
                agreed.add_row(
                    f"{spec} ({row['contexts']} contexts)",
                    *(
                        f"{a:.3f} [{low:.3f}, {high:.3f}]"
                        for a, (low, high) in zip(row["agreement"], row["agreement_95"])
                    ),
                )
            shown.append(agreed)
    return [*shown, f"wrote {out}/results.jsonl, summary.json, shared_context.png"]


def observations(results: dict, tokens: int) -> Table:
    """``kvcompress observe``'s summary: each measurement on this model beside the paper's."""
    table = Table("measurement", "this model", "the paper", title=f"observations ({tokens}-token document)")
    for row in observation_rows(results):
        table.add_row(*row)
    return table


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _percent(share: float | None) -> str | None:
    return None if share is None else f"{100 * share:.2f}%"


def observation_rows(results: dict) -> list[tuple[str, str, str]]:
    """(measurement, this model, the paper's) rows: layer means where a measurement is per layer."""
    spans = results["snapkv_along_generation"]["per_span"]
    by_span = [
        _mean([layer[i] for layer in spans if i < len(layer)]) for i in range(max(len(layer) for layer in spans))
    ]
    ranks = results["shadowkv_spectra"]["ranks_90"]
    fmt = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
    svd = results["shadowkv_svd_share"]
    rank_rows = results["shadowkv_rank_accuracy"]
    return [
        (
            "SnapKV: H along generation, per window of answer tokens",
            " / ".join(fmt(v) for v in by_span),
            "high in every window (Mistral-7B, Ultrachat)",
        ),
        (
            "SnapKV: H with the question after / before the document",
            f"{fmt(_mean(results['snapkv_question_after']['whole']))} / "
            f"{fmt(_mean(results['snapkv_question_before']['whole']))}",
            "high either way (LongBench QA)",
        ),
        (
            "SnapKV: H between two question-answer pairs on one document",
            fmt(_mean(results["snapkv_question_pairs"])),
            "lower: questions vote for different keys",
        ),
        (
            "ShadowKV: rank holding 90% of the energy (input / W_k / W_v / pre-RoPE / post-RoPE / values)",
            " / ".join(
                f"{_mean(ranks[k]):.0f}"
                for k in ("layer input", "W_k", "W_v", "pre-RoPE keys", "post-RoPE keys", "values")
            ),
            "pre-RoPE keys the lowest",
        ),
        (
            "ShadowKV: D(context, extended) / D(context, another)",
            f"{fmt(_mean(results['shadowkv_subspaces']['extended context']))} / "
            f"{fmt(_mean(results['shadowkv_subspaces']['inter-context']))}",
            "high / low (rank 256, Llama-3.1-8B)",
        ),
        (
            "ShadowKV: SVD's share of the prefill, by prompt length",
            " / ".join(f"{row['length']}: {row['svd_share']:.2f}" for row in svd),
            "falls as prompts grow",
        ),
        (
            f"ShadowKV: chunks with a key under cosine {results['settings']['outlier_cosine']} to their mean",
            _percent(_mean(results["shadowkv_chunks"]["outlier_share"])) or "-",
            "outliers are 0.2-0.3% of chunks",
        ),
        ("ShadowKV: selected chunks already selected the step before", fmt(results["shadowkv_reuse"]), "> 60%"),
        (
            "ShadowKV: needle accuracy by key rank",
            " / ".join(f"{row['rank']}: {row['accuracy']:.2f}" for row in rank_rows),
            "no drop down to ~1/6 of the key width",
        ),
    ]
