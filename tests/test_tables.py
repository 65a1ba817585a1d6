"""scripts/tables.py: the paired comparison of accuracy settings used in docs/accuracy.md."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("tables", Path(__file__).parents[1] / "scripts" / "tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def record(sample: str, label: str, budget: int | None, score: float, kl: float = 0.0) -> dict:
    return {
        "task": "niah", "sample": sample, "turn": 1, "label": label if budget is None else f"{label}@{budget}",
        "budget": budget, "score": score, "kl": kl, "top1_agreement": 1.0 - kl
    }


def test_paired_table_counts_samples_won_and_lost_on_shared_samples(tmp_path):
    rows = [record("a", "full", None, 1.0), record("b", "full", None, 0.0), record("c", "full", None, 1.0),
            record("a", "snapkv", 128, 1.0, 0.2), record("b", "snapkv", 128, 0.0, 0.4), record("c", "snapkv", 128, 1.0),
            # c: not run
            record("a", "snapkv:heads=adaptive", 128, 0.0, 0.1), record("b", "snapkv:heads=adaptive", 128, 1.0, 0.1)]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = tables.paired_table("snapkv", ["snapkv:heads=adaptive"], [str(path)]).splitlines()
    assert len(table) == 3
    assert table[2] == "| niah | 128 | 2 | 0.50 | 0.50 | 0.50 | 1 / 1 | 0.300 / 0.100 | 0.700 / 0.900 |"


def test_retained_table_sums_every_question_against_the_full_cache(tmp_path):
    rows = [record("a", "full", None, 1.0), record("b", "full", None, 1.0), record("c", "full", None, 0.0),
            record("a", "kvzip", 64, 1.0), record("b", "kvzip", 64, 0.0), record("c", "kvzip", 64, 1.0),
            {**record("d", "kvzip", 64, 1.0), "task": "qa_1"}]  # d: no full-cache answer, left out
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = tables.retained_table([str(path)]).splitlines()
    assert table[0] == "| method | budget | niah | qa_1 | questions | retained (all) | full's answers kept |"
    assert table[2:] == ["| full | - | 0.67 | - | 3 | 1.00 | 1.00 |", "| kvzip | 64 | 0.67 | - | 3 | 1.00 | 0.50 |"]
