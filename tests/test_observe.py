"""The papers' observations: the metrics on hand-made cases, and `kvcompress observe` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvcompress.bench.attention_measures import (
    hit_rate,
    outlier_fraction,
    relative_spectrum,
    reuse_fraction,
    significant,
    subspace_similarity,
    top_subspace,
    vote_mask,
)
from kvcompress.methods.shadowkv import chunk_landmarks, chunk_min_cosine

from .fixtures import char_tokenizer, tiny_model


def test_the_hit_rate_of_a_made_up_attention_map():
    """Two heads, a prefix of 10: the window votes for positions 2 and 7 (head 0) and 4 and 5 (head 1); a generated
    token attends above theta to 2, 3 and 7 (head 0) and to 5 (head 1): 3 of its 4 significant positions are
    selected."""
    window = torch.zeros(2, 3, 10)
    window[0, :, 2], window[0, :, 7], window[1, :, 4], window[1, :, 5] = 0.4, 0.3, 0.5, 0.2
    selection = vote_mask(window, share=0.2)  # 2 of 10 per head
    assert selection.nonzero().tolist() == [[0, 2], [0, 7], [1, 4], [1, 5]]
    row = torch.zeros(2, 10)
    row[0, 2], row[0, 3], row[0, 7], row[0, 9], row[1, 5] = 0.3, 0.2, 0.2, 0.04, 0.5  # 0.04 is under theta = 0.05
    assert hit_rate(significant(row, 0.05), selection) == 3 / 4
    assert hit_rate(significant(torch.zeros(2, 10), 0.05), selection) is None  # nothing significant: no rate


def test_subspace_similarity_is_one_for_one_subspace_zero_for_orthogonal_ones_and_in_between_else():
    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(16, 16)).Q
    first, orthogonal = basis[:, :4], basis[:, 4:8]
    rotated = first @ torch.linalg.qr(torch.randn(4, 4)).Q  # another basis of the same subspace
    assert subspace_similarity(first, rotated) == pytest.approx(1.0, abs=1e-5)
    assert subspace_similarity(first, orthogonal) == pytest.approx(0.0, abs=1e-6)
    half = torch.cat([basis[:, :2], basis[:, 8:10]], dim=1)  # shares two of four directions
    assert subspace_similarity(first, half) == pytest.approx(0.5, abs=1e-5)
    for _ in range(5):
        a, b = top_subspace(torch.randn(50, 16), 4), top_subspace(torch.randn(50, 16), 4)
        assert 0.0 <= subspace_similarity(a, b) <= 1.0


def test_a_rank_two_matrix_has_two_relative_singular_values():
    matrix = torch.randn(40, 2) @ torch.randn(2, 12)
    spectrum = relative_spectrum(matrix)
    assert spectrum[0] == 1.0 and spectrum[1] > 1e-3 and bool((spectrum[2:] < 1e-5).all())


def test_cosine_outliers_on_constructed_chunks():
    """Chunks of 4 keys: three chunks of one direction, one with a key turned the other way (its minimum cosine is
    negative)."""
    direction = torch.tensor([1.0, 0.0, 0.0])
    keys = direction.repeat(16, 1) + 0.01 * torch.arange(16.0)[:, None] * torch.tensor([0.0, 1.0, 0.0])
    keys[13] = -direction
    keys = keys[None, None]  # [1, 1, 16, 3]
    valid = torch.ones(1, 16, dtype=torch.bool)
    minimum = chunk_min_cosine(keys, chunk_landmarks(keys, valid, 4), valid, 4).flatten()
    assert bool((minimum[:3] > 0.99).all()) and minimum[3] < 0
    assert outlier_fraction(minimum, 0.5) == 0.25


def test_reuse_is_the_share_of_chunks_selected_again():
    before, now = torch.tensor([[1, 4, 6, 9]]), torch.tensor([[1, 2, 6, 8]])
    assert reuse_fraction(before, now) == 0.5


def test_observe_on_the_command_line(tmp_path):
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "obs"

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            "-m",
            "kvcompress",
            "observe",
            "--model",
            str(folder),
            "--quick",
            "--tokens",
            "120",
            "--out",
            str(out),
            *args,
        ]
        return subprocess.run(command, capture_output=True, text=True, env=env)

    done = run()
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "observations.json").read_text())
    assert {"snapkv_along_generation", "snapkv_question_pairs", "shadowkv_subspaces", "shadowkv_reuse"} <= set(results)
    assert all(0 <= value <= 1 for value in results["shadowkv_subspaces"]["extended context"])
    assert (out / "snapkv_hit_rates.png").stat().st_size > 0 and "SnapKV: H along generation" in done.stdout
    again = run()
    assert again.returncode == 2 and "observations.json exists; add --force" in again.stderr
