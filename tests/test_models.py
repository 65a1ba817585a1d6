"""The model families users run: the full cache through kvcompress equals plain ``model.generate``,
and every method either runs or is refused in one line naming the family and the reason. Where the
math says exact (a budget covering the prompt; ShadowKV at rank ``kv_heads x head_dim``; Quest and Loki
attending every token) a method's log-probabilities along the full cache's answer equal the full
cache's within ``LOGPROB_TOLERANCE`` (float32 rounding: the same math in other kernels and orders) and
its tokens are the full cache's; under a small budget it generates, holds or reads fewer KV bytes than
the full cache, and each row of a batch of very different lengths gives what it gives alone."""

from __future__ import annotations

import pytest
import torch

import kvcompress as kvc

from .fixtures import CACHE, FAMILIES, char_tokenizer, family_model, random_text, tiny_model

COVERING = {  # budgets that cover the prompt: the method's output must equal the full cache's
    "snapkv": kvc.SnapKV(budget=500, window=8),
    "streamingllm": kvc.StreamingLLM(budget=500),
    "h2o": kvc.H2O(budget=500),
    "h2o-evicting": kvc.H2O(budget=500, evict_during_decoding=True),
    "shadowkv": kvc.ShadowKV(budget=4096, rank=32, outliers=0),
    "quest": kvc.Quest(budget=4096),
    "loki": kvc.Loki(budget=4096, dim=16),
    "kvzip": kvc.KVzip(budget=500),  # layers="global": every layer's scores ranked together
    "kvzip-uniform": kvc.KVzip(budget=500, layers="uniform"),
    "expected": kvc.ExpectedAttention(budget=500),
    "snapkv-adaptive": kvc.SnapKV(budget=500, window=8, heads="adaptive"),
    # the last layer keeps budget / 20 (over 120)
    "snapkv-pyramid": kvc.SnapKV(budget=4096, window=8, layers="pyramid"),
    "h2o-adaptive": kvc.H2O(budget=500, heads="adaptive"),
    "kvzip-adaptive": kvc.KVzip(budget=500, heads="adaptive"),
    "streamingllm-pyramid": kvc.StreamingLLM(budget=4096, layers="pyramid"),
    "expected-pyramid": kvc.ExpectedAttention(budget=4096, layers="pyramid"),
}
SMALL = {  # budgets that compress a 120-token prompt
    "snapkv": kvc.SnapKV(budget=40, window=8),
    "streamingllm": kvc.StreamingLLM(budget=40),
    "h2o": kvc.H2O(budget=40),
    "h2o-evicting": kvc.H2O(budget=40, evict_during_decoding=True),
    "shadowkv": kvc.ShadowKV(budget=16),
    "quest": kvc.Quest(budget=32),
    "loki": kvc.Loki(budget=32),
    "kvzip": kvc.KVzip(budget=40),
    "kvzip-uniform": kvc.KVzip(budget=40, layers="uniform"),
    "expected": kvc.ExpectedAttention(budget=40),
    "snapkv-adaptive": kvc.SnapKV(budget=40, window=8, heads="adaptive"),
    "snapkv-pyramid": kvc.SnapKV(budget=40, window=8, layers="pyramid"),
    "h2o-adaptive": kvc.H2O(budget=40, heads="adaptive"),
    "kvzip-adaptive": kvc.KVzip(budget=40, heads="adaptive"),
    "streamingllm-pyramid": kvc.StreamingLLM(budget=40, layers="pyramid"),
    "expected-pyramid": kvc.ExpectedAttention(budget=40, layers="pyramid"),
}
SPARSE = ("shadowkv", "quest", "loki")  # drop nothing: each step attends fewer tokens instead
LOGPROB_TOLERANCE = 1e-4
# they invert RoPE
ROTARY_METHODS = (
    ("shadowkv", "ShadowKV"),
    ("expected", "ExpectedAttention"),
    ("expected-pyramid", "ExpectedAttention"),
)
NOT_INVERTIBLE = {
    "gpt2-no-rope": "GPT2LMHeadModel: it has no single rotary",
    "glm4": "Glm4ForCausalLM: its rotary embedding is not the rotate-half",
    "cohere": "CohereForCausalLM: its rotary embedding is not the rotate-half",
}
REFUSED = {
    **{
        (family, method): f"{name} needs rotary position embeddings it can invert, and {reason}"
        for family, reason in NOT_INVERTIBLE.items()
        for method, name in ROTARY_METHODS
    },
    **{
        ("gpt-oss", method): "GptOssForCausalLM uses learned attention sinks.*cannot carry"
        for method in ("h2o-evicting", "quest", "loki", "kvzip", "snapkv-adaptive", "h2o-adaptive", "kvzip-adaptive")
    },
    **{
        ("gpt-oss", method): f"{name} needs rotary position embeddings it can invert, and GptOssForCausalLM: its "
        "rotary embedding is not the rotate-half"
        for method, name in ROTARY_METHODS
    },
}
PROMPT = random_text(119, seed=1)  # 120 tokens with BOS: longer than the 16-token sliding windows


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_cache_equals_plain_generate(family):
    model, tok = family_model(family), char_tokenizer()
    inputs = tok(PROMPT, return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None)[
        0, inputs["input_ids"].shape[1] :
    ].tolist()
    first = kvc.generate(model, tok, PROMPT, method=kvc.FullKV(), max_new_tokens=10)
    assert first.token_ids[0] == plain
    # A follow-up feeds many tokens at once over the cache (sliding windows must hold per query).
    follow_up = " and then some more words"
    second = kvc.generate(model, tok, follow_up, past=first, max_new_tokens=8)
    ids = torch.tensor(
        [inputs["input_ids"][0].tolist() + first.token_ids[0] + tok(follow_up, add_special_tokens=False)["input_ids"]]
    )
    # soft-capping, learned sinks: eager
    model.set_attn_implementation("eager" if family in ("gemma2", "gpt-oss") else "sdpa")
    again = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, ids.shape[1] :].tolist()
    assert second.token_ids[0] == again


@pytest.mark.parametrize("method", list(COVERING))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_method_runs_or_is_refused(family, method):
    model, tok = shared_model(family), char_tokenizer()
    if (family, method) in REFUSED:
        with pytest.raises(kvc.UnsupportedModelError, match=REFUSED[family, method]) as refused:
            kvc.generate(model, tok, PROMPT, method=COVERING[method], max_new_tokens=2)
        assert "\n" not in str(refused.value)
        return
    full, record = full_reference(family)
    covering = kvc.generate(model, tok, PROMPT, method=COVERING[method], max_new_tokens=8)
    assert covering.token_ids == full.token_ids
    logprobs = kvc.teacher_forced_logprobs(model, record, COVERING[method], full.token_ids[0])
    assert (logprobs - full_logprobs(family)).abs().max() <= LOGPROB_TOLERANCE
    batch = kvc.generate(model, tok, [PROMPT, PROMPT[:30]], method=SMALL[method], max_new_tokens=6)
    alone = [
        kvc.generate(model, tok, prompt, method=SMALL[method], max_new_tokens=6) for prompt in (PROMPT, PROMPT[:30])
    ]
    assert batch.token_ids == [result.token_ids[0] for result in alone] and all(batch.token_ids)
    stats = alone[0].stats  # the 120-token row: over every small budget
    if all(layer.is_sliding for layer in alone[0].cache.layers):  # every layer keeps its window, whatever the method
        assert stats["kv_bytes_kept"] == stats["kv_bytes_full"]
    elif method in SPARSE:  # nothing dropped: each step attends fewer tokens than the prompt
        assert stats["selected_tokens_per_step"] < stats["prompt_tokens"]
    else:
        assert stats["kv_bytes_kept"] < stats["kv_bytes_full"]


_REFERENCES: dict[str, tuple[kvc.Result, kvc.Prefill, torch.Tensor]] = {}
_MODELS: dict[str, torch.nn.Module] = {}


def shared_model(family: str) -> torch.nn.Module:
    """One model of ``family`` for all its cells (as a user keeps one model for every cache)."""
    if family not in _MODELS:
        _MODELS[family] = family_model(family)
    return _MODELS[family]


def full_reference(family: str) -> tuple[kvc.Result, kvc.Prefill]:
    """The full cache's answer to PROMPT on ``family``'s model and a prefill record of PROMPT (shared by the cells)."""
    if family not in _REFERENCES:
        model, tok = shared_model(family), char_tokenizer()
        full = kvc.generate(model, tok, PROMPT, method=kvc.FullKV(), max_new_tokens=8)
        record = kvc.prefill(model, tok, PROMPT, query_window=None)
        _REFERENCES[family] = (
            full,
            record,
            kvc.teacher_forced_logprobs(model, record, kvc.FullKV(), full.token_ids[0]),
        )
    return _REFERENCES[family][:2]


def full_logprobs(family: str) -> torch.Tensor:
    full_reference(family)
    return _REFERENCES[family][2]


@pytest.mark.parametrize(
    "method", [kvc.FullKV(), *(m for m in COVERING.values() if m.observation() is None)], ids=lambda m: m.label()
)
@pytest.mark.parametrize(
    "options", [{"num_beams": 3}, {"num_beams": 3, "num_return_sequences": 2}], ids=["beams", "beams-2-returned"]
)
def test_beam_search_through_model_generate(method, options):
    """Beam search reorders every tensor a layer keeps: with budgets that cover the prompt each
    method must give the plain model's beams; with small ones it must at least run to the end."""
    model, tok = tiny_model(), char_tokenizer()
    inputs = tok([random_text(150, seed=2)], return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=8, eos_token_id=None, **options)
    ours = model.generate(
        **inputs, **{CACHE: method.make_cache(model, tok)}, max_new_tokens=8, eos_token_id=None, **options
    )
    assert ours.tolist() == plain.tolist()
    small = SMALL.get(
        method.label()
        .split()[0]
        .replace("h2o", "h2o-evicting" if getattr(method, "evict_during_decoding", False) else "h2o")
    )
    if small is not None:
        out = model.generate(
            **inputs, **{CACHE: small.make_cache(model, tok)}, max_new_tokens=8, eos_token_id=None, **options
        )
        assert out.shape == plain.shape


def test_the_usage_support_table_is_the_matrix():
    """docs/usage.md's family x method table is scripts/family_matrix.py's rendering of docs/img/family_matrix.json,
    whose refusals are exactly the ones this file expects (and no cell fails)."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("family_matrix", root / "scripts/family_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    table = json.loads((root / "docs/img/family_matrix.json").read_text())
    assert matrix.markdown(table) in (root / "docs/usage.md").read_text()
    assert set(table) == set(FAMILIES) and all(list(row) == ["full", *COVERING] for row in table.values())
    for family, row in table.items():
        for method, outcome in row.items():
            assert outcome.startswith("no: ") == ((family, method) in REFUSED) and outcome != "FAILS", (
                family,
                method,
                outcome,
            )


def test_a_learned_sink_is_one_more_logit_in_each_softmax():
    """gpt-oss's sink: softmax over [q.k * scale, sink] with no value for the sink, as the model's eager attention."""
    from kvcompress.storage.attention import spelled_out_with_lse, with_sinks

    torch.manual_seed(0)
    query, keys, values, sinks = (
        torch.randn(2, 4, 3, 16),
        torch.randn(2, 2, 7, 16),
        torch.randn(2, 2, 7, 16),
        torch.randn(4),
    )
    mask = torch.rand(2, 1, 3, 7) > 0.3
    mask[..., 0] = True
    logits = query @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25
    logits = logits.masked_fill(~mask, -torch.inf)
    reference = torch.cat([logits, sinks[None, :, None, None].expand(2, 4, 3, 1)], dim=-1).softmax(-1)[
        ..., :-1
    ] @ values.repeat_interleave(2, dim=1)
    ours = with_sinks(*spelled_out_with_lse(query, keys, values, mask, 0.25), sinks)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_a_scorers_softmax_gives_the_learned_sink_its_share():
    """SnapKV's and H2O's votes are the model's attention probabilities: with a sink, each row sums to less than 1."""
    from kvcompress.storage.attention import key_probabilities, scoring_sinks

    torch.manual_seed(0)
    logits, sinks = torch.randn(2, 4, 3, 7), torch.randn(6)
    with scoring_sinks(sinks):
        ours = key_probabilities(logits, slice(2, 6))
    reference = torch.cat([logits, sinks[2:6][None, :, None, None].expand(2, 4, 3, 1)], dim=-1).softmax(-1)[..., :-1]
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(key_probabilities(logits), logits.softmax(-1))  # no sinks outside a layer's scoring
