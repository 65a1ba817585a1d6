"""The model families users run: the full cache through kvcompress equals plain ``model.generate``,
and every method either runs (a budget covering the prompt equals the full cache) or is refused."""

from __future__ import annotations

import pytest
import torch

import kvcompress as kvc

from .fixtures import FAMILIES, char_tokenizer, family_model, random_text, tiny_model

COVERING = {  # budgets that cover the prompt: the method's output must equal the full cache's
    "snapkv": kvc.SnapKV(budget=500, window=8),
    "streamingllm": kvc.StreamingLLM(budget=500),
    "h2o": kvc.H2O(budget=500),
    "h2o-evicting": kvc.H2O(budget=500, evict_during_decoding=True),
    "shadowkv": kvc.ShadowKV(budget=4096, rank=32, outliers=0),
    "quest": kvc.Quest(budget=4096),
    "loki": kvc.Loki(budget=4096, dim=16),
}
SMALL = {  # budgets that compress a 120-token prompt
    "snapkv": kvc.SnapKV(budget=40, window=8),
    "streamingllm": kvc.StreamingLLM(budget=40),
    "h2o": kvc.H2O(budget=40),
    "h2o-evicting": kvc.H2O(budget=40, evict_during_decoding=True),
    "shadowkv": kvc.ShadowKV(budget=16),
    "quest": kvc.Quest(budget=32),
    "loki": kvc.Loki(budget=32),
}
REFUSED = {("gpt2-no-rope", "shadowkv"): "ShadowKV needs rotary position embeddings it can invert, and GPT2LMHeadModel: it has no single rotary"}
PROMPT = random_text(119, seed=1)  # 120 tokens with BOS: longer than the 16-token sliding windows


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_cache_equals_plain_generate(family):
    model, tok = family_model(family), char_tokenizer()
    inputs = tok(PROMPT, return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None)[0, inputs["input_ids"].shape[1] :].tolist()
    first = kvc.generate(model, tok, PROMPT, method=kvc.FullKV(), max_new_tokens=10)
    assert first.token_ids[0] == plain
    # A follow-up feeds many tokens at once over the cache (sliding windows must hold per query).
    follow_up = " and then some more words"
    second = kvc.generate(model, tok, follow_up, past=first, max_new_tokens=8)
    ids = torch.tensor([inputs["input_ids"][0].tolist() + first.token_ids[0] + tok(follow_up, add_special_tokens=False)["input_ids"]])
    model.set_attn_implementation("eager" if family == "gemma2" else "sdpa")
    again = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, ids.shape[1] :].tolist()
    assert second.token_ids[0] == again


@pytest.mark.parametrize("method", list(COVERING))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_method_runs_or_is_refused(family, method):
    model, tok = family_model(family), char_tokenizer()
    if (family, method) in REFUSED:
        with pytest.raises(kvc.UnsupportedModelError, match=REFUSED[family, method]):
            COVERING[method].make_cache(model)
        return
    full = kvc.generate(model, tok, PROMPT, method=kvc.FullKV(), max_new_tokens=8)
    assert kvc.generate(model, tok, PROMPT, method=COVERING[method], max_new_tokens=8).token_ids == full.token_ids
    batch = kvc.generate(model, tok, [PROMPT, PROMPT[:30]], method=SMALL[method], max_new_tokens=6)
    alone = kvc.generate(model, tok, PROMPT[:30], method=SMALL[method], max_new_tokens=6)
    assert batch.token_ids[1] == alone.token_ids[0]


@pytest.mark.parametrize("method", [kvc.FullKV(), *COVERING.values()], ids=lambda m: m.label())
@pytest.mark.parametrize("options", [{"num_beams": 3}, {"num_beams": 3, "num_return_sequences": 2}], ids=["beams", "beams-2-returned"])
def test_beam_search_through_model_generate(method, options):
    """Beam search reorders every tensor a layer keeps: with budgets that cover the prompt each
    method must give the plain model's beams; with small ones it must at least run to the end."""
    model, tok = tiny_model(), char_tokenizer()
    inputs = tok([random_text(150, seed=2)], return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=8, eos_token_id=None, **options)
    ours = model.generate(**inputs, past_key_values=method.make_cache(model, tok), max_new_tokens=8, eos_token_id=None, **options)
    assert ours.tolist() == plain.tolist()
    small = SMALL.get(method.label().split()[0].replace("h2o", "h2o-evicting" if getattr(method, "evict_during_decoding", False) else "h2o"))
    if small is not None:
        out = model.generate(**inputs, past_key_values=small.make_cache(model, tok), max_new_tokens=8, eos_token_id=None, **options)
        assert out.shape == plain.shape
