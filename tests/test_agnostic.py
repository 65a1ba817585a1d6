"""Question-agnostic scoring: KVzip (the context's own reconstruction as the observation queries) and
expected attention (future queries modelled from the prompt's), each against a loop-by-loop
reference written from its paper on a plain transformers model; and asking many questions of one
compressed context."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvcompress as kvc
from kvcompress.generation.conversation import first_turn
from kvcompress.methods.kvzip import FIRST, LATER
from kvcompress.methods.selection import global_shares
from kvcompress.storage import attention

from .fixtures import CACHE, bpe_tokenizer, char_tokenizer, family_model, random_text, tiny_model


def reconstruction_reference(model, tok, text: str, chunk: int, overlap: int) -> list[torch.Tensor]:
    """KVzip's scores per layer ``[kv_heads, prompt]``: for each chunk of the context (the text's
    tokens, without the BOS that opens the prompt), the prompt, then the repeat instruction (with the
    ``overlap`` tokens of the context before the chunk) and the chunk, run through the plain model
    with eager attention; a prompt position's score is the largest attention weight any instruction
    or chunk token pays it, over the query heads of its KV head and over the chunks."""
    prompt = tok(text)["input_ids"]
    context = tok(text, add_special_tokens=False)["input_ids"]
    n = len(prompt)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    best = None
    for start in range(0, len(context), chunk):
        instruction = FIRST if start == 0 else LATER
        lead = tok("\n" + instruction, add_special_tokens=False)["input_ids"] + context[max(0, start - overlap) : start]
        ids = torch.tensor([prompt + lead + context[start : start + chunk]])
        with torch.no_grad():
            attentions = model(ids, output_attentions=True).attentions
        scores = []
        for weights in attentions:  # [1, q_heads, total, total]
            per_head = weights[0, :, n:, :n].amax(dim=1)  # [q_heads, prompt]: over the reconstruction's queries
            scores.append(
                torch.stack(
                    [per_head[h * group : (h + 1) * group].amax(dim=0) for h in range(per_head.shape[0] // group)]
                )
            )
        best = scores if best is None else [torch.maximum(a, b) for a, b in zip(best, scores)]
    return best


def top_positions(scores: torch.Tensor, budget: int) -> list[list[int]]:
    return [sorted(head.topk(budget).indices.tolist()) for head in scores]


@pytest.mark.parametrize("chunk", [1000, 70])
def test_kvzip_keeps_what_the_reconstruction_attends_most(chunk):
    model = tiny_model(num_hidden_layers=3, attn_implementation="eager")
    tok = char_tokenizer()
    text = random_text(200, seed=5)
    method = kvc.KVzip(budget=48, chunk=chunk, overlap=6, clustering="none", layers="uniform")  # each head's own top 48
    cache = kvc.compress(model, tok, text, method=method).cache
    for layer, scores in enumerate(reconstruction_reference(model, tok, text, chunk, 6)):
        assert cache.kept_positions(layer)[0].tolist() == top_positions(scores, 48), f"layer {layer}"


def rotation(position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE at ``position`` as a ``d x d`` matrix (rotate-half layout: dimension i turns with i + d/2)."""
    half = inv_freq.shape[0]
    matrix = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for i in range(half):
        angle = position * float(inv_freq[i])
        matrix[i, i] = matrix[i + half, i + half] = math.cos(angle)
        matrix[i, i + half], matrix[i + half, i] = -math.sin(angle), math.sin(angle)
    return matrix


def expected_reference(model, ids: torch.Tensor, future: int, sinks: int) -> list[torch.Tensor]:
    """Expected attention per layer ``[kv_heads, prompt]`` (+inf on the sinks): per query head, the
    mean and covariance of the prompt's queries before RoPE (sinks left out), moved by the average of
    the next ``future`` positions' rotation matrices; each key's ``exp(s mu.k + s^2 k'Sk / 2)``
    normalised over the non-sink keys, averaged over the KV head's query heads, times the value norm."""
    pre_rope = {}

    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        pre_rope[module.layer_idx] = (
            module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)[0].transpose(0, 1).double()
        )

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{CACHE: full})
    for handle in handles:
        handle.remove()
    n = ids.shape[1]
    inv_freq = model.model.rotary_emb.inv_freq
    ahead = sum(rotation(n + i, inv_freq) for i in range(future)) / future
    scaling = model.config.head_dim**-0.5
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    result = []
    for layer, queries in sorted(pre_rope.items()):
        keys, values = full.layers[layer].keys[0].double(), full.layers[layer].values[0].double()
        scores = torch.full((keys.shape[0], n), math.inf, dtype=torch.float64)
        for kv_head in range(keys.shape[0]):
            weights = torch.zeros(n - sinks, dtype=torch.float64)
            for head in range(kv_head * group, (kv_head + 1) * group):
                counted = queries[head, sinks:]
                mean = counted.mean(dim=0)
                cov = sum(torch.outer(q - mean, q - mean) for q in counted) / counted.shape[0]
                mean, cov = ahead @ mean, ahead @ cov @ ahead.T
                exponent = torch.tensor(
                    [scaling * mean @ k + scaling**2 / 2 * k @ cov @ k for k in keys[kv_head, sinks:]]
                )
                weights += exponent.softmax(dim=0) / group
            scores[kv_head, sinks:] = weights * values[kv_head, sinks:].norm(dim=-1)
        result.append(scores)
    return result


def test_expected_attention_keeps_what_modelled_future_queries_attend_most():
    model, tok = tiny_model(num_hidden_layers=3), char_tokenizer()
    text = random_text(180, seed=6)
    method = kvc.ExpectedAttention(budget=40, future=32, sinks=4, clustering="none")
    cache = kvc.compress(model, tok, text, method=method).cache
    ids = torch.tensor([tok(text)["input_ids"]])
    for layer, scores in enumerate(expected_reference(model, ids, 32, 4)):
        assert cache.kept_positions(layer)[0].tolist() == top_positions(scores, 40), f"layer {layer}"


@pytest.mark.parametrize(
    "method", [kvc.KVzip(budget=64, chunk=90), kvc.ExpectedAttention(budget=64)], ids=lambda m: m.name
)
def test_one_context_asked_many_questions_each_on_its_own_copy(method):
    model, tok = tiny_model(), char_tokenizer()
    document = [{"role": "user", "content": random_text(400, seed=7)}]
    context = kvc.compress(model, tok, document, method=method)
    kept = [layer.keys.clone() for layer in context.cache.layers]
    answers = [
        kvc.generate(model, tok, question, past=context.copy(), max_new_tokens=6)
        for question in ("first?", "second one?")
    ]
    assert [layer.keys for layer in context.cache.layers] != [] and all(
        torch.equal(a.keys, b) for a, b in zip(context.cache.layers, kept)
    )
    for question, answer in zip(("first?", "second one?"), answers):
        asked = kvc.generate(model, tok, document, question=question, method=method, max_new_tokens=6)
        # each copy answers as if the context had been compressed for it alone
        assert answer.token_ids == asked.token_ids


def test_the_observation_pass_is_timed_and_needs_a_tokenizer():
    model, tok = tiny_model(), char_tokenizer()
    result = kvc.compress(model, tok, random_text(300, seed=8), method=kvc.KVzip(budget=32))
    assert 0 < result.stats["compress_s"] <= result.stats["prefill_s"]
    cache = kvc.KVzip(budget=32, clustering="none").make_cache(model)
    with (
        pytest.raises(ValueError, match="KVzip scores from the prompt's reconstruction, which did not run"),
        torch.no_grad(),
    ):
        model(torch.tensor([tok(random_text(300, seed=8))["input_ids"]]), **{CACHE: cache})
        cache.end_observation(0.0)


def test_global_shares_rank_every_layer_together():
    """Against a sort of every (score, layer, head, position) of a row, ties to the lower layer, head, position."""
    generator = torch.Generator().manual_seed(4)
    scores = [torch.randint(0, 6, (2, 3, 10), generator=generator).float() for _ in range(4)]  # many ties
    scores[1][0, 2, 3] = math.inf  # pinned: stays out of the ranking
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :4] = False  # a padded row
    free = torch.tensor([2, 3])
    shares = global_shares(scores, valid, free)
    for row in range(2):
        entries = sorted(
            (-float(scores[layer][row, head, pos]), layer, head, pos)
            for layer in range(4)
            for head in range(3)
            for pos in range(10)
            if valid[row, pos] and scores[layer][row, head, pos] != math.inf
        )
        winners = [layer for _, layer, _, _ in entries[: 4 * 3 * int(free[row])]]
        assert [float(share[row]) for share in shares] == [
            winners.count(layer) * 4 / len(winners) for layer in range(4)
        ]


@pytest.mark.parametrize(
    "method",
    [
        kvc.KVzip(budget=40, layers="global", head_floor=0.0),  # after its observation pass
        kvc.SnapKV(budget=40, window=8, layers="global", head_floor=0.0),  # from the prefill, at the end of its call
        kvc.ExpectedAttention(budget=40, layers="global", head_floor=0.0),
    ],
    ids=lambda m: m.name,
)
def test_a_global_budget_keeps_the_uniform_total_spread_over_the_layers(method):
    model, tok = tiny_model(num_hidden_layers=4), char_tokenizer()
    text = random_text(300, seed=9)
    cache = kvc.compress(model, tok, text, method=method).cache
    kept = [int((cache.kept_positions(layer)[0] >= 0).sum()) for layer in range(4)]
    assert len(set(kept)) > 1  # layers keep different numbers of tokens
    assert 4 * 2 * 40 <= sum(kept) <= 4 * 2 * 40 + 4 * 2  # the uniform total, up to rounding each layer's share up


def test_a_prefill_scored_method_ranks_every_layer_of_the_prompt_together():
    """SnapKV with layers='global': each layer's share of the budget is where the highest of all layers' SnapKV scores
    fall (global_shares over each layer's scores of the whole prompt, from a full prefill's record), for a prompt, a
    question over a stored context and a prefill record alike; and its answer decodes as the record's does."""
    model, tok = tiny_model(num_hidden_layers=4), char_tokenizer()
    text, method = random_text(300, seed=9), kvc.SnapKV(budget=40, window=8, layers="global", head_floor=0.0)
    record = kvc.prefill(model, tok, text, query_window=8)
    layers = record.cache.layers
    scores = [method.layer_scores(layer, layer.queries, layer.query_scaling) for layer in layers]
    free = method.kept_tokens(layers[0].prompt_tokens) - method.reserved_tokens()
    expected = [float(share[0]) for share in global_shares(scores, layers[0].slot_validity(), free)]
    fresh = kvc.generate(model, tok, text, method=method, max_new_tokens=6)
    recorded = kvc.generate(model, tok, prefill=record, method=method, max_new_tokens=6)
    for result in (fresh, recorded):
        assert [float(layer.policy.share[0]) for layer in result.cache.layers] == pytest.approx(expected)
    assert fresh.token_ids == recorded.token_ids
    # layer_floor: every layer keeps that weight of the uniform share, the rest ranked as before; the total unchanged
    floored = kvc.generate(
        model,
        tok,
        text,
        method=kvc.SnapKV(budget=40, window=8, layers="global", head_floor=0.0, layer_floor=0.5),
        max_new_tokens=6,
    )
    shares = [float(layer.policy.share[0]) for layer in floored.cache.layers]
    assert shares == pytest.approx([0.5 + 0.5 * share for share in expected]) and sum(shares) == pytest.approx(4)
    with pytest.raises(
        kvc.InvalidParameterError,
        match=r"^SnapKV: layer_floor=0\.5 applies only with "
        r"layers='global'; give that, or leave layer_floor out$",
    ):
        kvc.SnapKV(layer_floor=0.5)
    store = kvc.compress(model, tok, text, method=kvc.FullKV())
    asked = kvc.generate(model, tok, "What is it?", past=store, method=method, max_new_tokens=6)
    assert all(layer.phase.name == "DECODING" for layer in asked.cache.layers)
    assert len(set(float(layer.policy.share[0]) for layer in asked.cache.layers)) > 1


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_global_budget_goes_to_the_global_layers_of_a_model_with_sliding_windows(family):
    """Gemma 2/3 (local and global layers) under KVzip's default, layers='global': each sliding-window layer keeps
    its window, the budget is ranked over the global layers alone (it crashed: a window layer has no scores)."""
    model, tok = family_model(family), char_tokenizer()
    context = kvc.compress(model, tok, random_text(300, seed=9), method=kvc.KVzip(budget=40, head_floor=0.0))
    sliding = [layer.is_sliding for layer in context.cache.layers]
    assert True in sliding and False in sliding
    held = context.stats["kv_tokens_per_layer"]
    assert [n for n, local in zip(held, sliding) if local] == [model.config.sliding_window - 1] * sliding.count(True)
    kept = [int((context.cache.kept_positions(i)[0] >= 0).sum()) for i, local in enumerate(sliding) if not local]
    assert 2 * 40 * len(kept) <= sum(kept) <= 2 * 40 * len(kept) + 2 * len(kept)  # the uniform total of the global ones
    assert isinstance(kvc.generate(model, tok, "What?", past=context, max_new_tokens=3).text, str)
    # SnapKV's global budgets over a stored context: the windows continue as later steps, the global layers rank
    store = kvc.compress(model, tok, random_text(300, seed=9), method=kvc.FullKV())
    asked = kvc.generate(
        model, tok, "What?", past=store, method=kvc.SnapKV(budget=40, window=8, layers="global"), max_new_tokens=3
    )
    held = asked.stats["kv_tokens_per_layer"]
    assert [n for n, local in zip(held, sliding) if local] == [model.config.sliding_window - 1] * sliding.count(True)


def test_a_model_called_directly_cannot_skip_the_observation_pass():
    model, tok = tiny_model(), char_tokenizer()
    cache = kvc.KVzip(budget=32).make_cache(model, tok)
    ids = torch.tensor([tok(random_text(200, seed=10))["input_ids"]])
    with torch.no_grad():
        model(ids, **{CACHE: cache})
        with pytest.raises(
            kvc.CacheMisuseError,
            match="compresses the prompt after an observation pass .* kvcompress.generate and kvcompress.compress "
            "run it",
        ):
            model(ids[:, -1:], **{CACHE: cache})


QUESTIONS = ("What is the first word?", "1 or 2?", " spaced out", "\nnew line", "é?")


@pytest.mark.parametrize("make_tokenizer", [char_tokenizer, bpe_tokenizer], ids=["char", "bpe"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "raw"])
def test_a_context_and_its_question_are_the_joined_prompts_tokens(make_tokenizer, chat):
    """The context is tokenized as every joined prompt starts (a BPE's "\\n\\n" at the end of a text is
    one token, before a word two), and the question as what follows it there."""
    tok = make_tokenizer()
    document = random_text(200, seed=4) + "."
    context = [{"role": "user", "content": document}] if chat else document
    alone = first_turn(tok, context, None)[1][0]
    for question in QUESTIONS:
        joined = [{"role": "user", "content": document + "\n\n" + question}] if chat else document + "\n" + question
        chunks = first_turn(tok, context, question)[1]
        assert chunks[0] + chunks[1] == first_turn(tok, joined, None)[1][0]
        assert chunks[0] == alone[: len(chunks[0])]  # the document's own tokens, no separator
    model = tiny_model()
    joined = [{"role": "user", "content": document + "\n\n" + QUESTIONS[0]}] if chat else document + "\n" + QUESTIONS[0]
    agnostic = kvc.generate(model, tok, context, question=QUESTIONS[0], method=kvc.FullKV(), max_new_tokens=8)
    assert agnostic.token_ids == kvc.generate(model, tok, joined, method=kvc.FullKV(), max_new_tokens=8).token_ids


@pytest.mark.parametrize("path", ["flash", "split", "spelled out"])
def test_an_observation_pass_attends_exactly_and_gives_each_querys_normaliser(path):
    """The observation pass's attention (the queries just after a prompt) and each query's log-normaliser
    against the softmax written out per query head; the first row's prompt opens with 3 padding slots."""
    generator = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(2, heads, n, 8, generator=generator) for heads, n in ((6, 5), (2, 12), (2, 12)))
    mask = attention.causal_slot_mask(5, 12, query.device).expand(2, 1, 5, 12).clone()
    if path != "split":
        mask[0, :, :, :3] = False
    logits = torch.stack([query[:, h] @ keys[:, h // 3].transpose(-1, -2) for h in range(6)], dim=1) * 0.3
    logits = logits.masked_fill(~mask, -torch.inf)
    expected_lse = logits.logsumexp(dim=-1)
    expected = torch.stack([logits[:, h].softmax(dim=-1) @ values[:, h // 3] for h in range(6)], dim=1)
    if path == "flash":
        out, lse = attention.attention_with_lse(query, keys, values, mask, 0.3)
    elif path == "split":
        out, lse = attention.after_prompt_with_lse(query, keys, values, 0.3)
    else:
        out, lse = attention.spelled_out_with_lse(query, keys, values, mask, 0.3)
    torch.testing.assert_close(lse, expected_lse)
    torch.testing.assert_close(out, expected)


def test_kvzip_scores_leave_the_opening_out_of_each_softmax():
    """KVzip's scores from a step's queries and normalisers, against the weights written out: each
    query's softmax over the prompt and the step's tokens up to itself, renormalised without the
    positions not counted (a chat template's opening after its first tokens), maxed over the queries
    and a KV head's query heads; not counted, padding and padding queries score nothing. Row 0 opens
    with 2 padding slots."""
    from kvcompress.methods.kvzip import reconstruction_scores

    generator = torch.Generator().manual_seed(1)
    prompt, new = 10, 4
    query = torch.randn(2, 4, new, 8, generator=generator)
    keys = torch.randn(2, 2, prompt + new, 8, generator=generator)
    valid = torch.ones(2, prompt + new, dtype=torch.bool)
    valid[0, :2] = False
    valid[1, -1] = False  # a padding query
    counted = valid[:, :prompt].clone()
    counted[0, 3:6] = False
    counted[1, 1:4] = False
    # [b, h, new, prompt + new]
    logits = torch.stack([query[:, h] @ keys[:, h // 2].transpose(-1, -2) for h in range(4)], dim=1) * 0.3
    seen = valid[:, None, None, :] & torch.cat(
        [torch.ones(new, prompt, dtype=torch.bool), torch.ones(new, new, dtype=torch.bool).tril()], dim=-1
    )
    lse = logits.masked_fill(~seen, -torch.inf).logsumexp(dim=-1)
    expected = torch.zeros(2, 2, prompt)
    for row in range(2):
        for head in range(4):
            for q in range(new):
                if not valid[row, prompt + q]:
                    continue
                kept = seen[row, 0, q].clone()
                kept[:prompt] &= counted[row]
                weights = logits[row, head, q].masked_fill(~kept, -torch.inf).softmax(dim=-1)[:prompt]
                expected[row, head // 2] = torch.maximum(expected[row, head // 2], weights)
    torch.testing.assert_close(reconstruction_scores(query, keys, valid, prompt, 0.3, lse, counted), expected)
