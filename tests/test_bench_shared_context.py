"""``bench shared-context``: its generated tasks, the three kinds of method and what a run writes (a tiny model;
the measured table is in docs/accuracy.md)."""

from __future__ import annotations

import json
import re

import pytest

import kvcompress as kvc
from kvcompress.bench.shared_context import (
    MODES,
    answered,
    asked,
    kind_of,
    make_sample,
    resolved,
    run_shared_context,
    said,
    setting_of,
    summarize,
)
from kvcompress.cli import main
from tests.fixtures import char_tokenizer, tiny_model


def test_a_sample_places_every_fact_and_asks_each_then_refers_back():
    tok = char_tokenizer()
    sample = make_sample(tok, 600, seed=3, facts=4, haystack="prose")
    facts = [q.split("code of the ")[1].split("?")[0] for q, _ in sample.questions[:-1]]
    assert len(sample.questions) == 5 and len(set(facts)) == 4
    for name, (_, code) in zip(facts, sample.questions):
        assert f"The code of the {name} is {code}." in sample.context
    positions = sorted(sample.context.index(f"The code of the {name}") for name in facts)
    assert positions[0] < len(sample.context) / 4 and positions[-1] > 3 * len(sample.context) / 4  # spread
    assert sample.questions[-1] == ("Repeat the code you gave in your first answer.", sample.questions[0][1])
    assert make_sample(tok, 600, seed=3, facts=4, haystack="prose") == sample


def test_methods_by_kind_with_a_fraction_of_the_context_as_budget():
    assert [kind_of(s) for s in ("snapkv", "full", "kvzip:ratio=0.1", "expected", "first:snapkv")] == [
        "per-question",
        "per-question",
        "once",
        "once",
        "first",
    ]
    assert resolved("snapkv", 4096, 1 / 16) == kvc.SnapKV(budget=256)
    assert resolved("first:h2o:budget=100", 4096, 1 / 16) == kvc.H2O(budget=100)
    assert resolved("full", 4096, 1 / 16) == kvc.FullKV()


@pytest.mark.parametrize(
    ("text", "right"),
    [
        ("The code of the red fox is 4817.", 1),
        ("4817", 1),
        ("codes 12 and 4817, then", 1),
        ("The code of the red fox is 48172.", 0),
        ("The code is 14817.", 0),
        ("481 7", 0),
        ("", 0),
    ],
)
def test_an_answer_is_right_only_when_it_gives_the_code_as_a_whole_number(text, right):
    assert answered(text, "4817") == right


def test_a_run_scores_every_question_in_both_modes_and_resumes(tmp_path):
    model, tok = tiny_model(), char_tokenizer()
    specs = ["full", "snapkv:window=8:budget=48", "h2o:budget=48", "kvzip:budget=48", "first:snapkv:window=8:budget=48"]
    summary = run_shared_context(
        model, tok, specs, [300], 1, 2, 1 / 16, str(tmp_path), max_new_tokens=4, haystack="prose"
    )
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and {r["kind"] for r in rows} == {"per-question", "once", "first"}
    for row in rows:  # a conversation asks the referring question too
        assert len(row["scores"]) == len(row["answers"]) == (3 if row["mode"] == "multi-turn" else 2)
    assert set(summary) == {"multi-request", "multi-turn"} and set(summary["multi-turn"]) == set(specs)
    assert (tmp_path / "shared_context.png").stat().st_size > 1000
    # per-question methods are measured against the full cache's answers, turn by turn: the full cache follows
    # itself exactly; the others lie in [0, 1] with an interval around their mean
    for row in rows:
        assert ("agreement" in row) == (row["kind"] == "per-question")
        if row["kind"] == "per-question":
            assert len(row["agreement"]) == len(row["kl"]) == len(row["scores"])
            assert all(0 <= a <= 1 for a in row["agreement"]) and all(k >= 0 for k in row["kl"])
        if row["method"] == "full":
            assert row["agreement"] == [1.0] * len(row["scores"]) and max(row["kl"]) < 1e-6
    snap = summary["multi-turn"]["snapkv:window=8:budget=48"]
    assert snap["contexts"] == 1 and all(
        low <= a <= high for a, (low, high) in zip(snap["agreement"], snap["agreement_95"])
    )
    # the bytes each answer's cache held, as a share of the 16-bit cache's (float32 here: twice its kept fraction)
    assert summary["multi-turn"]["full"]["kv16"] == pytest.approx(2.0)
    assert 0 < snap["kv16"] < 2.0 and snap["all_turns"] == pytest.approx(sum(snap["agreement"]) / 3)
    assert (tmp_path / "agreement_vs_bytes.png").stat().st_size > 1000
    assert setting_of("snapkv:kv_bits=4:ratio=0.1:window=8") == setting_of("snapkv:kv_bits=4:budget=9:window=8")
    assert setting_of("snapkv:kv_bytes=0.01") == setting_of("snapkv:kv_bytes=0.1") == "snapkv:kv_bytes" != "snapkv"
    # a rerun finds every row done and asks nothing again
    run_shared_context(model, tok, specs, [300], 1, 2, 1 / 16, str(tmp_path), max_new_tokens=4, haystack="prose")
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 10


def test_a_summary_without_the_full_cache_scores_turns_and_leaves_the_ratio_empty():
    rows = [
        {"mode": mode, "method": "snapkv", "scores": [1, 0, 1], "agreement": [1.0, 0.5, 0.75], "kl": [0, 1, 2]}
        for mode in MODES
    ]
    row = summarize(rows, ["snapkv"])["multi-turn"]["snapkv"]
    assert row["score"] == [1.0, 0.0, 1.0] and row["of_full"] == [None, None, None]
    assert row["agreement"] == [1.0, 0.5, 0.75] and row["agreement_95"] == [[1.0, 1.0], [0.5, 0.5], [0.75, 0.75]]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fraction", "2"], r"--fraction 2.0 is invalid; give a number in \(0, 1\]"),
        (["--methods", "full,snapkv:window=x"], r"window"),
    ],
)
def test_bad_settings_are_refused_before_any_work(flags, message, tmp_path, capsys):
    assert main(["bench", "shared-context", "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err) and not (tmp_path / "out").exists()


def test_a_model_without_a_chat_template_is_asked_in_plain_text(tmp_path):
    """A base model (Gemma 3 270M) has no chat template: the context is plain text, each question cued
    ("Question: ... Answer:"), and an answer, which runs on, is scored on its first line."""
    tok = char_tokenizer()
    tok.chat_template = None
    sample = make_sample(tok, 300, seed=1, facts=2, haystack="prose")
    assert all(q.startswith("\nQuestion: What is the code") and q.endswith("\nAnswer:") for q in asked(tok, sample)[:2])
    assert said(tok, " 4817.\nQuestion: What is 1234") == "4817." and answered(said(tok, " 12.\n4817"), "4817") == 0
    model = tiny_model(max_position_embeddings=2048)
    run_shared_context(
        model,
        tok,
        ["full", "snapkv:window=8:budget=48"],
        [300],
        1,
        2,
        1 / 16,
        str(tmp_path),
        max_new_tokens=4,
        haystack="prose",
    )
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["agreement"] == [1.0] * len(r["scores"]) for r in rows if r["method"] == "full")
