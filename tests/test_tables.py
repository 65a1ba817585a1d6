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
        "task": "niah",
        "sample": sample,
        "turn": 1,
        "label": label if budget is None else f"{label}@{budget}",
        "budget": budget,
        "score": score,
        "kl": kl,
        "top1_agreement": 1.0 - kl,
    }


def test_paired_table_counts_samples_won_and_lost_on_shared_samples(tmp_path):
    rows = [
        record("a", "full", None, 1.0),
        record("b", "full", None, 0.0),
        record("c", "full", None, 1.0),
        record("a", "snapkv", 128, 1.0, 0.2),
        record("b", "snapkv", 128, 0.0, 0.4),
        record("c", "snapkv", 128, 1.0),
        # c: not run
        record("a", "snapkv:heads=adaptive", 128, 0.0, 0.1),
        record("b", "snapkv:heads=adaptive", 128, 1.0, 0.1),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = tables.paired_table("snapkv", ["snapkv:heads=adaptive"], [str(path)]).splitlines()
    assert len(table) == 3
    assert table[2] == "| niah | 128 | 2 | 0.50 | 0.50 | 0.50 | 1 / 1 | 0.300 / 0.100 | 0.700 / 0.900 |"


def test_retained_table_sums_every_question_against_the_full_cache(tmp_path):
    rows = [
        record("a", "full", None, 1.0),
        record("b", "full", None, 1.0),
        record("c", "full", None, 0.0),
        record("a", "kvzip", 64, 1.0),
        record("b", "kvzip", 64, 0.0),
        record("c", "kvzip", 64, 1.0),
        {**record("d", "kvzip", 64, 1.0), "task": "qa_1"},
    ]  # d: no full-cache answer, left out
    for row, device in zip(rows[3:], (1, 2, 6, 100)):  # the full cache's rows carry no bytes (as kvpress's)
        row["device_bytes"] = device * 2**20
    for row in rows:
        row["length"] = 4000 if row["sample"] == "c" else 2000
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = tables.retained_table([str(path)]).splitlines()
    assert table[0] == (
        "| method | budget | niah | qa_1 | questions | retained (all) | full's answers kept | device MiB |"
    )
    assert table[2:] == [
        "| full | - | 0.67 | - | 3 | 1.00 | 1.00 | - |",
        "| kvzip | 64 | 0.67 | - | 3 | 1.00 | 0.50 | 3.0 |",
    ]
    by_length = tables.retained_table([str(path)], "length").splitlines()
    assert by_length[0].startswith("| method | budget | 2000 | 4000 | questions |")
    assert by_length[3] == "| kvzip | 64 | 0.50 | 1.00 | 3 | 1.00 | 0.50 | 3.0 |"


def test_bits_of_names_each_setting_s_codec():
    assert [
        tables.bits_of(label)
        for label in (
            "full",
            "snapkv:kv_bits=8/full@64",
            "full:kv_bits=8:kv_format=fp8",
            "snapkv:kv_bits=4/full@256",
            "full:kv_bits=4:key_bits=8",
            "transformers-quanto4",
        )
    ] == ["model's precision", "8 bits", "fp8", "4 bits", "keys 8, values 4 bits", "4 bits"]


def test_agreement_table_and_plot_from_raw_results(tmp_path):
    rows = [record(sample, "full", None, 1.0) for sample in "ab"]
    rows += [record(sample, "snapkv", 128, 1.0, kl) for sample, kl in (("a", 0.2), ("b", 0.4))]
    for row in rows:
        row.update(
            kv_kept_fraction=1.0 if row["budget"] is None else 0.1,
            turns=1,
            method=row["label"].split("@")[0],
            device_fraction=1.0 if row["budget"] is None else 0.1,
        )
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = tables.agreement_by_bytes([str(path)], str(tmp_path / "a.png")).splitlines()
    assert table[2] == "| niah | full | - | 1.000 | 1.000 [1.000, 1.000] | 0.000 |"
    assert table[3].startswith("| niah | snapkv | 128 | 0.100 | 0.700 [0.600, 0.800] | 0.300 |")
    assert (tmp_path / "a.png").stat().st_size > 1000
