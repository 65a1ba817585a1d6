"""SnapKV against an independent, loop-by-loop reference written from the paper's Listing 1."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvcompress as kvc
from kvcompress.methods.selection import select_kept

from .fixtures import CACHE, char_tokenizer, prefilled_cache, random_text, tiny_model


def reference_keep(
    query: torch.Tensor, keys: torch.Tensor, budget: int, window: int, kernel: int, pooling: str, vote: str = "sum"
) -> list[list[int]]:
    """Kept positions per KV head for one prompt. query [q_heads, L, D] post-RoPE, keys [kv_heads, L, D].

    Listing 1: the window's attention (softmax over all keys, causal inside the window) is summed
    over the window queries on the prefix, pooled (zero/ignored padding), averaged over each KV
    head's query heads, and the top ``budget - window`` prefix positions are kept with the window.
    ``vote="max"``: a position's largest attention from any window query instead of their sum.
    Ties go to the earlier position."""
    q_heads, length, dim = query.shape
    kv_heads = keys.shape[0]
    group = q_heads // kv_heads
    if length <= budget:
        return [list(range(length)) for _ in range(kv_heads)]
    prefix = length - window
    pooled_per_head = []
    for h in range(q_heads):
        votes = [0.0] * prefix  # attention weights are >= 0: 0 starts a maximum as well as a sum
        k = keys[h // group].float()
        for i in range(window):
            pos = prefix + i
            logits = (query[h, pos].float() @ k[: pos + 1].T) / math.sqrt(dim)
            weights = torch.softmax(logits, dim=-1)
            for j in range(prefix):
                votes[j] = votes[j] + float(weights[j]) if vote == "sum" else max(votes[j], float(weights[j]))
        half = kernel // 2
        pooled = []
        for j in range(prefix):
            neighbourhood = votes[max(0, j - half) : j + half + 1]
            pooled.append(max(neighbourhood) if pooling == "max" else sum(neighbourhood) / kernel)
        pooled_per_head.append(pooled)
    kept = []
    for g in range(kv_heads):
        members = pooled_per_head[g * group : (g + 1) * group]
        score = [sum(m[j] for m in members) / group for j in range(prefix)]
        top = sorted(range(prefix), key=lambda j: (-score[j], j))[: budget - window]
        kept.append(sorted(top) + list(range(prefix, length)))
    return kept


def reference_spans(texts: list[str]) -> list[int]:
    """Span number of each token, written from the definition: a token starts a new span when it
    begins with a space or a word marker, is special, or is punctuation other than closing marks
    written against the token before it; tokens are given as their strings."""
    spans, current = [], -1
    for i, text in enumerate(texts):
        core = text.lstrip("Ġ▁ ")
        closing = core != "" and all(c in ".,;:!?)]}%'\"" for c in core)
        starts = i == 0 or text[:1] in ("Ġ", "▁", " ") or (not core[:1].isalnum() and not closing)
        current += starts
        spans.append(current)
    return spans


def test_span_boundaries_keep_words_and_numbers_whole():
    tokenizer = char_tokenizer()
    text = "the key is 4817. pi=3.14, 2,500 cats (one) ends?"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    from kvcompress.cache.tokens import spans_for

    got = spans_for(tokenizer).span_ids(ids)[0].tolist()
    assert got == reference_spans(tokenizer.convert_ids_to_tokens(ids[0].tolist()))
    words = {}
    for token, span in zip(text, got):
        words.setdefault(span, "")
        words[span] += token
    assert list(words.values()) == [
        "the",
        " key",
        " is",
        " 4817.",
        " pi",
        "=3.14,",
        " 2,500",
        " cats",
        " ",
        "(one)",
        " ends?",
    ]


def test_span_clustering_matches_a_reference():
    """clustering="spans": the paper's pooled votes, then every token of a span gets its span's
    highest pooled score (the reference computes both loop by loop)."""
    torch.manual_seed(2)
    query, keys = torch.randn(6, 90, 8), torch.randn(2, 90, 8)
    # spans of 1 to 4 tokens
    spans = torch.tensor([[i // 4 + (i > 40) * (i % 3 == 0) for i in range(90)]]).cummax(-1).values
    valid = torch.ones(1, 90, dtype=torch.bool)
    paper = kvc.SnapKV(budget=40, window=12, kernel=5, clustering="pool").scores(
        query[None], keys[None], valid, 8**-0.5
    )
    clustered = kvc.SnapKV(budget=40, window=12, kernel=5).scores(query[None], keys[None], valid, 8**-0.5, spans)
    for head in range(2):
        for position in range(78):
            members = [j for j in range(90) if spans[0, j] == spans[0, position]]
            assert clustered[0, head, position] == max(paper[0, head, j] for j in members)
    indices, _ = select_kept(clustered, valid, torch.tensor([40]))
    kept = set(indices[0, 0].tolist())
    cut = [
        s
        for s in set(spans[0, :78].tolist())
        if 0 < len({j for j in range(78) if spans[0, j] == s} & kept) < len([j for j in range(78) if spans[0, j] == s])
    ]
    assert len(cut) <= 1  # at most the span at the budget's edge is cut


def test_reference_confirms_pure_functions_on_random_tensors():
    torch.manual_seed(1)
    query, keys = torch.randn(6, 90, 8), torch.randn(2, 90, 8)
    for pooling, kernel, vote in (
        ("max", 7, "sum"),
        ("avg", 5, "sum"),
        ("max", 1, "sum"),
        ("max", 7, "max"),
        ("avg", 5, "max"),
    ):
        method = kvc.SnapKV(budget=40, window=12, kernel=kernel, pooling=pooling, clustering="pool", votes=vote)
        valid = torch.ones(1, 90, dtype=torch.bool)
        scores = method.scores(query[None], keys[None], valid, 8**-0.5)
        indices, slot_valid = select_kept(scores, valid, method.kept_tokens(torch.tensor([90])))
        assert slot_valid.all()
        assert indices[0].tolist() == reference_keep(query, keys, 40, 12, kernel, pooling, vote)
    sums, maxima = (reference_keep(query, keys, 40, 12, 7, "max", vote) for vote in ("sum", "max"))
    assert sums != maxima  # the two votes choose differently here


def test_voters_make_each_rows_window_its_own():
    """``voters`` (a question over a stored context, ``question_window``): each row keeps what the reference keeps
    with its window set to its voters, the rest of the last ``window`` tokens scored as prefix."""
    torch.manual_seed(2)
    query, keys = torch.randn(3, 6, 90, 8), torch.randn(3, 2, 90, 8)
    voters = torch.tensor([5, 12, 1])
    valid = torch.ones(3, 90, dtype=torch.bool)
    for pooling, kernel, vote in (("max", 7, "max"), ("avg", 5, "sum"), ("max", 1, "sum")):
        method = kvc.SnapKV(budget=40, window=12, kernel=kernel, pooling=pooling, clustering="pool", votes=vote)
        scores = method.scores(query, keys, valid, 8**-0.5, voters=voters)
        indices, slot_valid = select_kept(scores, valid, method.kept_tokens(torch.tensor([90] * 3)))
        assert slot_valid.all()
        for row, count in enumerate(voters.tolist()):
            assert indices[row].tolist() == reference_keep(query[row], keys[row], 40, count, kernel, pooling, vote)
        # only the voters' own queries computed (a served question's): the same scores, exactly
        own = method.scores(query[..., -int(voters.max()) :, :], keys, valid, 8**-0.5, voters=voters)
        torch.testing.assert_close(own, scores, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"SnapKV: window=12 needs the last 12 prefill queries but got 11"):
        method.scores(query[..., -11:, :], keys, valid, 8**-0.5)  # (no voters: the whole window votes)


def capture_queries(model: torch.nn.Module) -> tuple[dict[int, torch.Tensor], list]:
    """Post-RoPE queries of every attention module, recomputed from its inputs (independent of kvcompress)."""
    queries: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        queries[module.layer_idx] = apply_rotary_pos_emb(q, q, cos, sin)[0].detach()

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    return queries, handles


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("pooling,vote", [("max", "sum"), ("avg", "sum"), ("max", "max")])
def test_selection_matches_reference_in_every_layer(arch, pooling, vote):
    model = tiny_model(arch, num_hidden_layers=3)
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(3))
    queries, handles = capture_queries(model)
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{CACHE: full})
    for h in handles:
        h.remove()
    method = kvc.SnapKV(budget=48, window=16, kernel=5, pooling=pooling, clustering="pool", votes=vote)
    cache = method.make_cache(model)
    with torch.no_grad():
        model(ids, **{CACHE: cache})
    for layer in range(3):
        expected = reference_keep(queries[layer][0], full.layers[layer].keys[0], 48, 16, 5, pooling, vote)
        assert cache.kept_positions(layer)[0].tolist() == expected, f"layer {layer}"


def test_prefill_attention_uses_the_full_cache():
    """Compression happens after each layer's attention: prefill logits equal FullKV's."""
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, **{CACHE: kvc.FullKV().make_cache(model)}).logits
        snap = model(ids, **{CACHE: kvc.SnapKV(budget=40, window=8).make_cache(model, char_tokenizer())}).logits
    torch.testing.assert_close(snap, full, rtol=0, atol=0)


def test_at_most_one_layer_holds_a_full_prompt():
    model = tiny_model(num_hidden_layers=4)
    cache = kvc.SnapKV(budget=40, window=8).make_cache(model, char_tokenizer())
    seen = []

    def after_layer(module, args, output):
        sizes = [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in cache.layers]
        seen.append(sizes)

    handles = [layer.register_forward_hook(after_layer) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 200)), **{CACHE: cache})
    for h in handles:
        h.remove()
    assert seen == [[40, 0, 0, 0], [40, 40, 0, 0], [40, 40, 40, 0], [40, 40, 40, 40]]


def test_budget_at_least_prompt_is_identical_to_full():
    model, tok = tiny_model(), char_tokenizer()
    prompt = random_text(100, seed=4)
    full = kvc.generate(model, tok, prompt, method=kvc.FullKV(), max_new_tokens=20)
    for budget in (101, 500):  # the prompt is 101 tokens with BOS
        snap = kvc.generate(model, tok, prompt, method=kvc.SnapKV(budget=budget, window=8), max_new_tokens=20)
        assert snap.token_ids == full.token_ids
        for a, b in zip(snap.cache.layers, full.cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_compressed_tensors_hold_exactly_kv_heads_times_budget():
    model = tiny_model()
    cache = kvc.SnapKV(budget=64, window=16).make_cache(model, char_tokenizer())
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 300)), **{CACHE: cache})
    stats = cache.stats()
    for layer in cache.layers:
        assert layer.keys.shape == (1, 2, 64, 16) and layer.values.shape == (1, 2, 64, 16)
        assert layer.slots.valid is None
    kv_bytes = sum(layer.keys.numel() * 4 * 2 for layer in cache.layers)
    positions_bytes = sum(layer.slots.positions.numel() * 8 for layer in cache.layers)
    assert stats["kv_bytes_kept"] == kv_bytes  # the kept tokens' keys and values
    assert stats["device_bytes"] == kv_bytes + positions_bytes  # everything the cache holds
    assert stats["kv_bytes_full"] == 2 * 2 * 2 * 300 * 16 * 4
    assert stats["kv_tokens_per_layer"] == [64, 64]


def test_kept_positions_are_ascending_and_include_the_window():
    kept = prefilled_cache(kvc.SnapKV(budget=50, window=10), 200).kept_positions(1)
    assert kept.shape == (1, 2, 50) and kept.dtype == torch.long
    assert (kept.diff(dim=-1) > 0).all()
    assert (kept[..., -10:] == torch.arange(190, 200)).all()


def test_ratio_keeps_that_fraction_of_the_prompt():
    assert prefilled_cache(kvc.SnapKV(ratio=0.25, window=8), 201).kept_positions(0).shape[-1] == math.ceil(0.25 * 201)


def test_question_agnostic_mode_compresses_the_context_alone():
    model, tok = tiny_model(), char_tokenizer()
    context, question = random_text(200, seed=1), "what word comes first?"
    method = kvc.SnapKV(budget=64, window=8)
    agnostic = kvc.generate(model, tok, context, method=method, question=question, max_new_tokens=5)
    context_only = kvc.generate(model, tok, context, method=method, max_new_tokens=1)
    assert torch.equal(agnostic.cache.kept_positions(0), context_only.cache.kept_positions(0))
    appended = len(tok("\n" + question, add_special_tokens=False)["input_ids"])
    assert agnostic.cache.layers[0].slots.used == 64 + appended + len(agnostic.token_ids[0]) - 1
    aware = kvc.generate(model, tok, context + "\n" + question, method=method, max_new_tokens=1)
    assert not torch.equal(aware.cache.kept_positions(0), agnostic.cache.kept_positions(0))


def test_the_kept_positions_are_each_heads_highest_with_ties_to_the_earlier_whatever_the_path():
    """``select_kept`` against a loop: each row and head keeps its ``count`` highest real positions, of equal scores
    the earliest, ascending; rows keeping fewer than the batch's widest fill the front with slots marked invalid.
    Scores drawn from a few values (ties across the boundary in most heads, none in some: the partial sort's short
    path and the general one), padding at the rows' front, counts equal and unequal."""
    torch.manual_seed(7)
    for levels, counts in ((4, [9, 9]), (1000, [9, 9]), (3, [12, 5]), (1000, [3, 11]), (2, [40, 40])):
        scores = torch.randint(levels, (2, 3, 40)).float()
        valid = torch.ones(2, 40, dtype=torch.bool)
        valid[1, :6] = False
        indices, slot_valid = select_kept(scores, valid, torch.tensor(counts))
        assert indices.shape[-1] == max(counts)
        for row, count in enumerate(counts):
            assert slot_valid[row].tolist() == [False] * (max(counts) - count) + [True] * count
            for head in range(3):  # (a padding position scores -inf: kept only where too few are real)
                score = [float(scores[row, head, p]) if valid[row, p] else -math.inf for p in range(40)]
                best = sorted(sorted(range(40), key=lambda p: (-score[p], p))[:count])
                assert indices[row, head, max(counts) - count :].tolist() == best
