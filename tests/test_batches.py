"""Every method in a batch of prompts of very different lengths: each row equals the row run alone."""

from __future__ import annotations

import pytest
import torch

import kvcompress as kvc

from .fixtures import char_tokenizer, random_text, tiny_model

# Budgets small enough for the tiny model's prompts; every other setting at its default.
METHODS = [
    kvc.FullKV(),
    kvc.SnapKV(budget=64),
    kvc.SnapKV(budget=64, heads="adaptive", layers="pyramid"),
    kvc.StreamingLLM(budget=48),
    kvc.H2O(budget=64),
    kvc.H2O(budget=64, evict_during_decoding=True),
    kvc.H2O(budget=64, heads="adaptive"),
    kvc.ShadowKV(budget=32),
    kvc.Quest(budget=64),
    kvc.Quest(budget=64, offload=True),
    kvc.Loki(budget=64),
    kvc.KVzip(budget=64, chunk=100),
    kvc.KVzip(budget=64, layers="global"),
    kvc.SnapKV(budget=64, layers="global"),  # ranked over the layers at the end of the prefill's call
    kvc.ExpectedAttention(budget=64),
]
# 12 tokens: under every budget, one Quest page and ShadowKV's local chunks; 150 and 420: compressed.
LENGTHS = (11, 149, 419)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_each_row_of_a_batch_equals_the_row_alone(method):
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    batch = kvc.generate(model, tok, prompts, method=method, max_new_tokens=12)
    for row, prompt in enumerate(prompts):
        alone = kvc.generate(model, tok, prompt, method=method, max_new_tokens=12)
        assert batch.token_ids[row] == alone.token_ids[0], f"row {row} ({len(prompt) + 1} tokens)"
        if not (isinstance(method, kvc.H2O) and method.evict_during_decoding):
            for layer in range(2):
                for head, (kept, expected) in enumerate(
                    zip(batch.cache.kept_positions(layer)[row], alone.cache.kept_positions(layer)[0])
                ):
                    assert torch.equal(kept[kept >= 0], expected[expected >= 0]), (
                        f"row {row}, layer {layer}, head {head}"
                    )


def test_quest_never_spends_its_pages_on_padding():
    """Regression: an all-padding page's bound was +inf, so a short row batched with a long one
    attended to padding pages first."""
    model, tok = tiny_model(), char_tokenizer()
    method = kvc.Quest(budget=48, page_size=16)
    prompts = [random_text(120, seed=1), random_text(400, seed=2)]
    batch = kvc.generate(model, tok, prompts, method=method, max_new_tokens=10)
    alone = kvc.generate(model, tok, prompts[0], method=method, max_new_tokens=10)
    assert batch.token_ids[0] == alone.token_ids[0]


def test_shadowkv_outliers_never_come_from_padding():
    """Regression: outliers were the top-k even for rows with fewer real chunks, so padding chunks
    were kept as valid dense slots; rows of 301 and 21 tokens with 2 outliers differed from alone."""
    model, tok = tiny_model(), char_tokenizer()
    method = kvc.ShadowKV(budget=32, rank=8, outliers=2)
    prompts = [random_text(300, seed=3), random_text(20, seed=4)]
    batch = kvc.generate(model, tok, prompts, method=method, max_new_tokens=10)
    for row, prompt in enumerate(prompts):
        assert batch.token_ids[row] == kvc.generate(model, tok, prompt, method=method, max_new_tokens=10).token_ids[0]
    layer = batch.cache.layers[0]
    outlier_slots = layer.slots.positions[1, :, : 2 * 8]  # the dense slots after the front slots of the selected chunks
    # the short row has no chunk to spare
    front = layer.policy.front
    assert (outlier_slots == -1).all() and not layer.slots.valid[1, front : front + 2 * 8].any()
