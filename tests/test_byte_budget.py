"""A byte budget spent by importance (``kv_bytes``): the allocation against its definition written out, the bytes a
compressed prompt really holds, files, refusals, every prompt method and the command line."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import kvcompress as kvc
from kvcompress.methods import method_from_spec, sets_budget
from kvcompress.methods.byte_budget import (
    PRECISIONS,
    SEGMENT_BYTES,
    LayerScores,
    allocate,
    candidates,
    coding_errors,
    token_bytes,
)
from kvcompress.storage.codec import make_kv_codec

from .fixtures import char_tokenizer, family_model, random_text, tiny_model


def random_layer(seed: int, seq: int = 24, heads: int = 2, dim: int = 16, pinned: int = 2) -> LayerScores:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, seq, generator=generator) ** 3
    scores[:, seq - pinned :] = math.inf
    keys = torch.randn(heads, seq, dim, generator=generator) * (1 + 4 * torch.rand(dim, generator=generator))
    values = torch.randn(heads, seq, dim, generator=generator)
    probe = torch.randn(2 * heads, 4, dim, generator=generator)
    return LayerScores(scores, keys, values, probe, dim**-0.5)


def objective(layer: LayerScores, error: float, counts: list[int], lam: float, cost: int) -> float:
    """The Lagrangian of one layer written out: its coding error, each head's dropped share of its droppable scores
    (averaged over heads) and ``lam`` times the bytes of every kept token, pinned ones included."""
    dropped, tokens = 0.0, 0
    for head, count in enumerate(counts):
        scores = layer.scores[head]
        free = sorted((float(s) for s in scores if s != math.inf), reverse=True)
        dropped += 1 - sum(free[:count]) / sum(free)
        tokens += count + int((scores == math.inf).sum())
    return error + dropped / len(counts) + lam * cost * tokens


@pytest.mark.parametrize("uniform_heads", [False, True], ids=["per-head", "uniform"])
def test_each_layer_takes_the_precision_and_counts_that_minimise_its_lagrangian(uniform_heads):
    """Against every precision and every count per head (or one count for both heads) tried one by one: the
    threshold rule is the optimum."""
    layer = random_layer(0, seq=10)
    codecs = [None if name is None else make_kv_codec(name, 16, torch.float32, True) for name in PRECISIONS]
    costs = [token_bytes(name, 16, torch.float32, packed=not uniform_heads) for name in PRECISIONS]
    option = candidates(layer, codecs, costs, uniform_heads, probed=4)
    assert option.errors[0] == 0.0 and all(e > 0 for e in option.errors[1:])
    assert option.errors[1] < option.errors[2] < option.errors[3]  # 8 bits, then k6v4, then 4 bits
    tried = [(n, n) for n in range(9)] if uniform_heads else list(itertools.product(range(9), repeat=2))
    for lam in (1e-6, 1e-4, 3e-4, 1e-3, 1e-2):
        index, counts, spent = option.best(lam)
        best = min(
            (objective(layer, option.errors[p], list(c), lam, costs[p]), p, list(c))
            for p in range(len(PRECISIONS))
            for c in tried
        )
        assert objective(layer, option.errors[index], counts.tolist(), lam, costs[index]) == pytest.approx(best[0])
        assert spent == costs[index] * (int(counts.sum()) + 4)


def test_a_coding_error_is_the_probe_outputs_relative_error():
    layer = random_layer(1)
    codec = make_kv_codec("int4", 16, torch.float32, True)
    coded_keys = codec.keys.restore(codec.keys.encode(layer.keys))
    coded_values = codec.values.restore(codec.values.encode(layer.values))

    def output(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # written out in float64, head by head
        outs = []
        for head in range(4):
            q, k, v = layer.probe[head].double(), keys[head // 2].double(), values[head // 2].double()
            logits = q @ k.T * layer.scaling
            n = q.shape[0]
            logits[:, -n:] += torch.full((n, n), -math.inf).triu(1).double()
            outs.append(logits.softmax(-1) @ v)
        return torch.stack(outs)

    exact, coded = output(layer.keys, layer.values), output(coded_keys, coded_values)
    assert coding_errors(layer, [None, codec], probed=24) == pytest.approx(
        [0.0, float((coded - exact).norm() / exact.norm())], rel=1e-4
    )  # every position probed: the whole prompt


@pytest.mark.parametrize("uniform_heads", [False, True], ids=["per-head", "uniform"])
def test_the_allocation_fits_the_bytes_and_spends_more_where_it_has_more(uniform_heads):
    layers = [random_layer(seed) for seed in range(3)]
    full = 3 * 2 * 24 * token_bytes(None, 16, torch.float32, packed=not uniform_heads)
    spent = []
    for share in (0.05, 0.1, 0.2, 0.4):
        plans = allocate(layers, share * full, 16, torch.float32, True, uniform_heads)
        used = sum(
            token_bytes(plan.codec, 16, torch.float32, not uniform_heads) * int(plan.keep.sum()) for plan in plans
        )
        assert used <= share * full
        for plan, layer in zip(plans, layers):  # the pinned positions kept, each head's kept the best of the rest
            assert bool(plan.keep[layer.scores == math.inf].all())
            for head in range(2):
                kept = layer.scores[head][plan.keep[head]]
                dropped = layer.scores[head][~plan.keep[head]]
                assert dropped.numel() == 0 or float(kept.min()) >= float(dropped.max())
            assert not uniform_heads or len(set(plan.keep.sum(-1).tolist())) == 1
        spent.append(used)
    assert spent == sorted(spent) and spent[0] < spent[-1]
    packing = 0 if uniform_heads else 3 * (2 * SEGMENT_BYTES + 1)  # each packed head's start, length and capacity
    everything = allocate(layers, full + packing, 16, torch.float32, True, uniform_heads)  # room for every token
    assert all(plan.codec is None and bool(plan.keep.all()) for plan in everything)
    floor = allocate(layers, 10, 16, torch.float32, True, uniform_heads)  # less than the pinned tokens in 4 bits
    for plan, layer in zip(floor, layers):  # each keeps those alone (a token budget's floor too), in 4 bits
        assert plan.codec == "int4" and torch.equal(plan.keep, layer.scores == math.inf)


def held_bytes(slots) -> int:
    """The bytes of a layer's held tokens measured from its storage's tensors: rows, positions and a packing's own
    (its validity, starts, lengths and capacities), the room for later tokens aside."""
    if hasattr(slots, "lengths"):  # packed
        tokens = sum(map(sum, slots.lengths))
        positions = sum(p.numel() * p.element_size() for row in slots.positions for p in row)
        own = (tokens + 1) * slots.valid.element_size() + sum(
            t.numel() * t.element_size() for t in (slots.starts_t, slots.lengths_t, slots.capacities_t)
        )
        return (
            tokens
            * (slots.keys.shape[-1] * slots.keys.element_size() + slots.values.shape[-1] * slots.values.element_size())
            + positions
            + own
        )
    used = slots.positions[..., : slots.used]
    rows = slots.keys[..., : slots.used, :], slots.values[..., : slots.used, :]
    return sum(t.numel() * t.element_size() for t in (*rows, used))


@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_a_compressed_prompt_holds_at_most_its_share_of_the_16_bit_bytes(tmp_path, heads):
    """The bytes measured from the storage's tensors (codes, scales, positions); each layer's codec in its stats and
    its saved file; the answer continues the same after a load. Uniform heads stay dense (the decoding kernel reads
    their codes), adaptive ones are packed."""
    model, tok = tiny_model(num_hidden_layers=4), char_tokenizer()
    text = random_text(400, seed=3)
    for share in (1 / 4, 1 / 16):
        result = kvc.compress(model, tok, text, method=kvc.SnapKV(window=8, kv_bytes=share, heads=heads))
        stats = result.stats
        assert stats["kv_stored_as"] == "mixed" and stats["kv_bytes_share"] <= share
        layers = result.cache.layers
        assert all(hasattr(layer.slots, "lengths") == (heads == "adaptive") for layer in layers)
        sixteen = sum(layer.slots.memory(layer.policy.full_tokens())["kv_bytes_full"] for layer in layers) // 2
        assert sum(held_bytes(layer.slots) for layer in layers) / sixteen == pytest.approx(stats["kv_bytes_share"])
        names = [layer.slots.codec.name if layer.slots.codec else "16" for layer in layers]
        assert names == (
            stats["kv_layer_precisions"]
            if isinstance(stats["kv_layer_precisions"], list)
            else [stats["kv_layer_precisions"]] * 4
        )
    store = kvc.compress(model, tok, text, method=kvc.SnapKV(window=8, kv_bytes=1 / 16, heads=heads))
    store.save(tmp_path / "bytes.kvc")
    loaded = kvc.load(tmp_path / "bytes.kvc", model, tok)
    assert [layer.slots.codec for layer in loaded.cache.layers] == [layer.slots.codec for layer in store.cache.layers]
    again = [kvc.generate(model, tok, "What?", past=source, max_new_tokens=6).token_ids for source in (store, loaded)]
    assert again[0] == again[1]


@pytest.mark.parametrize(
    "method",
    [
        kvc.SnapKV(window=8, kv_bytes=1 / 8),
        kvc.H2O(kv_bytes=1 / 8, recent=8),
        kvc.StreamingLLM(kv_bytes=1 / 8),
        kvc.ExpectedAttention(kv_bytes=1 / 8),
        kvc.KVzip(kv_bytes=1 / 8),
    ],
    ids=lambda m: m.name,
)
def test_every_prompt_method_spends_a_byte_budget(method):
    model, tok = tiny_model(num_hidden_layers=3), char_tokenizer()
    text = random_text(300, seed=5)
    assert kvc.compress(model, tok, text, method=method).stats["kv_bytes_share"] <= 1 / 8
    assert len(kvc.generate(model, tok, text, method=method, max_new_tokens=4).token_ids[0]) == 4


def test_a_model_with_sliding_windows_spends_the_bytes_on_its_global_layers():
    model, tok = family_model("gemma3"), char_tokenizer()
    result = kvc.generate(
        model, tok, random_text(300, seed=9), method=kvc.SnapKV(window=8, kv_bytes=1 / 8), max_new_tokens=3
    )
    sliding = [layer.is_sliding for layer in result.cache.layers]
    assert True in sliding and False in sliding and 0 < result.stats["kv_bytes_share"] < 1 / 4
    # every layer a window (Mistral's sliding setting): the windows are what it keeps, no byte budget to spend
    windowed = kvc.generate(
        family_model("mistral-sliding"),
        tok,
        random_text(300, seed=9),
        method=kvc.SnapKV(window=8, kv_bytes=1 / 8),
        max_new_tokens=3,
    )
    assert "kv_bytes_share" not in windowed.stats and all(layer.is_sliding for layer in windowed.cache.layers)


def test_a_byte_budget_refuses_what_it_cannot_do_in_one_line():
    with pytest.raises(
        kvc.InvalidParameterError,
        match=r"^SnapKV: kv_bytes=0\.0625 chooses the kept tokens, their "
        r"precision and each layer's and head's share itself; it does "
        r"not combine with budget=64, kv_bits=4; valid: kv_bytes "
        r"alone, or a token budget without it$",
    ):
        kvc.SnapKV(kv_bytes=1 / 16, budget=64, kv_bits=4)
    with pytest.raises(kvc.InvalidParameterError, match=r"kv_bytes=1\.5 is outside the valid range \(0, 1\]"):
        kvc.SnapKV(kv_bytes=1.5)
    with pytest.raises(
        kvc.InvalidParameterError,
        match=r"^H2O: kv_bytes=0\.125 has no token budget to split into "
        r"heavy hitters and recent tokens \(recent defaults to half "
        r"the budget\); valid: kv_bytes with recent given, e\.g\. "
        r"recent=32$",
    ):
        kvc.H2O(kv_bytes=1 / 8)
    model, tok = tiny_model(), char_tokenizer()
    with pytest.raises(
        kvc.InvalidParameterError,
        match=r"^SnapKV: kv_bytes=0\.125 chooses each layer's precision "
        r"for one prompt, got a batch of 2; valid: one prompt at a "
        r"time$",
    ):
        kvc.generate(
            model,
            tok,
            [random_text(200, seed=1), random_text(150, seed=2)],
            method=kvc.SnapKV(window=8, kv_bytes=1 / 8),
            max_new_tokens=2,
        )


def test_a_spec_with_its_own_bytes_takes_no_benchmark_budget():
    assert sets_budget("snapkv:kv_bytes=0.015625") and sets_budget("snapkv:ratio=0.1") and not sets_budget("snapkv")
    method = method_from_spec("snapkv:kv_bytes=0.015625", budget=128)
    assert method.kv_bytes == 0.015625 and method.budget is None and "budget" not in method.settings()
    assert method_from_spec("snapkv:ratio=0.5", budget=128).budget is None
    assert method_from_spec("snapkv", budget=128).budget == 128


def test_a_budget_below_the_tokens_a_method_always_keeps_keeps_those_in_the_fewest_bits():
    model, tok = tiny_model(num_hidden_layers=2), char_tokenizer()
    result = kvc.compress(model, tok, random_text(200, seed=4), method=kvc.SnapKV(window=8, kv_bytes=1 / 1000))
    assert result.stats["kv_tokens_per_layer"] == [8, 8] and result.stats["kv_layer_precisions"] == "int4"
    assert result.stats["kv_bytes_share"] > 1 / 1000  # what it holds, said
