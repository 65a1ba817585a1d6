"""H2O, Quest and Loki against independent references and their exact limits."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvcompress as kvc
from kvcompress.methods.h2o import accumulated_attention
from kvcompress.methods.loki import approximate_scores, principal_components
from kvcompress.methods.quest import page_bounds, page_upper_bounds
from kvcompress.methods.selection import select_kept
from kvcompress.storage.slots import spare_slots

from .fixtures import CACHE, char_tokenizer, prefilled_cache, random_text, tiny_model
from .test_shadowkv import teacher_forced_logits


def full_matrix_accumulated_attention(query, keys, scaling):
    """The whole prompt x prompt attention matrix at once, summed over queries (the H2O definition)."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    logits = query.float() @ k.transpose(-1, -2) * scaling
    seq = query.shape[2]
    logits = logits.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), -math.inf)
    return logits.softmax(-1).sum(dim=2)


def test_h2o_blockwise_scores_equal_the_full_matrix():
    torch.manual_seed(0)
    query, keys = torch.randn(2, 6, 100, 8), torch.randn(2, 3, 100, 8)
    valid = torch.ones(2, 100, dtype=torch.bool)
    for block in (1, 7, 64, 256):
        torch.testing.assert_close(
            accumulated_attention(query, keys, valid, 8**-0.5, block),
            full_matrix_accumulated_attention(query, keys, 8**-0.5),
        )


def test_h2o_keeps_heavy_hitters_and_recent_tokens():
    kept = prefilled_cache(kvc.H2O(budget=40, recent=10), 120).kept_positions(0)
    assert kept.shape == (1, 2, 40) and (kept[..., -10:] == torch.arange(110, 120)).all()


def test_h2o_evicting_layer_selects_the_prompt_like_plain_h2o():
    plain = prefilled_cache(kvc.H2O(budget=40, recent=10), 150)
    evicting = prefilled_cache(kvc.H2O(budget=40, recent=10, evict_during_decoding=True), 150)
    for layer in range(2):
        assert torch.equal(evicting.kept_positions(layer), plain.kept_positions(layer))


def test_h2o_evicting_while_decoding_stays_at_budget():
    model, tok = tiny_model(), char_tokenizer()
    result = kvc.generate(
        model, tok, random_text(150), method=kvc.H2O(budget=48, evict_during_decoding=True), max_new_tokens=20
    )
    for layer in result.cache.layers:  # 48 slots held; the buffers keep only the room a step needs
        assert (
            layer.slots.used == 48
            and not layer.slots.valid[:, 48:].any()
            and layer.keys.shape[-2] <= 48 + 1 + spare_slots(48 + 1)
        )
    small = kvc.generate(
        model, tok, random_text(30), method=kvc.H2O(budget=200, evict_during_decoding=True), max_new_tokens=8
    )
    reference = kvc.generate(model, tok, random_text(30), method=kvc.FullKV(), max_new_tokens=8)
    assert small.token_ids == reference.token_ids  # never over budget: nothing evicted, same tokens


def test_quest_bound_is_never_below_the_true_page_maximum():
    torch.manual_seed(1)
    keys, query = torch.randn(1, 2, 64, 8), torch.randn(1, 4, 1, 8)
    low, high = page_bounds(keys, torch.ones(1, 64, dtype=torch.bool), 16)
    bounds = page_upper_bounds(query, low, high - low)
    true = (
        (query.view(1, 2, 2, 1, 8) @ keys.view(1, 2, 1, 64, 8).transpose(-1, -2)).view(1, 2, 2, 4, 16).amax(-1).amax(2)
    )
    assert (bounds >= true - 1e-5).all()


@pytest.mark.parametrize(
    "method",
    [kvc.Quest(budget=4096, page_size=16), kvc.Quest(budget=4096, offload=True), kvc.Loki(budget=4096, dim=16)],
    ids=["quest", "quest-offload", "loki"],
)
def test_budget_covering_everything_equals_the_full_cache(method):
    model = tiny_model()
    gen = torch.Generator().manual_seed(2)
    prompt, continuation = torch.randint(3, 128, (1, 250), generator=gen), torch.randint(3, 128, (1, 16), generator=gen)
    full, _ = teacher_forced_logits(model, kvc.FullKV(), prompt, continuation)
    sparse, cache = teacher_forced_logits(model, method, prompt, continuation)
    torch.testing.assert_close(sparse, full, rtol=1e-4, atol=1e-4)
    assert cache.layers[0].policy.store is not None  # the sparse path ran


@pytest.mark.parametrize("method", [kvc.Quest(budget=64), kvc.Loki(budget=64, dim=8)], ids=["quest", "loki"])
def test_selective_methods_keep_every_prompt_position(method):
    kept = prefilled_cache(method, 203).kept_positions(1)
    assert kept.shape == (1, 2, 203) and (kept == torch.arange(203)).all()


def test_quest_offload_reports_fetched_bytes():
    model = tiny_model()
    _, cache = teacher_forced_logits(
        model,
        kvc.Quest(budget=64, page_size=16, offload=True),
        torch.randint(3, 128, (1, 300)),
        torch.randint(3, 128, (1, 4)),
    )
    stats = cache.stats()
    assert stats["offloaded_bytes"] == 2 * 2 * (300 // 16 * 16) * 16 * 4 * 2
    # 2 layers x K,V x 64 tokens x 2 heads x 16 dims x 4 B
    assert stats["fetched_bytes_per_step"] == 2 * 2 * 64 * 16 * 4 * 2


def test_loki_full_dimension_scores_are_exact():
    torch.manual_seed(3)
    keys, query = torch.randn(1, 2, 40, 8), torch.randn(1, 4, 1, 8)
    components = principal_components(keys, torch.ones(1, 40, dtype=torch.bool))
    approx = approximate_scores(query, keys @ components, components)
    exact = (query.view(1, 2, 2, 8) @ keys.transpose(-1, -2)).amax(2)
    torch.testing.assert_close(approx, exact, rtol=1e-4, atol=1e-4)


def test_loki_with_a_calibration_file(tmp_path):
    model = tiny_model()
    path = tmp_path / "components.pt"
    torch.save(torch.eye(16).expand(2, 2, 16, 16).clone(), path)
    _, cache = teacher_forced_logits(
        model,
        kvc.Loki(budget=64, dim=4, calibration=str(path)),
        torch.randint(3, 128, (1, 200)),
        torch.randint(3, 128, (1, 2)),
    )
    assert torch.equal(cache.layers[0].policy.components[0, 0], torch.eye(16)[:, :4])


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: kvc.H2O(budget=8, recent=8), r"H2O: budget=8 must be greater than recent=8"),
        (lambda: kvc.H2O(block=0), r"block=0 is invalid"),
        (lambda: kvc.Quest(budget=8, page_size=16), r"budget=8 is smaller than one page \(page_size=16\)"),
        (lambda: kvc.Quest(page_size=0), r"page_size=0 is invalid"),
        (lambda: kvc.Loki(dim=0), r"dim=0 is invalid"),
        (lambda: kvc.Loki(dim=17).make_cache(tiny_model()), r"Loki: dim=17 exceeds head_dim=16; valid: 1 to 16"),
    ],
)
def test_bad_parameters(make, expected):
    with pytest.raises(kvc.InvalidParameterError, match=expected):
        make()


@pytest.mark.parametrize(
    "method", [kvc.H2O(budget=64), kvc.Quest(budget=64), kvc.Loki(budget=64, dim=8)], ids=lambda m: m.name
)
def test_batches_and_prefill_reuse(method):
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(200, seed=1), random_text(90, seed=2)]
    fresh = kvc.generate(model, tok, prompts, method=method, max_new_tokens=6)
    record = kvc.prefill(model, tok, prompts, query_window=method.queries_needed())
    assert kvc.generate(model, tok, method=method, prefill=record, max_new_tokens=6).token_ids == fresh.token_ids


@pytest.mark.parametrize(
    "method",
    [
        kvc.Quest(budget=4096),
        kvc.Loki(budget=4096, dim=16),
        kvc.H2O(budget=4096, evict_during_decoding=True),
        kvc.ShadowKV(budget=4096, rank=32, outliers=0),
    ],
    ids=lambda m: m.name,
)
def test_several_new_tokens_at_once_over_a_compressed_cache(method):
    """Follow-up turns and teacher forcing append many tokens in one forward pass: with budgets that
    cover everything (and ShadowKV at full rank) the block gives the full cache's log-probabilities."""
    model, tok = tiny_model(), char_tokenizer()
    record = kvc.prefill(model, tok, random_text(250, seed=3), query_window=method.queries_needed())
    tokens = list(range(40, 52))
    logprobs = kvc.teacher_forced_logprobs(model, record, method, tokens)
    torch.testing.assert_close(
        logprobs, kvc.teacher_forced_logprobs(model, record, kvc.FullKV(), tokens), rtol=1e-4, atol=1e-4
    )


def prefilled_pair(method, length: int, seed: int = 0):
    """A tiny model's full cache (transformers' own) and ``method``'s cache after the same prompt."""
    model = tiny_model()
    prompt = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))
    full = DynamicCache(config=model.config)
    cache = method.make_cache(model, char_tokenizer())
    with torch.no_grad():
        model(prompt, **{CACHE: full})
        model(prompt, **{CACHE: cache})
    return full, cache


def test_h2o_keeps_the_reference_heavy_hitters():
    """H2O, loop by loop: each key's attention summed over all causal queries, averaged over the
    query heads of its KV head; the top budget - recent positions plus the recent ones."""
    torch.manual_seed(4)
    query, keys = torch.randn(1, 4, 30, 8), torch.randn(1, 2, 30, 8)
    method = kvc.H2O(budget=12, recent=4)
    scores = method.scores(query, keys, torch.ones(1, 30, dtype=torch.bool), 8**-0.5)
    kept, _ = select_kept(scores, torch.ones(1, 30, dtype=torch.bool), torch.tensor([12]))
    for g in range(2):
        received = [0.0] * 30
        for h in (2 * g, 2 * g + 1):
            for i in range(30):
                weights = torch.softmax(
                    torch.stack([query[0, h, i] @ keys[0, g, j] * 8**-0.5 for j in range(i + 1)]), 0
                )
                for j in range(i + 1):
                    received[j] += float(weights[j]) / 2
        heavy = sorted(sorted(range(26), key=lambda j: -received[j])[:8])
        assert kept[0, g].tolist() == heavy + [26, 27, 28, 29]


def test_quest_bounds_and_pages_match_a_loop_reference():
    full, cache = prefilled_pair(kvc.Quest(budget=48, page_size=16), 200, seed=5)
    layer = cache.layers[1]
    keys = full.layers[1].keys[0]  # [2, 200, 16]
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(6))
    chosen, counted = layer.policy.select(query, 0.25)
    pages = 200 // 16
    for g in range(2):
        bounds = []
        for p in range(pages):
            page = keys[g, 16 * p : 16 * (p + 1)]
            low, high = page.min(0).values, page.max(0).values
            bound = max(
                sum(max(float(q[d] * low[d]), float(q[d] * high[d])) for d in range(16))
                for q in query[0, 2 * g : 2 * g + 2, 0]
            )
            bounds.append(bound)
        exact = [
            max(float(query[0, h, 0] @ keys[g, t]) for h in (2 * g, 2 * g + 1) for t in range(16 * p, 16 * (p + 1)))
            for p in range(pages)
        ]
        assert all(b >= e - 1e-4 for b, e in zip(bounds, exact))
        scores = layer.policy.chunk_scores(query, 0.25)[0, g]
        torch.testing.assert_close(scores, torch.tensor(bounds), rtol=1e-5, atol=1e-5)
        # every chunk counts
        assert (
            sorted(chosen[0, g].tolist()) == sorted(sorted(range(pages), key=lambda p: -bounds[p])[:3])
            and counted is None
        )


def test_shadowkv_outliers_are_the_chunks_least_like_their_landmark():
    """Outliers, loop by loop: per KV head, the chunks whose lowest cosine similarity to their own
    mean key is smallest (the local chunks at the end are never candidates)."""
    full, cache = prefilled_pair(kvc.ShadowKV(budget=32, rank=8, outliers=3, local_chunks=2), 203, seed=7)
    keys = full.layers[0].keys[0]
    chunks = (203 - 2 * 8) // 8
    for g in range(2):
        lowest = []
        for c in range(chunks):
            block = keys[g, 8 * c : 8 * (c + 1)]
            mean = block.mean(0)
            lowest.append(min(float(torch.nn.functional.cosine_similarity(k, mean, dim=0)) for k in block))
        expected = sorted(sorted(range(chunks), key=lambda c: lowest[c])[:3])
        outlier_positions = cache.layers[0].slots.positions[0, g, : 3 * 8].view(3, 8)
        assert (outlier_positions[:, 0] // 8).tolist() == expected
        assert not cache.layers[0].policy.selectable[0, g, expected].any()


def test_loki_components_and_selection_match_a_reference():
    """Components: eigenvectors of K^T K by decreasing eigenvalue (up to sign). Selection: the
    top-budget tokens by (qP)(KP)^T, max over the query heads of the KV head."""
    full, cache = prefilled_pair(kvc.Loki(budget=40, dim=6, recent=10), 150, seed=8)
    layer, keys = cache.layers[1], full.layers[1].keys[0].double()  # [2, 150, 16]
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(9))
    chosen, counted = layer.policy.select(query, 0.25)
    for g in range(2):
        region = keys[g, :140]
        values, vectors = torch.linalg.eigh(region.T @ region)
        reference = vectors[:, values.argsort(descending=True)[:6]]
        components = layer.policy.components[0, g].double().abs()
        torch.testing.assert_close(components, reference.abs(), rtol=1e-3, atol=1e-3)
        projected = region @ reference
        score = [
            max(float((query[0, h, 0].double() @ reference) @ projected[t]) for h in (2 * g, 2 * g + 1))
            for t in range(140)
        ]
        assert (
            sorted(chosen[0, g].tolist()) == sorted(sorted(range(140), key=lambda t: -score[t])[:40])
            and counted is None
        )
