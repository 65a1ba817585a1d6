"""Markdown tables for the docs from benchmark outputs (and the GPU check's test counts).

python scripts/tables.py speed DIR...          one table per speed.json found under the folders
python scripts/tables.py accuracy CSV...       the rows of accuracy summary.csv files
python scripts/tables.py junit FILE            a test run's counts as JSON (scripts/gpu_check.sh)
python scripts/tables.py paired BASE OTHER[,OTHER...] RESULTS...
                                               settings against a base setting on the same samples
                                               (accuracy results.jsonl): scores, samples won / lost, KL, top-1
python scripts/tables.py retained [--columns length] RESULTS...
                                               per setting: the mean score per task (or prompt length) and the
                                               score retained against the full cache over every question
                                               (accuracy results.jsonl)
python scripts/tables.py agreement PNG RESULTS...
                                               per task and setting: top-1 agreement with the full cache against
                                               the device bytes held (accuracy results.jsonl), table and PNG
python scripts/tables.py memory NAME=DIR... [--plot PNG]
                                               peak memory vs prompt length of speed runs (e.g. before=...
                                               after=...), each method's fitted slope in bytes per token
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def junit(path: str) -> dict:
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": failed,
        "seconds": float(suite.get("time", 0)),
    }


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def speed_table(report: dict) -> str:
    machine = report["machine"]
    lines = [
        f"{report['model']} ({report['dtype']}) on {machine.get('gpu', machine['device'])}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}; copy bandwidth {report['device_bandwidth'] / 1e9:.0f} GB/s; weights "
        f"{gib(report['weight_bytes'])} GiB",
        "",
        "| method | prompt | batch | prefill s | compress | decode ms/token | tokens/s | KV device GiB | offloaded GiB "
        "| peak GiB | bound ms | x bound | fetch hidden |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['prompt_tokens']} | {r['batch']} | {r['status']} | | | | | | | | | |")
            continue
        bound = r["bytes_read_per_step"] / report["device_bandwidth"] * 1000
        hidden = r.get("fetch_hidden")
        lines.append(
            f"| {r['method']} | {r['prompt_tokens']} | {r['batch']} | {r['prefill_s']:.2f} | {r['compress_share']:.1%} "
            f"| {r['decode_ms_per_token']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {gib(r['kv_device_bytes'])} | {gib(r['offloaded_bytes'])} | "
            f"{gib(r['peak_bytes'])} | {bound:.2f} | "
            f"{r['decode_ms_per_token'] / bound:.2f} | {'-' if hidden is None else format(hidden, '.0%')} |"
        )
    for limit in report.get("limits", []):
        lines.append(f"\n{limit['method']}: {limit['kind']} = {limit['value']} ({len(limit['tried'])} runs tried)")
    return "\n".join(lines)


def accuracy_table(paths: list[str]) -> str:
    def number(text: str) -> str:
        return "-" if text in ("", None) else f"{float(text):.2f}"

    lines = [
        "| task | method | budget | n | score | retained | top-1 | KL | KV kept | device |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for path in paths:
        for r in csv.DictReader(Path(path).read_text().splitlines()):
            lines.append(
                f"| {r['task']} | {r['label'].split('@')[0]} | {r['budget'] or '-'} | {r['samples']} | "
                f"{number(r['score'])} | {number(r['retained'])} | {number(r['top1_agreement'])} | {number(r['kl'])} | "
                f"{100 * float(r['kv_kept_fraction']):.1f}% | {100 * float(r['device_fraction']):.1f}% |"
            )
    return "\n".join(lines)


def paired_table(base: str, others: list[str], paths: list[str]) -> str:
    """Per (task, budget): each setting's score, KL and top-1 beside the base setting's on the samples
    both ran, and how many samples scored higher or lower than the base (a sample, not a mean, is
    what a single wrong digit changes)."""
    records: dict[tuple, dict] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            records[(r["task"], r["budget"], r["sample"], r.get("turn", 1), r["label"].split("@")[0])] = r
    full = {key[:1] + key[2:4]: r["score"] for key, r in records.items() if key[4] == "full"}
    head = (
        "| task | budget | n | full | "
        + " | ".join(["base " + base, *others])
        + " | higher / lower than base | KL | top-1 |"
    )
    lines = [head, "|" + " --- |" * 2 + " ---: |" * (3 + len(others)) + " --- | --- | --- |"]
    cells = sorted({(k[0], k[1]) for k in records if k[1] is not None and k[4] == base})
    for task, budget in cells:
        samples = [
            k[2:4]
            for k in records
            if k[:2] == (task, budget) and k[4] == base and all((task, budget, *k[2:4], o) in records for o in others)
        ]
        rows = {name: [records[(task, budget, *s, name)] for s in samples] for name in [base, *others]}

        def mean(name: str, field: str) -> float:
            return sum(r[field] for r in rows[name]) / len(samples)

        def moved(name: str) -> str:
            pairs = list(zip(rows[name], rows[base]))
            better = sum(o["score"] > b["score"] for o, b in pairs)
            worse = sum(o["score"] < b["score"] for o, b in pairs)
            return f"{better} / {worse}"

        moves = ", ".join(moved(n) for n in others)
        kl = " / ".join(f"{mean(n, 'kl'):.3f}" for n in [base, *others])
        top1 = " / ".join(f"{mean(n, 'top1_agreement'):.3f}" for n in [base, *others])
        scores = " | ".join(f"{mean(n, 'score'):.2f}" for n in [base, *others])
        lines.append(
            f"| {task} | {budget} | {len(samples)} | {sum(full[(task, *s)] for s in samples) / len(samples):.2f} | "
            f"{scores} | {moves} | {kl} | {top1} |"
        )
    return "\n".join(lines)


def against_full(paths: list[str]) -> tuple[list[dict], dict[tuple, float], dict[str, list[dict]]]:
    """Accuracy results.jsonl rows, the full cache's score per question (sample, turn), and each setting's rows on
    the questions the full cache answered (in the order settings first appear)."""
    records = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    full = {(r["sample"], r["turn"]): r["score"] for r in records if r["label"] == "full"}
    settings: dict[str, list[dict]] = {}
    for r in records:
        mine = settings.setdefault(r["label"], [])
        if (r["sample"], r["turn"]) in full:
            mine.append(r)
    return records, full, settings


def device_mib(rows: list[dict]) -> float | None:
    """Mean device bytes while decoding, in MiB, over the rows that carry them (None: none do, as kvpress's)."""
    held = [r["device_bytes"] for r in rows if "device_bytes" in r]
    return sum(held) / len(held) / 2**20 if held else None


def retained_table(paths: list[str], column: str = "task") -> str:
    """Per method setting: the mean score per ``column`` (task or length; over every question of every sample) and, over
    all of them together, the score retained against the full cache on the same questions (the sum
    of the setting's scores over the full cache's) and the part of the full cache's answers it keeps
    (its score capped at the full cache's, question by question: a lucky answer the full cache
    missed does not make up for one it found), and its mean device bytes while decoding."""
    records, full, settings = against_full(paths)
    tasks = list(dict.fromkeys(r[column] for r in records))
    labels = sorted(
        settings,
        key=lambda label: (label != "full", label.split("@")[0], int(label.split("@")[1]) if "@" in label else 0),
    )
    lines = [
        "| method | budget | "
        + " | ".join(map(str, tasks))
        + " | questions | retained (all) | full's answers kept | device MiB |",
        "| --- | ---: |" + " ---: |" * (len(tasks) + 4),
    ]
    for label in labels:
        mine = settings[label]
        cells = []
        for task in tasks:
            scores = [r["score"] for r in mine if r[column] == task]
            cells.append(f"{sum(scores) / len(scores):.2f}" if scores else "-")
        reference = sum(full[(r["sample"], r["turn"])] for r in mine)
        retained = f"{sum(r['score'] for r in mine) / reference:.2f}" if reference else "-"
        capped = sum(min(r["score"], full[(r["sample"], r["turn"])]) for r in mine)
        kept = f"{capped / reference:.2f}" if reference else "-"
        device = device_mib(mine)
        lines.append(
            f"| {label.split('@')[0]} | {mine[0]['budget'] or '-'} | "
            + " | ".join(cells)
            + f" | {len(mine)} | {retained} | {kept} | {'-' if device is None else f'{device:.1f}'} |"
        )
    return "\n".join(lines)


def memory_curves(named: list[str], plot: str | None) -> str:
    """Peak memory per (run, method, prompt) and the least-squares slope of peak bytes over prompt tokens."""
    curves: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for item in named:
        name, folder = item.split("=", 1)
        for r in json.loads((Path(folder) / "speed.json").read_text())["rows"]:
            if r["status"] == "ok":
                curves.setdefault((name, r["method"]), []).append((r["prompt_tokens"], r["peak_bytes"]))
    lengths = sorted({n for points in curves.values() for n, _ in points})
    shared = set.intersection(*({n for n, _ in points} for points in curves.values()))  # slopes over the same range
    lines = [
        "| run | method | "
        + " | ".join(f"{n // 1024}K" for n in lengths)
        + f" | slope {min(shared) // 1024}K-{max(shared) // 1024}K, bytes per token |",
        "| --- | --- | " + " | ".join("---:" for _ in lengths) + " | ---: |",
    ]
    for (name, method), points in curves.items():
        peaks = dict(points)
        fitted = [(x, y) for x, y in points if x in shared]
        mean_x, mean_y = sum(x for x, _ in fitted) / len(fitted), sum(y for _, y in fitted) / len(fitted)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in fitted) / max(sum((x - mean_x) ** 2 for x, _ in fitted), 1)
        cells = " | ".join(gib(peaks[n]) if n in peaks else "-" for n in lengths)
        lines.append(f"| {name} | {method} | {cells} | {slope:,.0f} |")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4.5))
        methods = list(dict.fromkeys(method for _, method in curves))
        runs = list(dict.fromkeys(name for name, _ in curves))
        for (name, method), points in curves.items():  # a colour per method, a line style per run
            xs, ys = zip(*sorted(points))
            axes.plot(
                [x / 1024 for x in xs],
                [y / 2**30 for y in ys],
                marker="o",
                color=f"C{methods.index(method)}",
                linestyle=["--", "-", ":", "-."][runs.index(name) % 4],
                label=f"{method} ({name})",
            )
        axes.set(
            xlabel="prompt tokens (K)", ylabel="peak memory (GiB)", title="Peak memory of a prefill + one decoding step"
        )
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(plot, dpi=120)
    return "Peak GiB per prompt length:\n\n" + "\n".join(lines)


BITS_COLORS = {
    "model's precision": "tab:blue",
    "8 bits": "tab:orange",
    "fp8": "tab:green",
    "4 bits": "tab:red",
    "keys 8, values 4 bits": "tab:purple",
    "keys 6, values 4 bits": "tab:brown",
}
MARKERS = {"full": "s", "snapkv": "o"}


def bits_of(label: str) -> str:
    """What a setting's label says its kept tokens cost per element."""
    for keys in (8, 6):
        if f"key_bits={keys}" in label:
            return f"keys {keys}, values 4 bits"
    if "kv_bits=4" in label or "quanto4" in label:
        return "4 bits"
    if "kv_format=fp8" in label:
        return "fp8"
    return "8 bits" if "kv_bits=8" in label else "model's precision"


def retained_by_bytes(paths: list[str], plot: str) -> str:
    """Each setting's score retained against the full cache (as ``retained_table``) against its mean device bytes
    while decoding, as a PNG (score against bytes, one line per method and codec through its budgets), and the points
    as rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, full, settings = against_full(paths)
    points = []
    for label, mine in settings.items():
        reference = sum(full[(r["sample"], r["turn"])] for r in mine)
        device = device_mib(mine)
        if device is None:
            raise SystemExit(f"bytes: {label} has no device_bytes to plot")
        points.append((label, device, sum(r["score"] for r in mine) / reference if reference else 0.0))
    figure, axis = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, str], list[tuple[float, float, str]]] = {}  # (method, bits) -> points, budget
    for label, device, retained in points:
        method = label.split("@")[0].split("/")[0].split(":")[0]
        series.setdefault((method, bits_of(label)), []).append((device, retained, label.partition("@")[2]))
    for (method, bits), dots in series.items():
        dots.sort()
        axis.plot(
            [d[0] for d in dots],
            [d[1] for d in dots],
            color=BITS_COLORS[bits],
            marker=MARKERS.get(method, "^"),
            label=f"{method}, {bits}",
        )
        for device, retained, budget in dots:
            if budget:
                axis.annotate(budget, (device, retained), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axis.legend(fontsize=7)
    axis.set(
        xscale="log",
        xlabel="device MiB while decoding (mean over questions)",
        ylabel="score retained vs the full cache",
        title="answers at equal bytes (each point labelled with its budget)",
    )
    figure.tight_layout()
    figure.savefig(plot, dpi=120)
    return "\n".join(f"| {label} | {device:.1f} | {retained:.2f} |" for label, device, retained in points)


def agreement_by_bytes(paths: list[str], plot: str) -> str:
    """Per task and setting of accuracy results.jsonl: top-1 agreement with the full cache's answers (95% interval)
    against the device bytes held as a share of the full cache's, as rows and as the PNG ``bench accuracy`` draws
    (``plots.agreement_vs_device``), so earlier runs' raw rows can be drawn too."""
    from kvcompress.bench.plots import agreement_vs_device
    from kvcompress.bench.summary import summarize

    rows = summarize(
        [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    )
    if not agreement_vs_device(rows, plot):
        raise SystemExit("agreement: no row of these results measured agreement with the full cache")
    lines = [
        "| task | method | budget | device share | top-1 agreement | KL |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.get("top1_agreement") is not None:
            low, high = r["top1_agreement_95"]
            lines.append(
                f"| {r['task']} | {r['label'].split('@')[0]} | {r['budget'] or '-'} | "
                f"{r['device_fraction']:.3f} | {r['top1_agreement']:.3f} [{low:.3f}, {high:.3f}] | "
                f"{r['kl']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    kind, paths = argv[0], argv[1:]
    if kind == "junit":
        print(json.dumps(junit(paths[0]), indent=2))
        return
    if kind == "memory":
        plot = paths[paths.index("--plot") + 1] if "--plot" in paths else None
        print(memory_curves([p for p in paths if "=" in p], plot))
        return
    if kind == "paired":
        print(paired_table(paths[0], paths[1].split(","), paths[2:]))
        return
    if kind == "accuracy":
        print(accuracy_table(paths))
        return
    if kind == "retained":
        if paths[0] == "--columns":
            print(retained_table(paths[2:], paths[1]))
        else:
            print(retained_table(paths))
        return
    if kind == "agreement":  # tables.py agreement PLOT.png RESULTS.jsonl...
        print(agreement_by_bytes(paths[1:], paths[0]))
        return
    if kind == "bytes":  # tables.py bytes PLOT.png RESULTS.jsonl...
        print(retained_by_bytes(paths[1:], paths[0]))
        return
    for folder in paths:
        for path in sorted(Path(folder).rglob("speed.json")):
            print(f"### {path.parent.name}\n\n{speed_table(json.loads(path.read_text()))}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
