"""PNG plots of the benchmarks' results: needle heatmaps (depth x length, as in the papers), score vs budget,
agreement with the full cache vs the device bytes held, and the speed grid's latency, throughput and peak memory."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np  # (the backend must be chosen first)


def needle_heatmaps(records: list[dict], path: str | Path, task: str = "niah") -> bool:
    """One panel per method/budget: mean score per (depth, length) of ``task``. False if there is no such task."""
    cells: dict[str, dict[tuple[float, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["task"] == task and r["turn"] == 1:
            cells[r["label"]][r["depth"], r["length"]].append(r["score"])
    if not cells:
        return False
    labels = list(cells)
    depths = sorted({d for c in cells.values() for d, _ in c})
    lengths = sorted({n for c in cells.values() for _, n in c})
    cols = min(4, len(labels))
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax, label in zip(axes.flat, labels):
        grid = [
            [sum(cells[label].get((d, n), [float("nan")])) / max(1, len(cells[label].get((d, n), []))) for n in lengths]
            for d in depths
        ]
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1000}k" if n % 1000 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("needle depth")
    for ax in list(axes.flat)[len(labels) :]:
        ax.axis("off")
    fig.suptitle(f"{task}: score (green = retrieved)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def budget_curves(rows: list[dict], task: str) -> dict[str, list[tuple[int, float]]]:
    """``task``'s (budget, score) points per method setting: the row's label without its ``@budget``,
    so two settings of one method (``snapkv`` and ``snapkv:heads=adaptive``) are two curves."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["task"] == task and r["budget"] is not None:
            curves.setdefault(r["label"].rsplit("@", 1)[0], []).append((r["budget"], r["score"]))
    return {setting: sorted(points) for setting, points in curves.items()}


def score_vs_budget(rows: list[dict], path: str | Path) -> None:
    """One panel per task: mean score against budget per method setting, the full cache as a dashed line."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = _task_panels(len(tasks))
    for ax, task in zip(axes.flat, tasks):
        mine = [r for r in rows if r["task"] == task]
        for setting, points in budget_curves(rows, task).items():
            ax.plot(*zip(*points), marker="o", label=setting)
        for r in mine:
            if r["budget"] is None:
                ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label="full")
        budgets = sorted({r["budget"] for r in mine if r["budget"] is not None})
        ax.set_xscale("log", base=2)
        if budgets:
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set_ylim(-0.05, 1.05)
        _label(ax, task, "budget (tokens)", "score")
    _save(fig, axes, len(tasks), path)


def agreement_points(rows: list[dict], task: str) -> dict[str, list[tuple[float, float, float, float]]]:
    """``task``'s points per method setting (the label without its ``@budget``): the device bytes as a share of
    the full cache's, top-1 agreement with the full cache's answers, and that agreement's 95% interval; rows that
    did not measure agreement are left out."""
    points: dict[str, list[tuple[float, float, float, float]]] = {}
    for r in rows:
        if r["task"] == task and r.get("top1_agreement") is not None and r.get("device_fraction") is not None:
            low, high = r.get("top1_agreement_95") or (r["top1_agreement"], r["top1_agreement"])
            points.setdefault(r["label"].rsplit("@", 1)[0], []).append(
                (r["device_fraction"], r["top1_agreement"], low, high)
            )
    return {setting: sorted(found) for setting, found in points.items()}


def agreement_vs_device(rows: list[dict], path: str | Path) -> bool:
    """One panel per task: top-1 agreement with the full cache (95% interval as bars) against the device bytes a
    setting holds, as a share of the full cache's (log scale), a curve per method setting over its budgets. False
    where no row measured agreement."""
    by_task = {task: agreement_points(rows, task) for task in dict.fromkeys(r["task"] for r in rows)}
    tasks = [task for task, found in by_task.items() if found]
    if not tasks:
        return False
    fig, axes = _task_panels(len(tasks))
    for ax, task in zip(axes.flat, tasks):
        for setting, points in by_task[task].items():
            device, agreed, low, high = zip(*points)
            ax.errorbar(
                device,
                agreed,
                yerr=[[a - lo for a, lo in zip(agreed, low)], [hi - a for a, hi in zip(agreed, high)]],
                marker="o",
                capsize=2,
                label=setting,
            )
        ax.set_xscale("log")
        ax.set_ylim(-0.05, 1.05)
        _label(ax, task, "device bytes (share of the full cache's)", "top-1 agreement")
    _save(fig, axes, len(tasks), path)
    return True


def _task_panels(count: int) -> tuple[plt.Figure, np.ndarray]:
    """A figure of ``count`` panels, four to a row."""
    cols = min(4, count)
    return plt.subplots(-(-count // cols), cols, figsize=(3.4 * cols, 2.8 * -(-count // cols)), squeeze=False)


def _label(ax: plt.Axes, title: str, x: str, y: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)


def _save(fig: plt.Figure, axes: np.ndarray, used: int, path: str | Path) -> None:
    """The unused panels blanked, the first panel's legend, then the figure written to ``path``."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speed(report: dict, out: Path) -> None:
    """decode_latency.png: ms/token vs prompt length per method, a panel per batch (SnapKV Fig. 7);
    throughput.png: tokens/s vs batch per method, a panel per length (ShadowKV Table 4's axis);
    peak_memory.png: peak memory vs prompt length per method, a panel per batch."""
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


def observation_figures(results: dict, folder: Path) -> list[str]:
    """``kvcompress observe``'s figures in ``folder``: SnapKV's hit rates (along generation, by the question's place,
    between two question-answer pairs) and ShadowKV's keys (spectra, subspaces, outlier chunks); the names written."""
    figures = {}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    spans = results["snapkv_along_generation"]["per_span"]
    for index in range(max(len(layer) for layer in spans)):
        axes[0].plot(
            [layer[index] if index < len(layer) else None for layer in spans],
            label=f"answer tokens {index * results['settings']['span']}+",
        )
    for key, label in (
        ("snapkv_question_after", "question after the document"),
        ("snapkv_question_before", "question before"),
    ):
        axes[1].plot(results[key]["whole"], label=label)
    axes[2].plot(results["snapkv_question_pairs"], label="H(vote A, vote B)")
    for axis, title in zip(axes, ("along generation", "question position", "two question-answer pairs")):
        axis.set(xlabel="layer", ylabel="hit rate", title=title, ylim=(0, 1.02))
        axis.legend(fontsize=7)
    figures["snapkv_hit_rates.png"] = fig
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for kind, values in results["shadowkv_spectra"]["middle_spectra"].items():
        axes[0].semilogy(values, label=kind)
    axes[0].set(
        xlabel="singular value index",
        ylabel="relative singular value",
        title=f"spectra, layer {results['shadowkv_spectra']['middle_layer']}",
    )
    axes[0].legend(fontsize=7)
    for key, values in results["shadowkv_subspaces"].items():
        axes[1].plot(values, label=key)
    axes[1].set(xlabel="layer", ylabel="D", title="pre-RoPE key subspaces", ylim=(0, 1.02))
    axes[1].legend(fontsize=7)
    axes[2].plot([100 * v for v in results["shadowkv_chunks"]["outlier_share"]])
    axes[2].set(xlabel="layer", ylabel="% of chunks", title="outlier chunks (min cosine to the mean)")
    figures["shadowkv_keys.png"] = fig
    for name, figure in figures.items():
        figure.tight_layout()
        figure.savefig(folder / name, dpi=110)
        plt.close(figure)
    return list(figures)
