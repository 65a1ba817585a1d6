"""Markdown tables for the docs from benchmark outputs (and the GPU check's test counts).

    python scripts/tables.py speed DIR...          one table per speed.json found under the folders
    python scripts/tables.py accuracy CSV...       the rows of accuracy summary.csv files
    python scripts/tables.py junit FILE            a test run's counts as JSON (scripts/gpu_check.sh)
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
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase") if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"], "failed": failed, "seconds": float(suite.get("time", 0))}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def speed_table(report: dict) -> str:
    machine = report["machine"]
    lines = [
        f"{report['model']} ({report['dtype']}) on {machine.get('gpu', machine['device'])}, torch {machine['torch']}, transformers {machine['transformers']}; "
        f"copy bandwidth {report['device_bandwidth'] / 1e9:.0f} GB/s; weights {gib(report['weight_bytes'])} GiB",
        "",
        "| method | prompt | batch | prefill s | compress | decode ms/token | tokens/s | KV device GiB | offloaded GiB | peak GiB | bound ms | x bound | fetch hidden |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['prompt_tokens']} | {r['batch']} | {r['status']} | | | | | | | | | |")
            continue
        bound = r["bytes_read_per_step"] / report["device_bandwidth"] * 1000
        hidden = r.get("fetch_hidden")
        lines.append(
            f"| {r['method']} | {r['prompt_tokens']} | {r['batch']} | {r['prefill_s']:.2f} | {r['compress_share']:.1%} | {r['decode_ms_per_token']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {gib(r['kv_device_bytes'])} | {gib(r['offloaded_bytes'])} | {gib(r['peak_bytes'])} | {bound:.2f} | "
            f"{r['decode_ms_per_token'] / bound:.2f} | {'-' if hidden is None else format(hidden, '.0%')} |"
        )
    for limit in report.get("limits", []):
        lines.append(f"\n{limit['method']}: {limit['kind']} = {limit['value']} ({len(limit['tried'])} runs tried)")
    return "\n".join(lines)


def accuracy_table(paths: list[str]) -> str:
    def number(text: str) -> str:
        return "-" if text in ("", None) else f"{float(text):.2f}"

    lines = ["| task | method | budget | n | score | retained | top-1 | KL | KV kept | device |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path in paths:
        for r in csv.DictReader(open(path)):
            lines.append(f"| {r['task']} | {r['label'].split('@')[0]} | {r['budget'] or '-'} | {r['samples']} | {number(r['score'])} | {number(r['retained'])} | "
                         f"{number(r['top1_agreement'])} | {number(r['kl'])} | {100 * float(r['kv_kept_fraction']):.1f}% | {100 * float(r['device_fraction']):.1f}% |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    kind, paths = argv[0], argv[1:]
    if kind == "junit":
        print(json.dumps(junit(paths[0]), indent=2))
        return
    if kind == "accuracy":
        print(accuracy_table(paths))
        return
    for folder in paths:
        for path in sorted(Path(folder).rglob("speed.json")):
            print(f"### {path.parent.name}\n\n{speed_table(json.loads(path.read_text()))}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
