"""``bench accuracy``'s summary: per task (a multi-turn task per turn) and config, the mean score, the accuracy kept
against the full cache on the same samples, agreement with its intervals and the bytes held, written as CSV."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from .metrics import bootstrap_interval


def task_key(record: dict) -> str:
    """Where a record is summed: its task, and per turn for follow-up turns (the question-agnostic
    track's questions are independent, summed together)."""
    return (
        record["task"]
        if record["turns"] == 1 or record.get("track") == "agnostic"
        else f"{record['task']} t{record['turn']}"
    )


def summarize(records: list[dict]) -> list[dict]:
    """Per task (multi-turn tasks per turn) x config: mean score, retained accuracy vs the full cache
    on the same samples, fidelity, the fraction of KV bytes kept, and (datasets) string match."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[task_key(record), record["label"]].append(record)
    rows = []
    for (task, label), group in sorted(groups.items()):
        full = {(r["sample"], r["turn"]): r["score"] for r in groups.get((task, "full"), [])}  # each question's
        paired = [r for r in group if (r["sample"], r["turn"]) in full]
        full_score = sum(full[r["sample"], r["turn"]] for r in paired) / len(paired) if paired else None
        mine = sum(r["score"] for r in paired) / len(paired) if paired else None
        with_fidelity = [r for r in group if "kl" in r]

        def mean(key: str, group=group) -> float | None:
            values = [r[key] for r in group if r.get(key) is not None]
            return sum(values) / len(values) if values else None

        rows.append(
            {
                "task": task,
                "method": group[0]["method"],
                "budget": group[0]["budget"],
                "label": label,
                "samples": len(group),
                "score": sum(r["score"] for r in group) / len(group),
                "retained": mine / full_score if full_score else None,
                "top1_agreement": sum(r["top1_agreement"] for r in with_fidelity) / len(with_fidelity)
                if with_fidelity
                else None,
                "top1_agreement_95": bootstrap_interval([r["top1_agreement"] for r in with_fidelity])
                if with_fidelity
                else None,
                "kl": sum(r["kl"] for r in with_fidelity) / len(with_fidelity) if with_fidelity else None,
                "kv_kept_fraction": mean("kv_kept_fraction"),
                "device_fraction": mean("device_fraction"),
                "chunk_hit_rate": mean("chunk_hit_rate"),
                "string_match": sum(r["string_match"] for r in group) / len(group)
                if "string_match" in group[0]
                else None,
            }
        )
    return rows


def write_summary(rows: list[dict], path: str | Path) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
