"""The speed benchmark runs on a tiny config and writes well-formed results (it is not a timed test)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import kvcompress as kvc
from kvcompress.bench.device import copy_bandwidth
from kvcompress.bench.limits import search_limit
from kvcompress.bench.speed import PRESETS, SpeedGrid, measure, run_speed
from kvcompress.integrations.transformers.models import ARCHITECTURES, random_model
from kvcompress.methods.prompt import PromptMethod

from .fixtures import tiny_model


def test_grid_writes_json_csv_and_plots(tmp_path):
    model = tiny_model()
    report = run_speed(
        model,
        SpeedGrid(["full", "snapkv", "shadowkv:budget=32"], [200, 400], [1, 2], budget=64, steps=3, warmup=1),
        tmp_path,
        progress=False,
    )
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert {"platform", "torch", "transformers", "device"} <= set(saved["machine"]) and saved["settings"][
        "budget"
    ] == 64
    assert len(saved["rows"]) == 3 * 2 * 2 and all(r["status"] == "ok" for r in saved["rows"])
    for row in saved["rows"]:
        assert row["decode_ms_per_token"] > 0 and row["prefill_s"] > 0 and 0 <= row["compress_share"] < 1
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1000 / row["decode_ms_per_token"])
        assert row["bytes_read_per_step"] >= row["kv_device_bytes"] * 0 + sum(p.numel() * 4 for p in model.parameters())
    by = {(r["method"], r["prompt_tokens"], r["batch"]): r for r in saved["rows"]}
    assert by["snapkv", 400, 2]["kv_device_bytes"] < by["full", 400, 2]["kv_device_bytes"]
    assert by["shadowkv:budget=32", 400, 1]["offloaded_bytes"] > 0 and by["full", 400, 1]["offloaded_bytes"] == 0
    shadow = by["shadowkv:budget=32", 400, 2]
    assert shadow["value_fetch"] == "cpu" and shadow["fetch_hidden"] is None and 0 <= shadow["chunk_hit_rate"] <= 1
    assert min(shadow["layer_fetch_ms"], shadow["layer_work_ms"], shadow["layer_fetch_and_work_ms"]) > 0
    assert "fetch_hidden" not in by["full", 400, 2]
    with open(tmp_path / "speed.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 12
    assert (tmp_path / "decode_latency.png").stat().st_size > 1000 and (
        tmp_path / "throughput.png"
    ).stat().st_size > 1000
    assert (tmp_path / "peak_memory.png").stat().st_size > 1000


@dataclass
class ExhaustsMemory(PromptMethod):
    """A method whose prefill runs out of memory beyond ``limit`` prompt tokens."""

    name: ClassVar[str] = "exhausts"
    limit: int = 300

    def kept_tokens(self, lengths: torch.Tensor, share: float | torch.Tensor = 1.0) -> torch.Tensor:
        if int(lengths.max()) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return lengths


def test_out_of_memory_is_recorded_not_raised():
    row = measure(tiny_model(), ExhaustsMemory(), "exhausts", 400, 1, 2, 1, bandwidth=1e9)
    assert row["status"] == "oom" and row["prompt_tokens"] == 400
    # the allocator's words and the line that asked: a report says where, not only that
    assert row["error"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert row["where"].startswith("methods/eviction.py:")


def test_a_run_records_no_autograd_history():
    # Weights that require grad (a random preset's, before 11-26): a prefill recording history keeps every layer's
    # activations alive and skips the blocked prefill; the 11-26 H100 run ran out of memory at 32K so.
    model = tiny_model().requires_grad_(True)
    modes = []
    model.register_forward_pre_hook(lambda *_: modes.append(torch.is_grad_enabled()))
    row = measure(model, kvc.SnapKV(budget=64, window=8), "snapkv", 300, 1, 2, 1, bandwidth=1e9)
    assert row["status"] == "ok" and len(modes) > 3 and not any(modes)
    assert not any(p.requires_grad for p in random_model("smollm2-135m", device="cpu").parameters())


def test_limit_search_finds_the_largest_size_that_fits():
    calls = []

    def try_size(n: int) -> dict:
        calls.append(n)
        return {"size": n, "fits": n <= 5000}

    size, tried = search_limit(try_size, 1024, 131072, 256)
    assert 5000 - 256 < size <= 5000 and len(tried) == len(calls) < 16
    assert search_limit(lambda n: {"fits": False}, 1024, 8192, 256)[0] is None
    assert search_limit(lambda n: {"fits": True}, 1024, 6000, 256)[0] == 6000


def test_max_context_search_on_a_model_with_a_memory_cap(tmp_path):
    model = tiny_model(max_position_embeddings=2048)
    report = run_speed(
        model,
        SpeedGrid(["full"], [256], [1], steps=2, warmup=1, find_max_context=True, max_memory=2**40),
        tmp_path,
        progress=False,
    )
    (limit,) = report["limits"]
    assert limit["kind"] == "max_context" and limit["value"] == 2048 - 8


def test_bad_settings_are_refused(tmp_path):
    model = tiny_model(max_position_embeddings=512)
    with pytest.raises(ValueError, match="on a CPU the limit searches need max_memory"):
        run_speed(model, SpeedGrid(["full"], [128], [1], find_max_batch=True), tmp_path, progress=False)
    with pytest.raises(
        ValueError, match=r"prompt lengths \[510\] plus 20 decoding steps exceed the model's context of 512"
    ):
        run_speed(model, SpeedGrid(["full"], [510], [1], steps=16, warmup=3), tmp_path, progress=False)
    with pytest.raises(ValueError, match="method='magic' is unknown"):
        run_speed(model, SpeedGrid(["magic"], [128], [1]), tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"batch_limit=0 is not a valid setting; valid: an integer of at least 1"):
        run_speed(
            model,
            SpeedGrid(["full"], [128], [1], find_max_batch=True, max_memory=2**40, batch_limit=0),
            tmp_path,
            progress=False,
        )
    with pytest.raises(ValueError, match=r"repeats=0 is not a valid setting; valid: an integer of at least 1"):
        run_speed(model, SpeedGrid(["full"], [128], [1], repeats=0), tmp_path, progress=False)


def test_batch_search_stops_at_its_limit(tmp_path):
    model = tiny_model(max_position_embeddings=512)
    report = run_speed(
        model,
        SpeedGrid(["full"], [64], [1], steps=1, warmup=0, find_max_batch=True, max_memory=2**40, batch_limit=3),
        tmp_path,
        progress=False,
    )
    (limit,) = report["limits"]
    assert limit["value"] == 3 and max(row["batch"] for row in limit["tried"]) == 3


def test_repeats_interleave_the_methods_and_report_the_median(tmp_path, capsys):
    from kvcompress.cli import main

    config = tmp_path / "tiny"
    tiny_model().config.save_pretrained(config)
    out = tmp_path / "run"
    argv = [
        "bench",
        "speed",
        "--model",
        str(config),
        "--methods",
        "full,snapkv:budget=48",
        "--lengths",
        "100",
        "--batches",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "3",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "the median of 3 runs of the grid" in printed
    lines = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    # every method once a repeat, the order reversed every other repeat
    assert [(r["method"], r.get("repeat", 0)) for r in lines[1:]] == [
        ("full", 0),
        ("snapkv:budget=48", 0),
        ("snapkv:budget=48", 1),
        ("full", 1),
        ("full", 2),
        ("snapkv:budget=48", 2),
    ]
    report = json.loads((out / "speed.json").read_text())
    assert len(report["rows"]) == 2 and report["settings"]["repeats"] == 3
    for row in report["rows"]:
        runs = [r["decode_ms_per_token"] for r in lines[1:] if r["method"] == row["method"]]
        assert row["decode_ms_runs"] == runs and row["decode_ms_per_token"] == sorted(runs)[1]
        assert row["tokens_per_s"] == pytest.approx(1000 / row["decode_ms_per_token"])
    assert main(argv) == 0  # a rerun resumes: nothing measured again
    assert len((out / "rows.jsonl").read_text().splitlines()) == 1 + 6
    assert main([*argv[:-4], "--repeats", "0", "--out", str(tmp_path / "other")]) == 2
    assert "--repeats 0 is not a valid setting; valid: an integer of at least 1" in capsys.readouterr().err


def test_architecture_presets_have_the_documented_shapes():
    llama = ARCHITECTURES["llama-3.1-8b"]
    assert (
        llama["num_hidden_layers"],
        llama["num_attention_heads"],
        llama["num_key_value_heads"],
        llama["head_dim"],
    ) == (32, 32, 8, 128)
    small = random_model("smollm2-135m", device="cpu")
    assert sum(p.numel() for p in small.parameters()) == pytest.approx(134.5e6, rel=0.01)
    with pytest.raises(ValueError, match="architecture='gpt-9' is neither a preset"):
        random_model("gpt-9")


def test_copy_bandwidth_is_positive():
    assert copy_bandwidth(torch.device("cpu"), megabytes=8) > 1e8


def test_the_baselines_are_benchmarked_too(tmp_path):
    report = run_speed(
        tiny_model(),
        SpeedGrid(["h2o", "quest", "loki"], [300], [1], budget=64, steps=2, warmup=1),
        tmp_path,
        progress=False,
    )
    assert [r["method"] for r in report["rows"]] == ["h2o", "quest", "loki"] and all(
        r["status"] == "ok" for r in report["rows"]
    )
    assert report["rows"][0]["kv_device_bytes"] < report["rows"][1]["kv_device_bytes"]  # H2O drops, Quest keeps all


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_fit_their_model_context(preset):
    settings = PRESETS[preset]
    context = ARCHITECTURES[settings["model"]]["max_position_embeddings"]
    assert max(settings["lengths"]) + settings["warmup"] + settings["steps"] + 1 <= context


def test_cli_prints_the_table_and_the_overlap(tmp_path, capsys):
    from kvcompress.cli import main

    config = tmp_path / "tiny"
    tiny_model().config.save_pretrained(config)
    out = tmp_path / "run"
    argv = [
        "bench",
        "speed",
        "--model",
        str(config),
        "--methods",
        "full,shadowkv:budget=32",
        "--lengths",
        "300",
        "--batches",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "shadowkv:budget=32 300 x 1: one layer's store read" in printed and "chunk hit rate" in printed
    assert main(argv) == 0  # a rerun resumes: every row comes from rows.jsonl
    assert len((out / "rows.jsonl").read_text().splitlines()) == 1 + 2
    assert main([*argv[:-2], "--steps", "3", "--out", str(out)]) == 2  # other settings are refused, not mixed in
    assert "holds a run with other settings" in capsys.readouterr().err


def test_the_headline_sets_each_method_beside_transformers_generate_on_the_same_tokens(tmp_path):
    """The reference is transformers' own generate (its cache measured from its tensors, a stamp per token), run
    before kvcompress touches the model; each method's row is compared with it at the same shape."""
    from kvcompress.bench.headline import CEILING, REFERENCE, run_headline

    model = tiny_model()
    layers, kv_heads, head_dim = 2, model.config.num_key_value_heads, model.config.head_dim
    report = run_headline(
        model, ["full", "snapkv:budget=48:window=8"], [150], [1, 2], tmp_path, steps=3, warmup=1, progress=False
    )
    reference = {(r["method"], r["prompt_tokens"], r["batch"]): r for r in report["reference"]}
    assert set(reference) == {(CEILING, 1, 1), (CEILING, 1, 2), (REFERENCE, 150, 1), (REFERENCE, 150, 2)}
    # generate's cache after 1 + warmup + steps tokens, the last not fed
    for (_, length, batch), row in reference.items():
        assert row["kv_device_bytes"] == layers * 2 * batch * kv_heads * (length + 1 + 1 + 3 - 1) * head_dim * 4
        assert row["ttft_s"] > 0 and row["decode_ms_per_token"] > 0
    rows = {(r["method"], r["batch"]): r for r in report["rows"]}
    grid = {(r["method"], r["batch"]): r for r in json.loads((tmp_path / "speed.json").read_text())["rows"]}
    assert set(rows) == set(grid) and len(rows) == 4
    for key, row in rows.items():
        base = reference[REFERENCE, 150, key[1]]
        assert row["decode_speedup"] == base["decode_ms_per_token"] / grid[key]["decode_ms_per_token"]
        assert row["memory_ratio"] == base["kv_device_bytes"] / grid[key]["kv_device_bytes"]
        assert row["peak_ratio"] == base["peak_bytes"] / grid[key]["peak_bytes"]
        assert (
            row["ttft_s"] == grid[key]["prefill_s"]
            and row["ceiling_ms_per_token"] == reference[CEILING, 1, key[1]]["decode_ms_per_token"]
        )
    assert rows["snapkv:budget=48:window=8", 2]["memory_ratio"] > 2 * rows["full", 2]["memory_ratio"]
    assert (tmp_path / "headline.png").stat().st_size > 1000 and json.loads((tmp_path / "headline.json").read_text())[
        "paper"
    ]["decode_speedup"] == 3.6
    # this model now has been
    with pytest.raises(ValueError, match="needs a model no kvcompress cache has attached to"):
        run_headline(model, ["full"], [150], [1], tmp_path / "again", steps=3, warmup=1, progress=False)
