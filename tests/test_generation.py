"""kvcompress caches inside transformers: model.generate, batches, positions, follow-up turns."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

import kvcompress as kvc

from .fixtures import CACHE, char_tokenizer, family_model, prefilled_cache, random_text, tiny_model

METHODS = [kvc.FullKV(), kvc.SnapKV(budget=64, window=8, kernel=5), kvc.StreamingLLM(budget=48, sinks=4)]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_model_generate_agrees_with_kvc_generate(method, tok):
    model = tiny_model()
    prompt = random_text(180, seed=2)
    ours = kvc.generate(model, tok, prompt, method=method, max_new_tokens=12)
    inputs = tok(prompt, return_tensors="pt")
    cache = method.make_cache(model, tok)
    out = model.generate(**inputs, **{CACHE: cache}, max_new_tokens=12, do_sample=False, eos_token_id=None)
    theirs = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert theirs[: len(ours.token_ids[0])] == ours.token_ids[0]
    assert cache.stats()["kv_tokens_per_layer"] == ours.cache.stats()["kv_tokens_per_layer"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_each_row_of_a_batch_matches_the_prompt_alone(arch, method, tok):
    model = tiny_model(arch)
    prompts = [random_text(n, seed=n) for n in (40, 150, 95)]  # the first is shorter than every budget
    batch = kvc.generate(model, tok, prompts, method=method, max_new_tokens=10)
    for row, prompt in enumerate(prompts):
        alone = kvc.generate(model, tok, prompt, method=method, max_new_tokens=10)
        assert batch.token_ids[row] == alone.token_ids[0], f"row {row}"
        for layer in range(2):
            kept = batch.cache.kept_positions(layer)[row]
            kept = kept[kept >= 0].view(kept.shape[0], -1)
            assert torch.equal(kept, alone.cache.kept_positions(layer)[0])


def test_batched_model_generate_with_left_padding(tok):
    model = tiny_model()
    method = kvc.SnapKV(budget=64, window=8)
    prompts = [random_text(60, seed=5), random_text(160, seed=6)]
    tok.padding_side = "left"
    inputs = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **inputs, **{CACHE: method.make_cache(model, tok)}, max_new_tokens=8, do_sample=False, eos_token_id=None
    )
    ours = kvc.generate(model, tok, prompts, method=method, max_new_tokens=8)
    for row in range(2):
        generated = out[row, inputs["input_ids"].shape[1] :].tolist()
        assert generated[: len(ours.token_ids[row])] == ours.token_ids[row]


def test_padding_is_never_kept(tok):
    model = tiny_model()
    prompts = [random_text(100, seed=1), random_text(300, seed=2)]
    result = kvc.generate(model, tok, prompts, method=kvc.SnapKV(budget=80, window=8), max_new_tokens=2)
    layer = result.cache.layers[0]
    # Row 0 (101 real tokens) and row 1 (301) both keep 80: no filler slots, no padding.
    assert layer.slots.valid is None or layer.slots.valid[:, :80].all()
    assert (result.cache.kept_positions(0) >= 0).all()
    assert result.cache.kept_positions(0)[0].max() <= 100


def test_rope_positions_continue_from_the_true_prompt_length():
    """StreamingLLM drops the same positions in every head, so the step after prefill equals a
    full-cache step whose mask hides those positions, at the true next position."""
    model = tiny_model()
    length, sinks, budget = 90, 4, 30
    ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(7))
    nxt = torch.tensor([[42]])
    with torch.no_grad():
        cache = kvc.StreamingLLM(budget=budget, sinks=sinks).make_cache(model)
        model(ids, **{CACHE: cache})
        ours = model(nxt, **{CACHE: cache}).logits
        full = DynamicCache(config=model.config)
        model(ids, **{CACHE: full})
        mask = torch.ones(1, length + 1, dtype=torch.long)
        mask[0, sinks : length - (budget - sinks)] = 0
        reference = model(nxt, **{CACHE: full}, attention_mask=mask, position_ids=torch.tensor([[length]])).logits
    assert cache.kept_positions(0)[0, 0].tolist() == list(range(sinks)) + list(range(length - budget + sinks, length))
    assert cache.get_seq_length() == length + 1
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_streamingllm_keeps_exactly_sinks_and_recent():
    cache = prefilled_cache(kvc.StreamingLLM(budget=20, sinks=3), 70)
    expected = list(range(3)) + list(range(53, 70))
    for layer in range(2):
        assert cache.kept_positions(layer).tolist() == [[expected, expected]]


def test_a_sliding_layer_tells_the_prompt_positions_its_window_holds(tok):
    """A sliding-window layer holds what the next token sees: its prompt's last window - 1 tokens less the answer's
    tokens fed since (``kept_positions`` said none: the window's positions were cut to its last window - 1 twice,
    and a ring's were never updated). Alone, over a stored context (the question's tokens are the newest), and for
    each row of a batch, padding between a stored context and a shorter question included, as alone."""
    model = family_model("gemma3")
    window, method = model.config.sliding_window, kvc.SnapKV(budget=32, window=8)
    store = kvc.compress(model, tok, random_text(300, seed=4), method=kvc.FullKV())
    prompts, questions = [random_text(200, seed=3), random_text(120, seed=5)], ["What is it?", "Why?"]
    alone = [kvc.generate(model, tok, p, method=method, max_new_tokens=4) for p in prompts]
    over = [kvc.generate(model, tok, q, past=store, method=method, max_new_tokens=4) for q in questions]
    batches = [
        kvc.generate(model, tok, prompts, method=method, max_new_tokens=4),
        kvc.generate(model, tok, questions, past=store, method=method, max_new_tokens=4),
    ]
    sliding = [i for i, layer in enumerate(alone[0].cache.layers) if layer.is_sliding]
    assert sliding
    for result in alone + over:
        prompt, fed = result.stats["prompt_tokens"], result.stats["new_tokens"] - 1
        for layer in sliding:
            assert result.cache.kept_positions(layer)[0, 0].tolist() == list(range(prompt - window + 1 + fed, prompt))
    for batch, rows in zip(batches, (alone, over)):
        for row, result in enumerate(rows):
            for layer in sliding:
                held = batch.cache.kept_positions(layer)[row, 0]
                assert held[held >= 0].tolist() == result.cache.kept_positions(layer)[0, 0].tolist()


def test_follow_up_question_over_a_compressed_cache(tok):
    model = tiny_model()
    chat = [{"role": "user", "content": random_text(200, seed=3)}]
    first = kvc.generate(model, tok, chat, method=kvc.SnapKV(budget=64, window=8), max_new_tokens=6)
    slots_before = first.cache.layers[0].keys.shape[-2]
    second = kvc.generate(model, tok, "and then?", past=first, max_new_tokens=6)
    assert second.cache is first.cache
    assert second.cache.layers[0].keys.shape[-2] > slots_before
    # The follow-up is appended, not compressed again: the prompt's kept positions are unchanged.
    assert torch.equal(second.cache.kept_positions(0), first.cache.kept_positions(0))
    # Same tokens as feeding the whole rendered conversation to a cache compressed at the same point.
    assert second.rows[0].transcript.endswith("[user]and then?\n[assistant]")


def test_follow_up_equals_full_conversation_with_full_cache(tok):
    model = tiny_model()
    chat = [{"role": "user", "content": random_text(80, seed=9)}]
    first = kvc.generate(model, tok, chat, method=kvc.FullKV(), max_new_tokens=5)
    second = kvc.generate(model, tok, "next", past=first, max_new_tokens=5)
    transcript = second.rows[0].transcript
    ids = tok(transcript, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert out[0, ids.shape[1] :].tolist()[: len(second.token_ids[0])] == second.token_ids[0]


def test_stats_report_the_required_fields(tok):
    model = tiny_model()
    result = kvc.generate(model, tok, random_text(150), method=kvc.SnapKV(budget=64, window=8), max_new_tokens=5)
    for field in (
        "prompt_tokens",
        "new_tokens",
        "kv_tokens_per_layer",
        "kv_bytes_full",
        "kv_bytes_kept",
        "prefill_s",
        "decode_ms_per_token",
    ):
        assert field in result.stats
    assert result.stats["prompt_tokens"] == 151
    assert result.stats["kv_bytes_kept"] < result.stats["kv_bytes_full"]
    assert result.stats["prefill_s"] > 0


def test_model_behaves_as_sdpa_for_other_caches():
    model = tiny_model()
    ids = torch.randint(3, 128, (2, 50))
    with torch.no_grad():
        before = model(ids).logits
        kvc.SnapKV(budget=40, window=8).make_cache(model, char_tokenizer())
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "options", [{"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}], ids=["beams", "samples"]
)
def test_model_generate_search_modes_keep_the_budget(options, tok):
    model = tiny_model()
    inputs = tok([random_text(150)], return_tensors="pt")
    cache = kvc.SnapKV(budget=64, window=8).make_cache(model, char_tokenizer())
    out = model.generate(**inputs, **{CACHE: cache}, max_new_tokens=6, eos_token_id=None, **options)
    assert out.shape[-1] == inputs["input_ids"].shape[1] + 6
    assert cache.stats()["kv_tokens_per_layer"] == [64 + 5, 64 + 5]


def test_right_padding_is_refused(tok):
    model = tiny_model()
    tok.padding_side = "right"
    try:
        batch = tok([random_text(50), random_text(150)], return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "left"
    with pytest.raises(ValueError, match="kvcompress needs left-padded batches"):
        with torch.no_grad():
            model(**batch, **{CACHE: kvc.SnapKV(budget=64, window=8).make_cache(model, char_tokenizer())})


ALL_METHODS = METHODS + [kvc.ShadowKV(budget=32, rank=8)]


@pytest.mark.parametrize("method", ALL_METHODS, ids=lambda m: m.name)
def test_one_prefill_reused_by_every_method_equals_a_fresh_prefill(method, tok):
    model = tiny_model()
    prompts = [random_text(220, seed=11), random_text(90, seed=12)]
    record = kvc.prefill(model, tok, prompts, query_window=16)
    reused = kvc.generate(model, tok, method=method, prefill=record, max_new_tokens=10)
    fresh = kvc.generate(model, tok, prompts, method=method, max_new_tokens=10)
    assert reused.token_ids == fresh.token_ids
    for a, b in zip(reused.cache.layers, fresh.cache.layers):
        assert torch.equal(a.kept_positions(), b.kept_positions())
    again = kvc.generate(model, tok, method=method, prefill=record, max_new_tokens=10)
    assert again.token_ids == reused.token_ids  # the record is not consumed


def test_teacher_forced_logprobs_follow_the_full_cache(tok):
    model = tiny_model()
    record = kvc.prefill(model, tok, random_text(200, seed=13), query_window=8)
    answer = kvc.generate(model, tok, method=kvc.FullKV(), prefill=record, max_new_tokens=6).token_ids[0]
    full = kvc.teacher_forced_logprobs(model, record, kvc.FullKV(), answer)
    assert full.shape == (len(answer), 128)
    assert full.argmax(-1).tolist() == answer
    snap = kvc.teacher_forced_logprobs(model, record, kvc.SnapKV(budget=500, window=8), answer)
    torch.testing.assert_close(snap, full)  # budget covers the prompt: identical


def test_forced_logprobs_follow_generate_over_a_stored_context_and_a_conversation(tok):
    """Teacher-forced over the cache ``generate`` with the same arguments decodes from: fed that call's own greedy
    answer, each row's top token is the answer's next one; over a stored context with a method, and as a later turn
    continuing a conversation; a batch is refused by name."""
    model = tiny_model()
    store = kvc.compress(model, tok, random_text(300, seed=5), method=kvc.FullKV())
    method = kvc.SnapKV(budget=64, window=8)
    first = kvc.generate(model, tok, "a question", past=store, method=method, max_new_tokens=6)
    forced = kvc.forced_logprobs(model, tok, first.token_ids[0], prompt="a question", past=store, method=method)
    assert forced.shape == (len(first.token_ids[0]), 128) and forced.argmax(-1).tolist() == first.token_ids[0]
    later = kvc.generate(model, tok, "and then", past=first.copy(), max_new_tokens=5)  # (a turn appends to its past)
    assert (
        kvc.forced_logprobs(model, tok, later.token_ids[0], prompt="and then", past=first.copy()).argmax(-1).tolist()
        == later.token_ids[0]
    )
    with pytest.raises(kvc.InvalidParameterError, match="forced_logprobs takes one prompt, not a batch"):
        kvc.forced_logprobs(model, tok, [3, 4], prompt=["one", "two"])


def test_too_small_query_window_is_refused(tok):
    model = tiny_model()
    record = kvc.prefill(model, tok, random_text(200), query_window=8)
    with pytest.raises(ValueError, match="window=32 needs the last 32 prefill queries but got 8"):
        kvc.generate(model, tok, method=kvc.SnapKV(budget=64), prefill=record)


def test_decoding_appends_into_spare_slots_and_counts_them():
    model = tiny_model()
    full, ours = DynamicCache(config=model.config), kvc.FullKV().make_cache(model)
    steps = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = [
            model(torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(2)), **{CACHE: full}).logits[
                :, -1
            ]
        ]
        got = [
            model(torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(2)), **{CACHE: ours}).logits[
                :, -1
            ]
        ]
        layer, copies, storage = ours.layers[0], 0, None
        for t in range(steps.shape[1]):
            expected.append(model(steps[:, t : t + 1], **{CACHE: full}).logits[:, -1])
            got.append(model(steps[:, t : t + 1], **{CACHE: ours}).logits[:, -1])
            copies += layer.keys.data_ptr() != storage
            storage = layer.keys.data_ptr()
    torch.testing.assert_close(torch.stack(got), torch.stack(expected))
    assert layer.slots.used == 360 and layer.slots.valid[0, :360].all() and not layer.slots.valid[0, 360:].any()
    # the first step moves the prompt into 301 + 18 slots; it grows at 320 (+20) and 341 (+21) slots:
    # three copies in 60 steps, not 60
    assert copies == 3 and layer.keys.shape[-2] == 341 + 21
    held = sum(
        t.numel() * t.element_size()
        for lyr in ours.layers
        for t in (lyr.keys, lyr.values, lyr.slots.valid, lyr.slots.positions, lyr.slots.cursor)
        if t is not None
    )
    stats = ours.stats()
    assert stats["device_bytes"] == held  # spare slots count as memory
    # but not as kept tokens
    assert stats["kv_bytes_kept"] == stats["kv_bytes_full"] and stats["kv_kept_fraction"] == 1.0
    assert stats["spare_bytes"] == held - stats["index_bytes"] - stats["kv_bytes_full"]


def test_a_model_given_its_cache_under_either_name_compresses_alike():
    """transformers 5.24 renamed a model's ``past_key_values`` argument ``cache`` (the old name still taken): a
    kvcompress cache given under either name learns the prompt's words and keeps the same positions."""
    from kvcompress.cache.kv_cache import cache_keyword

    model, tokenizer = tiny_model(), char_tokenizer()
    ids = tokenizer(random_text(300, seed=8), return_tensors="pt").input_ids
    kept = []
    for name in ("past_key_values", cache_keyword(model)):
        cache = kvc.SnapKV(budget=48, window=8).make_cache(model, tokenizer)  # words kept whole: needs the token ids
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)  # the old name, asked
            model(ids, **{name: cache})
        kept.append([cache.kept_positions(layer) for layer in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(*kept))
