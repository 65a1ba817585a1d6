"""A decoding bound for every prompt method (``decode_budget``, ``every``): the re-selection against a reference
written from the SnapKV paper, the device bytes at every step, batches against each row alone, compiled decoding,
follow-up turns, stored contexts, files, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import kvcompress as kvc
from kvcompress.cache.errors import UnsupportedModelError
from kvcompress.methods.bounded import BoundedPolicy

from .fixtures import CACHE, char_tokenizer, family_model, random_text, tiny_model

LENGTHS = (11, 149, 419)  # under the prompt budget, over it, far over it
BOUNDED = [
    kvc.SnapKV(budget=48, window=8, decode_budget=32, every=8),
    kvc.SnapKV(budget=48, window=8, decode_budget=32, every=8, layers="pyramid", pyramid_beta=4, kv_bits=4),
    kvc.H2O(budget=48, recent=8, decode_budget=32, every=8, decode_window=8),
    kvc.StreamingLLM(budget=32, decode_budget=24, every=8, decode_window=8),
    kvc.ExpectedAttention(budget=48, decode_budget=32, every=8, decode_window=8),
]


def endless_model():
    """The tiny model with its end token's output row zeroed: its logit is 0 where a hundred others are random, so
    generations run to max_new_tokens."""
    model, tok = tiny_model(), char_tokenizer()
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] = 0
    return model, tok


def snapkv_reference(keys, queries, valid, scaling, budget, kernel, votes, pooling):
    """SnapKV's selection (Sec. 4, Listing 1) with the last ``W`` steps as its observation window, written apart from
    the library for one row: the window's softmax attention over the held keys (causal inside the window), summed
    over the window on the tokens before it (``votes="max"``: its largest there), pooled over ``kernel``
    neighbours (their maximum, or ``pooling="avg"`` their mean, zeros past the ends), averaged over each KV head's
    query heads; each head keeps its ``budget - W`` best tokens before the window (ties: the earlier) and the
    window. Returns the kept slot indices per head (sets)."""
    kv_heads, n, _ = keys.shape
    q_heads, window, _ = queries.shape
    group = q_heads // kv_heads
    keys = keys[:, valid].double()
    n = keys.shape[1]
    logits = torch.einsum("hwd,hnd->hwn", queries.double(), keys.repeat_interleave(group, dim=0)) * scaling
    future = torch.arange(n)[None, :] > torch.arange(n - window, n)[:, None]
    attention = logits.masked_fill(future, -math.inf).softmax(dim=-1)[..., : n - window]
    voted = attention.sum(dim=1) if votes == "sum" else attention.amax(dim=1)
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    pooled = pool(voted[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    per_head = pooled.view(kv_heads, group, -1).mean(dim=1)
    real = valid.nonzero()[:, 0]
    kept = []
    for head in range(kv_heads):
        scores = per_head[head].tolist()  # pooling repeats a score: ties go to the earlier token
        best = sorted(range(n - window), key=lambda i: (-scores[i], i))[: budget - window]
        kept.append({int(real[i]) for i in best} | {int(real[i]) for i in range(n - window, n)})
    return kept


@pytest.mark.parametrize("votes,pooling", [("sum", "max"), ("max", "max"), ("max", "avg")])
def test_a_reselection_keeps_what_snapkv_with_the_last_steps_as_its_window_keeps(monkeypatch, votes, pooling):
    """Every re-selection of every layer, checked against the paper's selection computed apart from the library."""
    model, tok = tiny_model(), char_tokenizer()
    method = kvc.SnapKV(
        budget=64, window=8, kernel=5, clustering="pool", decode_budget=40, every=12, votes=votes, pooling=pooling
    )
    checked = []
    reselect = BoundedPolicy.reselect

    def checking(policy, over):
        held = policy.held_tokens()
        before = held.positions[0].clone()
        expected = snapkv_reference(
            held.keys[0],
            policy.window_queries[0],
            held.valid[0],
            policy.scaling,
            policy.bound,
            method.kernel,
            votes,
            pooling,
        )
        reselect(policy, over)
        after = policy.slots.held_positions()[0]
        layer = policy.layer.layer_idx
        for head in range(after.shape[0]):
            kept = {int(p) for p in after[head] if p >= 0}
            assert kept == {int(before[head, slot]) for slot in expected[head]}, f"layer {layer} h{head}"
        checked.append(layer)

    monkeypatch.setattr(BoundedPolicy, "reselect", checking)
    result = kvc.generate(model, tok, random_text(300, seed=5), method=method, max_new_tokens=60)
    layers = model.config.num_hidden_layers  # (reselections: per layer, every layer re-selecting at the same steps)
    assert len(checked) >= 2 * 4 and result.stats["reselections"] * layers == len(checked)


@pytest.mark.parametrize("method", BOUNDED, ids=lambda m: m.label())
def test_the_device_never_holds_more_than_the_bound(method):
    """Measured from the layers' buffers before every step of a 200-token generation: no layer's slots ever pass its
    bound (``decode_budget + every``; a pyramid's share of it)."""
    model, tok = endless_model()
    over: list[int] = []

    def measure(module, args, kwargs):
        cache = kwargs.get(CACHE)
        if cache is not None and cache.layers[0].slots.cursor is not None:
            over.append(max(layer.slots.keys.shape[-2] - layer.slots.limit for layer in cache.layers))

    hook = model.register_forward_pre_hook(measure, with_kwargs=True)
    try:
        result = kvc.generate(model, tok, random_text(300, seed=1), method=method, max_new_tokens=200)
    finally:
        hook.remove()
    assert len(result.token_ids[0]) == 200 and len(over) == 199
    assert max(over) <= 0 and result.stats["reselections"] > 0
    limits = [layer.slots.limit for layer in result.cache.layers]
    assert limits[-1] == method.decode_budget + method.every if method.layers == "uniform" else limits[0] > limits[-1]
    assert result.stats["decode_bound"] == (limits if len(set(limits)) > 1 else limits[0])
    assert result.stats["device_bytes"] < 0.3 * result.stats["kv_bytes_full"]


@pytest.mark.parametrize("method", BOUNDED, ids=lambda m: m.label())
def test_each_row_of_a_batch_is_the_row_alone(method):
    """Tokens and the prompt positions still held after 40 steps (several re-selections), row by row."""
    model, tok = endless_model()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    batch = kvc.generate(model, tok, prompts, method=method, max_new_tokens=40)
    assert batch.stats["reselections"] > 0
    for row, prompt in enumerate(prompts):
        alone = kvc.generate(model, tok, prompt, method=method, max_new_tokens=40)
        assert batch.token_ids[row] == alone.token_ids[0], f"row {row}"
        for layer in range(2):
            ours, theirs = batch.cache.kept_positions(layer)[row], alone.cache.kept_positions(layer)[0]
            for head in range(ours.shape[0]):
                assert torch.equal(ours[head][ours[head] >= 0], theirs[head][theirs[head] >= 0])


def test_under_the_bound_nothing_changes():
    """A bound the generation never reaches gives the unbounded method's tokens and kept positions."""
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    plain = kvc.generate(model, tok, prompts, method=kvc.SnapKV(budget=64, window=8), max_new_tokens=30)
    bounded = kvc.generate(
        model, tok, prompts, method=kvc.SnapKV(budget=64, window=8, decode_budget=90, every=8), max_new_tokens=30
    )
    assert bounded.token_ids == plain.token_ids and bounded.stats["reselections"] == 0


def test_compiled_decoding_keeps_one_graph_while_it_reselects():
    """The re-selection runs between steps, in place: the eager tokens, one graph for two requests of other prompt
    lengths, no graph break."""
    torch._dynamo.reset()
    counters.clear()
    model, tok = endless_model()
    method = kvc.SnapKV(budget=64, window=8, decode_budget=48, every=16)
    for length in (149, 419):
        prompts = [random_text(length, seed=length), random_text(length // 2, seed=1)]
        eager = kvc.generate(model, tok, prompts, method=method, max_new_tokens=90)
        ours = kvc.generate(model, tok, prompts, method=method, max_new_tokens=90, compile=kvc.Compile(backend="eager"))
        assert ours.token_ids == eager.token_ids and ours.stats["reselections"] > 0
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()


def test_follow_up_turns_a_saved_answer_and_a_stored_context(tmp_path):
    """A bounded answer continued by a follow-up turn, saved and loaded (then continued alike), and a question over
    a stored context under the bound."""
    model, tok = tiny_model(), char_tokenizer()
    method = kvc.SnapKV(budget=64, window=8, decode_budget=48, every=16)
    first = kvc.generate(model, tok, random_text(300, seed=2), method=method, max_new_tokens=70)
    first.save(tmp_path / "turn.kvc")
    again = kvc.load(tmp_path / "turn.kvc", model, tok)
    ours = kvc.generate(model, tok, "and then?", past=first, max_new_tokens=60)
    loaded = kvc.generate(model, tok, "and then?", past=again, max_new_tokens=60)
    assert loaded.token_ids == ours.token_ids and ours.stats["reselections"] > first.stats["reselections"]
    assert max(layer.slots.keys.shape[-2] for layer in ours.cache.layers) <= 48 + 16
    longer = kvc.generate(model, tok, random_text(100, seed=6), past=ours, max_new_tokens=40)  # a turn past the room
    assert max(layer.slots.keys.shape[-2] for layer in longer.cache.layers) <= 48 + 16  # re-selected back under it

    store = kvc.compress(model, tok, random_text(400, seed=3), kvc.FullKV())
    asked = kvc.generate(model, tok, "what?", past=store, method=method, max_new_tokens=70)
    assert asked.stats["reselections"] > 0
    assert max(layer.slots.keys.shape[-2] for layer in asked.cache.layers) <= 48 + 16


def test_transformers_generate_keeps_the_bound():
    """model.generate() with the cache: the library's tokens, the same buffers."""
    model, tok = tiny_model(), char_tokenizer()
    method = kvc.StreamingLLM(budget=48, decode_budget=40, every=8)
    cache = method.make_cache(model, tok)
    ids = tok(random_text(200, seed=4), return_tensors="pt").input_ids
    out = model.generate(ids, **{CACHE: cache}, max_new_tokens=60, do_sample=False)
    ours = kvc.generate(model, tok, random_text(200, seed=4), method=method, max_new_tokens=60)
    assert out[0, ids.shape[1] :].tolist()[: len(ours.token_ids[0])] == ours.token_ids[0]
    assert max(layer.slots.keys.shape[-2] for layer in cache.layers) <= 48


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: kvc.SnapKV(budget=64, heads="adaptive", decode_budget=48),
            r"SnapKV: decode_budget=48 re-selects a uniform count per head; it does not combine with heads='adaptive'",
        ),
        (
            lambda: kvc.KVzip(budget=64, decode_budget=48),
            r"KVzip: decode_budget=48 needs scores of the answer's tokens, which KVzip does not define",
        ),
        (
            lambda: kvc.SnapKV(budget=64, decode_budget=32),
            r"SnapKV: decode_budget=32 must be greater than the 32 tokens every re-selection keeps whole",
        ),
        (
            lambda: kvc.H2O(budget=64, decode_budget=48, evict_during_decoding=True),
            r"H2O: evict_during_decoding keeps the cache at budget=64 at every step; give it or decode_budget=48",
        ),
        (lambda: kvc.SnapKV(budget=64, decode_budget=48, every=0), r"SnapKV: every=0 is invalid"),
    ],
)
def test_bad_bounds_are_refused_in_one_line(make, message):
    with pytest.raises(kvc.InvalidParameterError, match=message):
        make()


# the families whose attention differs where a bound could go wrong: sliding-window and soft-capped layers (Gemma 2),
# per-layer-type RoPE (Gemma 3), partial rotary (Phi-3), no RoPE (GPT-2), learned sinks (gpt-oss), experts (Qwen3 MoE);
# the rest share Llama's layer (the family matrix in tests/test_models.py runs every family without a bound)
BOUND_FAMILIES = ("gemma2", "gemma3", "phi3-partial-rotary", "gpt2-no-rope", "gpt-oss", "qwen3-moe")


@pytest.mark.parametrize("family", BOUND_FAMILIES)
def test_every_model_family_decodes_under_the_bound(family):
    """Each family's tiny model (sliding-window layers keep their window; gpt-oss's learned sinks score too): SnapKV
    under a bound decodes 40 tokens, each row of a batch as alone; ExpectedAttention where it takes the family."""
    model, tok = family_model(family), char_tokenizer()
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] = 0
    prompts = [random_text(n, seed=n) for n in (99, 20)]
    methods = [kvc.SnapKV(budget=32, window=8, decode_budget=24, every=8)]
    expected = kvc.ExpectedAttention(budget=32, decode_budget=24, every=8, decode_window=8)
    try:
        expected.check_model(model)
        methods.append(expected)
    except UnsupportedModelError:  # a rotary embedding it cannot invert: refused in one line, bound or not
        pass
    for method in methods:
        batch = kvc.generate(model, tok, prompts, method=method, max_new_tokens=40)
        # none: every layer slides
        bounded = any(isinstance(layer.policy, BoundedPolicy) for layer in batch.cache.layers)
        assert (batch.stats.get("reselections", 0) > 0) == bounded
        for row, prompt in enumerate(prompts):
            assert (
                batch.token_ids[row] == kvc.generate(model, tok, prompt, method=method, max_new_tokens=40).token_ids[0]
            ), f"{method.name} row {row}"
