"""H2O, Quest and Loki against independent references and their exact limits."""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress as kvc
from kvcompress.methods.h2o import accumulated_attention
from kvcompress.methods.loki import approximate_scores, principal_components
from kvcompress.methods.quest import page_bounds, page_upper_bounds

from .fixtures import char_tokenizer, prefilled_cache, random_text, tiny_model
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
        torch.testing.assert_close(accumulated_attention(query, keys, valid, 8**-0.5, block), full_matrix_accumulated_attention(query, keys, 8**-0.5))


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
    result = kvc.generate(model, tok, random_text(150), method=kvc.H2O(budget=48, evict_during_decoding=True), max_new_tokens=20)
    assert all(layer.keys.shape[-2] == 48 for layer in result.cache.layers)
    small = kvc.generate(model, tok, random_text(30), method=kvc.H2O(budget=200, evict_during_decoding=True), max_new_tokens=8)
    reference = kvc.generate(model, tok, random_text(30), method=kvc.FullKV(), max_new_tokens=8)
    assert small.token_ids == reference.token_ids  # never over budget: nothing evicted, same tokens


def test_quest_bound_is_never_below_the_true_page_maximum():
    torch.manual_seed(1)
    keys, query = torch.randn(1, 2, 64, 8), torch.randn(1, 4, 1, 8)
    low, high = page_bounds(keys, torch.ones(1, 64, dtype=torch.bool), 16)
    bounds = page_upper_bounds(query, low, high)
    true = (query.view(1, 2, 2, 1, 8) @ keys.view(1, 2, 1, 64, 8).transpose(-1, -2)).view(1, 2, 2, 4, 16).amax(-1).amax(2)
    assert (bounds >= true - 1e-5).all()


@pytest.mark.parametrize("method", [kvc.Quest(token_budget=4096, page_size=16), kvc.Quest(token_budget=4096, offload=True), kvc.Loki(token_budget=4096, dim=16)], ids=["quest", "quest-offload", "loki"])
def test_budget_covering_everything_equals_the_full_cache(method):
    model = tiny_model()
    gen = torch.Generator().manual_seed(2)
    prompt, continuation = torch.randint(3, 128, (1, 250), generator=gen), torch.randint(3, 128, (1, 16), generator=gen)
    full, _ = teacher_forced_logits(model, kvc.FullKV(), prompt, continuation)
    sparse, cache = teacher_forced_logits(model, method, prompt, continuation)
    torch.testing.assert_close(sparse, full, rtol=1e-4, atol=1e-4)
    assert cache.layers[0].region_keys is not None  # the sparse path ran


@pytest.mark.parametrize("method", [kvc.Quest(token_budget=64), kvc.Loki(token_budget=64, dim=8)], ids=["quest", "loki"])
def test_selective_methods_keep_every_prompt_position(method):
    kept = prefilled_cache(method, 203).kept_positions(1)
    assert kept.shape == (1, 2, 203) and (kept == torch.arange(203)).all()


def test_quest_offload_reports_fetched_bytes():
    model = tiny_model()
    _, cache = teacher_forced_logits(model, kvc.Quest(token_budget=64, page_size=16, offload=True), torch.randint(3, 128, (1, 300)), torch.randint(3, 128, (1, 4)))
    stats = cache.stats()
    assert stats["offloaded_bytes"] == 2 * 2 * (300 // 16 * 16) * 16 * 4 * 2
    assert stats["fetched_bytes_per_step"] == 2 * 2 * 64 * 16 * 4 * 2  # 2 layers x K,V x 64 tokens x 2 heads x 16 dims x 4 B


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
    _, cache = teacher_forced_logits(model, kvc.Loki(token_budget=64, dim=4, calibration=str(path)), torch.randint(3, 128, (1, 200)), torch.randint(3, 128, (1, 2)))
    assert torch.equal(cache.layers[0].components[0, 0], torch.eye(16)[:, :4])


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: kvc.H2O(budget=8, recent=8), r"H2O: budget=8 must be greater than recent=8"),
        (lambda: kvc.H2O(block=0), r"block=0 is invalid"),
        (lambda: kvc.Quest(token_budget=8, page_size=16), r"token_budget=8 is smaller than one page \(page_size=16\)"),
        (lambda: kvc.Quest(page_size=0), r"page_size=0 is invalid"),
        (lambda: kvc.Loki(dim=0), r"dim=0 is invalid"),
        (lambda: kvc.Loki(dim=17).make_cache(tiny_model()), r"Loki: dim=17 exceeds head_dim=16; valid: 1 to 16"),
    ],
)
def test_bad_parameters(make, expected):
    with pytest.raises(kvc.InvalidParameterError, match=expected):
        make()


@pytest.mark.parametrize("method", [kvc.H2O(budget=64), kvc.Quest(token_budget=64), kvc.Loki(token_budget=64, dim=8)], ids=lambda m: m.name)
def test_batches_and_prefill_reuse(method):
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(200, seed=1), random_text(90, seed=2)]
    fresh = kvc.generate(model, tok, prompts, method=method, max_new_tokens=6)
    record = kvc.prefill(model, tok, prompts, query_window=method.queries_needed())
    assert kvc.generate(model, tok, method=method, prefill=record, max_new_tokens=6).token_ids == fresh.token_ids


@pytest.mark.parametrize(
    "method",
    [kvc.Quest(token_budget=64), kvc.Loki(token_budget=64, dim=8), kvc.H2O(budget=64, evict_during_decoding=True), kvc.ShadowKV(sparse_budget=32, rank=8)],
    ids=lambda m: m.name,
)
def test_several_new_tokens_at_once_over_a_compressed_cache(method):
    """Follow-up turns and teacher forcing append many tokens in one forward pass."""
    model, tok = tiny_model(), char_tokenizer()
    record = kvc.prefill(model, tok, random_text(250, seed=3), query_window=method.queries_needed())
    logprobs = kvc.teacher_forced_logprobs(model, record, method, list(range(40, 52)))
    assert logprobs.shape == (12, 128) and torch.isfinite(logprobs).all()
