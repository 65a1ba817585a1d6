"""Head-adaptive (Ada-KV) and layer-adaptive (PyramidKV) budgets, stored so the memory is really freed."""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress as kvc
from kvcompress.methods.selection import allocate_heads, pyramid_budgets

from .fixtures import CACHE, char_tokenizer, family_model, random_text, tiny_model


def reference_allocation(scores: list[list[float]], count: int, floor: float) -> list[set[int]]:
    """Ada-KV for one row, written out. Positions scored inf are kept by every head, outside the
    sharing; of the other ``free = count - pinned`` per head, the heads * free best (score, then
    lower head, then earlier position) of all heads give each head a count c; head h keeps
    floor * free + (1 - floor) * c, rounded down, the leftover tokens going one each to the largest
    fractions (then the lower head); each head keeps its own best (then the earlier position)."""
    heads = len(scores)
    pinned = [{j for j, x in enumerate(s) if x == math.inf} for s in scores]
    free = count - len(pinned[0])
    ranked = sorted((-s[j], h, j) for h, s in enumerate(scores) for j in range(len(s)) if j not in pinned[h])
    won = [sum(1 for _, h, _ in ranked[: heads * free] if h == head) for head in range(heads)]
    shares = [floor * free + (1 - floor) * c for c in won]
    room = [math.floor(x) for x in shares]
    for head in sorted(range(heads), key=lambda h: (-(shares[h] - room[h]), h))[: heads * free - sum(room)]:
        room[head] += 1
    kept = []
    for head, s in enumerate(scores):
        own = sorted((j for j in range(len(s)) if j not in pinned[head]), key=lambda j: (-s[j], j))
        kept.append(pinned[head] | set(own[: room[head]]))
    return kept


@pytest.mark.parametrize("floor", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("window", [0, 4])
def test_allocation_matches_a_reference(floor, window):
    torch.manual_seed(0)
    scores = torch.rand(2, 3, 40) ** torch.tensor([1.0, 4.0, 0.3])[None, :, None]  # heads of very different sharpness
    scores[..., 40 - window :] = math.inf  # a window every head keeps, as SnapKV scores it
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :15] = False  # a shorter row (padding first)
    counts = torch.tensor([10, 6])
    keep = allocate_heads(scores, valid, counts, floor)
    for row in range(2):
        real = [j for j in range(40) if valid[row, j]]
        expected = reference_allocation(
            [[float(scores[row, h, j]) for j in real] for h in range(3)], int(counts[row]), floor
        )
        got = [{real.index(j) for j in keep[row, h].nonzero()[:, 0].tolist()} for h in range(3)]
        assert got == expected
        assert int(keep[row].sum()) == 3 * int(counts[row])  # the same total as the uniform budget
        assert all(len(g) >= window + int(floor * (counts[row] - window)) for g in got)
        assert all(set(range(len(real) - window, len(real))) <= g for g in got)  # the window is every head's


def test_pyramid_schedule():
    budgets = pyramid_budgets(1000, 30, 20)
    assert sum(budgets) == 30 * 1000  # the uniform budget's total
    assert budgets[0] == pytest.approx(2 * 1000 - 50, abs=1) and budgets[-1] == pytest.approx(50, abs=1)
    steps = [a - b for a, b in zip(budgets, budgets[1:])]
    assert max(steps) - min(steps) <= 2  # linear, up to rounding


def teacher_forced(model, method, prompt, continuation, follow_up):
    """Logits of the prompt's last token, of each continuation token fed alone, then of every
    token of a follow-up turn fed in one forward (longer than a segment's spare room)."""
    cache = method.make_cache(model, char_tokenizer())
    with torch.no_grad():
        logits = [model(prompt, **{CACHE: cache}).logits[:, -1]]
        logits += [
            model(continuation[:, t : t + 1], **{CACHE: cache}).logits[:, -1] for t in range(continuation.shape[1])
        ]
        logits += model(follow_up, **{CACHE: cache}).logits.unbind(1)
    return torch.stack(logits, 1), cache


@pytest.mark.parametrize(
    "method", [kvc.SnapKV(budget=64, window=8), kvc.H2O(budget=64), kvc.StreamingLLM(budget=48)], ids=lambda m: m.name
)
def test_equal_head_counts_in_the_packed_layout_give_the_uniform_cache(method):
    """head_floor=1: every head keeps exactly the uniform budget, now stored packed per head."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    prompt, continuation, follow_up = (torch.randint(3, 128, (1, n), generator=gen) for n in (300, 20, 40))
    uniform, uniform_cache = teacher_forced(model, method, prompt, continuation, follow_up)
    settings = {k: v for k, v in vars(method).items()}
    packed, packed_cache = teacher_forced(
        model, type(method)(**{**settings, "heads": "adaptive", "head_floor": 1.0}), prompt, continuation, follow_up
    )
    torch.testing.assert_close(packed, uniform, rtol=1e-5, atol=1e-5)
    for layer in range(2):
        assert packed_cache.layers[layer].policy.packed is not None
        assert torch.equal(packed_cache.kept_positions(layer), uniform_cache.kept_positions(layer))
    assert packed_cache.stats()["kv_bytes_kept"] == uniform_cache.stats()["kv_bytes_kept"]


def test_packed_layout_with_soft_capped_logits():
    """Gemma 2 (logit soft-capping, sliding-window layers beside global ones): head_floor=1 packed == uniform."""
    model = family_model("gemma2")
    gen = torch.Generator().manual_seed(4)
    prompt, continuation, follow_up = (torch.randint(3, 128, (1, n), generator=gen) for n in (120, 8, 12))
    method = kvc.SnapKV(budget=24, window=4)
    uniform, _ = teacher_forced(model, method, prompt, continuation, follow_up)
    packed, cache = teacher_forced(
        model, kvc.SnapKV(budget=24, window=4, heads="adaptive", head_floor=1.0), prompt, continuation, follow_up
    )
    assert any(getattr(layer.policy, "packed", None) is not None for layer in cache.layers)
    torch.testing.assert_close(packed, uniform, rtol=1e-5, atol=1e-5)


def test_adaptive_heads_hold_different_counts_in_the_same_memory():
    model, tok = tiny_model(), char_tokenizer()
    prompt = random_text(400, seed=5)
    uniform = kvc.generate(model, tok, prompt, method=kvc.SnapKV(budget=64, window=8), max_new_tokens=6)
    adaptive = kvc.generate(
        model, tok, prompt, method=kvc.SnapKV(budget=64, window=8, heads="adaptive"), max_new_tokens=6
    )
    packed = adaptive.cache.layers[0].policy.packed
    lengths = packed.lengths[0]
    assert len(set(lengths)) > 1 and sum(lengths) == sum(uniform.cache.layers[0].slots.used for _ in lengths)
    held = sum(t.numel() * t.element_size() for t in (packed.keys, packed.values))  # measured from the tensors
    assert adaptive.cache.stats()["kv_bytes_kept"] + adaptive.cache.stats()["spare_bytes"] == sum(
        lyr.policy.packed.keys.numel() * lyr.policy.packed.keys.element_size() * 2 for lyr in adaptive.cache.layers
    )
    # same spare room
    assert held <= 1.02 * sum(
        t.numel() * t.element_size() for t in (uniform.cache.layers[0].keys, uniform.cache.layers[0].values)
    )
    assert abs(adaptive.cache.stats()["device_bytes"] / uniform.cache.stats()["device_bytes"] - 1) <= 0.02
    for layer in adaptive.cache.layers:  # the full prompt's keys and values are freed, not held by an empty view
        assert all(t.untyped_storage().nbytes() == 0 for t in (layer.keys, layer.values))
    for head, positions in enumerate(adaptive.cache.kept_positions(0)[0]):
        real = positions[positions >= 0]
        assert len(real) == lengths[head] - 5 and (real.diff() > 0).all()  # 5 generated tokens appended per head


@pytest.mark.parametrize(
    "method",
    [kvc.SnapKV(budget=64, window=8, heads="adaptive"), kvc.H2O(budget=64, layers="pyramid", heads="adaptive")],
    ids=lambda m: m.label(),
)
def test_model_generate_and_beams_with_adaptive_budgets(method):
    model, tok = tiny_model(), char_tokenizer()
    inputs = tok([random_text(200, seed=7)], return_tensors="pt")
    greedy = model.generate(
        **inputs, **{CACHE: method.make_cache(model, tok)}, max_new_tokens=8, do_sample=False, eos_token_id=None
    )
    ours = kvc.generate(model, tok, random_text(200, seed=7), method=method, max_new_tokens=8)
    assert greedy[0, inputs["input_ids"].shape[1] :].tolist() == ours.token_ids[0]
    beams = model.generate(
        **inputs,
        **{CACHE: method.make_cache(model, tok)},
        max_new_tokens=8,
        num_beams=3,
        num_return_sequences=2,
        eos_token_id=None,
    )
    assert beams.shape == (2, inputs["input_ids"].shape[1] + 8)


def test_h2o_eviction_refuses_adaptive_heads():
    with pytest.raises(kvc.InvalidParameterError, match=r"evict_during_decoding keeps a uniform budget per head"):
        kvc.H2O(evict_during_decoding=True, heads="adaptive")
    assert math.isfinite(kvc.SnapKV(layers="pyramid").pyramid_beta)


def test_adaptive_heads_keep_keys_and_values_in_codes_of_their_own_widths():
    """kv_bits=4 codes keys in 6 bits and values in 4: a packing's rows differ in width (laying them out again for
    an answer's room took the keys' width for both and failed)."""
    model, tok = tiny_model(), char_tokenizer()
    result = kvc.generate(
        model,
        tok,
        random_text(300, seed=2),
        method=kvc.SnapKV(budget=24, window=4, heads="adaptive", kv_bits=4),
        max_new_tokens=40,
    )
    packed = result.cache.layers[0].policy.packed
    assert len(result.token_ids[0]) == 40 and packed.keys.shape[-1] > packed.values.shape[-1]
    assert result.stats["kv_stored_as"] == "int6+int4"
