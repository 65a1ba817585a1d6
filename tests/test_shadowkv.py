"""ShadowKV: exactness limits, SVD error, Algorithm 2 selection against a loop reference, RoPE rebuild."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvcompress as kvc
from kvcompress.integrations.transformers.rope import apply_rope, invert_rope, rotary_for
from kvcompress.methods.shadowkv import (
    chunk_landmarks,
    key_rows,
    key_spectrum,
    landmark_bias,
    landmark_scores,
    rank_for_error,
    rebuild_keys,
)
from kvcompress.storage.offload import fetch_chunks

from .fixtures import CACHE, char_tokenizer, random_text, tiny_model


def low_rank_factors(
    pre_rope_keys: torch.Tensor, valid: torch.Tensor, ranks: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of each row's keys ``[b, kv_heads, s, d]`` viewed as ``[s, kv_heads*d]``, from the library's
    spectrum: ``A [b, s, r]`` (left singular vectors times singular values) and ``B [b, r, kv_heads, d]``."""
    basis = key_spectrum([(pre_rope_keys, valid)]).basis(ranks)
    factor_b = basis.mT.reshape(basis.shape[0], basis.shape[-1], pre_rope_keys.shape[1], -1)
    return key_rows(pre_rope_keys, valid) @ basis, factor_b


EXACT = dict(rank=32, outliers=0, budget=4096)  # tiny model: 2 KV heads x 16 dims = 32


def teacher_forced_logits(
    model, method, prompt: torch.Tensor, continuation: torch.Tensor
) -> tuple[torch.Tensor, kvc.KVCompressCache]:
    cache = method.make_cache(model)
    with torch.no_grad():
        logits = [model(prompt, **{CACHE: cache}).logits[:, -1]]
        for t in range(continuation.shape[1]):
            logits.append(model(continuation[:, t : t + 1], **{CACHE: cache}).logits[:, -1])
    return torch.stack(logits, dim=1), cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_full_rank_no_outliers_full_budget_matches_full_cache(arch):
    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(0)
    prompt, continuation = torch.randint(3, 128, (1, 300), generator=gen), torch.randint(3, 128, (1, 24), generator=gen)
    full, _ = teacher_forced_logits(model, kvc.FullKV(), prompt, continuation)
    shadow, cache = teacher_forced_logits(model, kvc.ShadowKV(**EXACT), prompt, continuation)
    torch.testing.assert_close(shadow, full, rtol=1e-4, atol=1e-4)
    layer = cache.layers[0]
    # only local chunks, the tail and the continuation stay dense (after the front slots)
    assert layer.slots.used - layer.policy.front == 4 * 8 + 300 % 8 + 24
    # every chunk is selected at every step: the first step reads all from the store, the 23 after reuse all
    assert cache.stats()["chunk_hit_rate"] == pytest.approx(23 / 24)


def test_rank_r_reconstruction_error_is_the_svd_truncation_error():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 200, 16) @ torch.randn(16, 16)  # correlated dims
    valid = torch.ones(1, 200, dtype=torch.bool)
    singular = torch.linalg.svdvals(keys.permute(0, 2, 1, 3).reshape(200, 32))
    for rank in (1, 4, 12, 32):
        a, b = low_rank_factors(keys, valid, rank)
        rebuilt = rebuild_keys(a[:, None].expand(-1, 2, -1, -1), b)
        error = (rebuilt - keys).pow(2).sum()
        torch.testing.assert_close(error, singular[rank:].pow(2).sum(), rtol=1e-3, atol=1e-3)


def test_rank_from_the_error_target_is_the_smallest_that_reaches_it():
    """The rank rebuilds the keys' deviations from their mean within the target, plus one direction
    for the mean: a large component shared by every key (here an offset) does not hide the rest."""
    torch.manual_seed(1)
    # decaying spectrum + shared offset
    keys = torch.randn(2, 2, 120, 16) @ torch.diag(torch.logspace(0, -2, 16)) + 5.0 * torch.randn(1, 2, 1, 16)
    valid = torch.ones(2, 120, dtype=torch.bool)
    valid[1, :40] = False  # the second row is shorter (padding first)
    method = kvc.ShadowKV(rank_error=0.2)
    # streamed in two chunks
    spectrum = key_spectrum([(keys[:, :, :50], valid[:, :50]), (keys[:, :, 50:], valid[:, 50:])])
    ranks = method.ranks(spectrum)
    for row in range(2):
        rows = keys[row].permute(1, 0, 2).reshape(120, 32)[valid[row]]
        centered = rows - rows.mean(dim=0)
        vh = torch.linalg.svd(centered.double()).Vh.T.float()
        errors = [float((centered - centered @ vh[:, :r] @ vh[:, :r].T).norm() / centered.norm()) for r in range(1, 33)]
        expected = next(r for r in range(1, 33) if errors[r - 1] <= 0.2 + 1e-5) + 1
        assert expected > 2 and int(ranks[row]) == min(expected, 16)  # capped at half of the 32-wide keys
        a, b = low_rank_factors(keys[row : row + 1], valid[row : row + 1], int(ranks[row]))
        basis = spectrum.basis(ranks)
        batched_a, batched_b = key_rows(keys, valid) @ basis, basis.mT.reshape(2, -1, 2, 16)
        rebuilt_alone = rebuild_keys(a[:, None].expand(-1, 2, -1, -1), b)
        rebuilt_batched = rebuild_keys(batched_a[row : row + 1, None].expand(-1, 2, -1, -1), batched_b[row : row + 1])
        torch.testing.assert_close(rebuilt_batched, rebuilt_alone, rtol=1e-5, atol=1e-5)  # zero columns change nothing
    uncentered = rank_for_error(spectrum.energy, 0.2, 16)
    assert (uncentered < ranks).all()  # the offset's energy alone would have met the target with fewer


def reference_chunk_selection(
    query: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, k: int
) -> list[list[int]]:
    """Algorithm 2 lines 2-5 for one sequence, loop by loop. query [q_heads, q, d], landmarks [kv_heads, n, d]."""
    q_heads, q_len, dim = query.shape
    kv_heads, n = landmarks.shape[:2]
    group = q_heads // kv_heads
    per_query_head = []
    for h in range(q_heads):
        total = [0.0] * n
        for t in range(q_len):
            logits = [
                float(query[h, t] @ landmarks[h // group, j]) / math.sqrt(dim)
                if selectable[h // group, j]
                else -math.inf
                for j in range(n)
            ]
            peak = max(logits)
            weights = [math.exp(x - peak) for x in logits]
            for j in range(n):
                total[j] += weights[j] / sum(weights)
        per_query_head.append(total)
    chosen = []
    for g in range(kv_heads):
        score = [max(per_query_head[h][j] for h in range(g * group, (g + 1) * group)) for j in range(n)]
        chosen.append(sorted(sorted(range(n), key=lambda j: -score[j])[:k]))
    return chosen


def test_landmark_scoring_and_top_k_match_algorithm_2():
    torch.manual_seed(3)
    query, landmarks = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 40, 8)
    selectable = torch.rand(1, 2, 40) > 0.2
    scores = landmark_scores(query, landmarks, landmark_bias(selectable, landmarks.dtype), 8**-0.5)
    chosen = scores.topk(7, dim=-1).indices.sort(dim=-1).values
    assert chosen[0].tolist() == reference_chunk_selection(query[0], landmarks[0], selectable[0], 7)


def test_landmarks_are_chunk_means():
    keys = torch.randn(1, 2, 24, 4)
    landmarks = chunk_landmarks(keys, torch.ones(1, 24, dtype=torch.bool), 8)
    torch.testing.assert_close(landmarks[0, 1, 2], keys[0, 1, 16:24].mean(dim=0))


def test_rope_inverse_recovers_pre_rope_keys():
    model = tiny_model()
    positions = torch.arange(50)[None]
    pre = torch.randn(1, 2, 50, 16)
    cos, sin = rotary_for(model, 0).cos_sin(positions, pre)
    torch.testing.assert_close(
        invert_rope(apply_rope(pre, cos[:, None], sin[:, None]), cos[:, None], sin[:, None]), pre
    )


def test_rebuilt_keys_carry_rope_at_their_original_positions():
    model = tiny_model()
    prompt = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(5))
    full = DynamicCache(config=model.config)
    cache = kvc.ShadowKV(**EXACT).make_cache(model)
    with torch.no_grad():
        model(prompt, **{CACHE: full})
        model(prompt, **{CACHE: cache})
    layer = cache.layers[1]
    chunks = torch.tensor([[[0, 5, 11], [2, 3, 17]]])
    keys, values = layer.policy.rebuild_keys(chunks), fetch_chunks(layer.policy.store.host, chunks)
    tokens = (chunks[..., None] * 8 + torch.arange(8)).flatten(-2)
    expected = full.layers[1].keys.gather(2, tokens[..., None].expand(-1, -1, -1, 16))
    torch.testing.assert_close(keys, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values, full.layers[1].values.gather(2, tokens[..., None].expand(-1, -1, -1, 16)))


def test_memory_split_between_device_and_offload_store():
    model = tiny_model()
    cache = kvc.ShadowKV(budget=32, rank=4, outliers=2, local_chunks=2).make_cache(model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 403)), **{CACHE: cache})
        model(torch.randint(3, 128, (1, 1)), **{CACHE: cache})
    layer, stats = cache.layers[0], cache.stats()
    n_chunks = (403 - 16) // 8  # 48 chunks; 3 tail tokens + 2 local chunks stay dense
    shadow = layer.policy
    assert shadow.factor_a.shape == (1, n_chunks * 8, 4) and shadow.factor_b.shape == (1, 4, 2, 16)
    assert layer.policy.landmarks.shape == (1, 2, n_chunks, 16)
    # selected chunks, then outliers + local + tail + one generated token
    assert layer.policy.front == 32 and layer.slots.used - layer.policy.front == 2 * 8 + 16 + 3 + 1
    host = layer.policy.store.host
    assert host.shape == (1, 2, n_chunks, 8, 16) and host.device.type == "cpu"
    assert stats["offloaded_bytes"] == 2 * n_chunks * 8 * 2 * 16 * 4

    def held(lyr) -> int:  # every tensor the layer keeps on the device between steps
        names = (
            "factor_a",
            "factor_b",
            "landmarks",
            "bias",
            "inv_freq",
            "selectable",
            "unselectable",
            "step_chunks",
            "selected",
            "hits",
            "front_slots",
        )
        storage = [getattr(lyr.slots, n) for n in ("keys", "values", "valid", "positions", "cursor")]
        tensors = storage + [getattr(lyr.policy, n) for n in names]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    assert stats["device_bytes"] == sum(held(lyr) for lyr in cache.layers)
    assert stats["selected_tokens_per_step"] == 32 and stats["rank"] == 4 and stats["chunk"] == 8
    # outliers never selectable
    assert not layer.policy.selectable.gather(2, layer.slots.positions[:, :, :16:8] // 8).any()


def test_batch_of_prompts_with_different_lengths():
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(300, seed=1), random_text(150, seed=2)]
    batch = kvc.generate(model, tok, prompts, method=kvc.ShadowKV(**EXACT), max_new_tokens=8)
    for row, prompt in enumerate(prompts):
        alone = kvc.generate(model, tok, prompt, method=kvc.FullKV(), max_new_tokens=8)
        assert batch.token_ids[row] == alone.token_ids[0]


def test_follow_up_turn_and_long_generation():
    model, tok = tiny_model(), char_tokenizer()
    chat = [{"role": "user", "content": random_text(300, seed=4)}]
    first = kvc.generate(model, tok, chat, method=kvc.ShadowKV(budget=32, rank=8), max_new_tokens=40)
    dense_before = first.cache.layers[0].slots.used
    second = kvc.generate(model, tok, "and the second word?", past=first, max_new_tokens=40)
    follow_up = second.attention_mask.shape[-1] - first.attention_mask.shape[-1] - len(second.token_ids[0]) + 1
    # appended, not compressed
    assert second.cache.layers[0].slots.used == dense_before + follow_up + len(second.token_ids[0]) - 1
    full_first = kvc.generate(model, tok, chat, method=kvc.ShadowKV(**EXACT), max_new_tokens=40)
    full_second = kvc.generate(model, tok, "and the second word?", past=full_first, max_new_tokens=40)
    reference = kvc.generate(model, tok, chat, method=kvc.FullKV(), max_new_tokens=40)
    reference_second = kvc.generate(model, tok, "and the second word?", past=reference, max_new_tokens=40)
    assert full_second.token_ids == reference_second.token_ids


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: kvc.ShadowKV(rank=0), r"rank=0 is invalid; it must be an integer >= 1"),
        (lambda: kvc.ShadowKV(chunk=0), r"chunk=0 is invalid"),
        (lambda: kvc.ShadowKV(budget=4), r"budget=4 is smaller than one chunk \(chunk=8\)"),
        (lambda: kvc.ShadowKV(ratio=2.0), r"ratio=2.0 is outside the valid range \(0, 1\]"),
        (lambda: kvc.ShadowKV(outliers=-1), r"outliers=-1 is invalid"),
        (
            lambda: kvc.ShadowKV(rank=33).make_cache(tiny_model()),
            r"rank=33 exceeds kv_heads \* head_dim = 32 of this model; valid: 1 to 32",
        ),
    ],
)
def test_bad_parameters(make, expected):
    with pytest.raises(kvc.InvalidParameterError, match=expected):
        make()
