"""Decoding as one compiled graph: the eager tokens for every method and model family, in batches and
follow-up turns; no graph break, no recompile across steps, no host read inside a step; the ops a
step dispatches. Most checks compile with dynamo's capture alone (``backend="eager"``): graph breaks
and recompiles are decided there, at a fraction of inductor's compile time; one test runs inductor."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import kvcompress as kvc
from kvcompress.bench.audit import audit_step, transformers_step_ops
from kvcompress.bench.speed import stand_in_lead
from kvcompress.cache.layer import KVLayer
from kvcompress.cache.tokens import TokenSpans
from kvcompress.generation.decode import DecodeState, greedy_step
from kvcompress.generation.feed import prefill_groups
from kvcompress.integrations.transformers.models import random_model

from .fixtures import CACHE, FAMILIES, char_tokenizer, family_model, random_text, tiny_model
from .test_batches import LENGTHS, METHODS

CAPTURE = kvc.Compile(backend="eager")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def compiled(model, tok, prompt, compile=CAPTURE, **kwargs) -> kvc.Result:
    """``kvc.generate`` with a compiled decoding step: one graph for all its steps, no break."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        result = kvc.generate(model, tok, prompt, compile=compile, **kwargs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return result


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_compiled_decoding_gives_the_eager_tokens_in_a_batch(method):
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    eager = kvc.generate(model, tok, prompts, method=method, max_new_tokens=12)
    ours = compiled(model, tok, prompts, method=method, max_new_tokens=12)
    assert ours.token_ids == eager.token_ids and graphs() == 1
    assert torch.equal(ours.attention_mask, eager.attention_mask) and torch.equal(
        ours.next_position, eager.next_position
    )
    if isinstance(method, (kvc.FullKV, kvc.ShadowKV)):
        # a new cache of the same layout: the same graph
        again = compiled(model, tok, prompts, method=method, max_new_tokens=12)
        assert again.token_ids == eager.token_ids and graphs() == 1


def test_a_sampled_answer_compiled_is_the_eager_one_for_a_seed():
    """The host draws each step's noise and the temperature and top-p are tensors: one graph for every setting."""
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    method = kvc.SnapKV(budget=48, window=8)
    for temperature, top_p in ((1.3, 1.0), (0.7, 0.9)):
        eager = kvc.generate(
            model, tok, prompts, method=method, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=7
        )
        ours = compiled(
            model, tok, prompts, method=method, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=7
        )
        assert ours.token_ids == eager.token_ids and graphs() == 1


@pytest.mark.parametrize(
    "method",
    [kvc.SnapKV(budget=64, heads="adaptive"), kvc.H2O(budget=64, evict_during_decoding=True), kvc.ShadowKV(budget=32)],
    ids=lambda m: m.label(),
)
def test_follow_up_turns_recompile_once_then_reuse_the_graph(method):
    """Longer turns grow the buffers: the decoding after the turn that crosses a capacity bucket
    compiles once more, with the capacity as a symbol (dynamo's automatic dynamic shapes), and every
    later turn reuses that graph: at most one more compilation over all the turns."""
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    eager = kvc.generate(model, tok, prompts, method=method, max_new_tokens=8)
    ours = compiled(model, tok, prompts, method=method, max_new_tokens=8)
    first = graphs()
    for turn in range(3):
        eager = kvc.generate(model, tok, f"and then {turn}?", past=eager, max_new_tokens=8)
        ours = kvc.generate(model, tok, f"and then {turn}?", past=ours, max_new_tokens=8, compile=CAPTURE)
        assert ours.token_ids == eager.token_ids, f"turn {turn}"
        assert graphs() - first <= 1 and not counters["graph_break"]


@pytest.mark.parametrize("spec", ["snapkv:budget=64:window=8", "full", "snapkv:budget=64:window=8:heads=adaptive"])
def test_requests_of_other_lengths_in_one_bucket_compile_once(spec):
    """20 requests of random prompt lengths and max_new_tokens whose capacities fall in one bucket
    (full: 301-512 slots; SnapKV: 65-128) reuse one graph, and the compilation is timed apart."""
    model, tok = tiny_model(), char_tokenizer()
    method, rng = kvc.method_from_spec(spec), random.Random(0)
    for request in range(20):
        length, new = rng.randint(300, 450), rng.randint(4, 30)
        eager = kvc.generate(model, tok, random_text(length, seed=request), method=method, max_new_tokens=new)
        ours = kvc.generate(
            model, tok, random_text(length, seed=request), method=method, max_new_tokens=new, compile=CAPTURE
        )
        assert ours.token_ids == eager.token_ids and eager.stats["compile_s"] is None
        assert (ours.stats["compile_s"] > 0) == (request == 0), f"request {request}"  # only the first compiles
    assert graphs() == 1 and not counters["graph_break"]


# those three: plain layers, as the tests above
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "mistral", "qwen2")])
def test_compiled_decoding_on_every_model_family(family):
    model, tok = family_model(family), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    rotary = family in ("phi3-partial-rotary", "gemma3")  # ShadowKV's key rotation: partial, per layer type
    for method in [kvc.SnapKV(budget=64), *([kvc.ShadowKV(budget=32)] if rotary else [])]:
        torch._dynamo.reset()
        assert (
            compiled(model, tok, prompts, method=method, max_new_tokens=10).token_ids
            == kvc.generate(model, tok, prompts, method=method, max_new_tokens=10).token_ids
        )


def test_inductor_compiles_the_step_to_the_eager_tokens():
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    eager = kvc.generate(model, tok, prompts, method=kvc.SnapKV(budget=64), max_new_tokens=12)
    assert (
        compiled(model, tok, prompts, compile=True, method=kvc.SnapKV(budget=64), max_new_tokens=12).token_ids
        == eager.token_ids
    )


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_a_decoding_step_reads_nothing_back_to_the_host(method):
    model = tiny_model()
    cache = method.make_cache(model, char_tokenizer())
    with torch.inference_mode():  # prefilled as kvcompress does (with the observation pass of a method that has one)
        _, logits = prefill_groups(
            model, lambda: cache, torch.randint(3, 128, (2, 300)).tolist(), 0, None, stand_in_lead
        )
        state = DecodeState.start(logits, torch.full((2,), 300), 4, {2})
        cache.reserve(3)
        greedy_step(model, cache, state)
        audit = audit_step(lambda: greedy_step(model, cache, state))
    assert not audit.host_reads and audit.total > 0


def test_sparse_steps_dispatch_at_most_one_and_a_half_times_transformers_ops():
    """A fused op (the chunk gather, ShadowKV's key rebuild) counts once: on a GPU it is one Triton kernel."""
    model = random_model("smollm2-135m")
    reference = transformers_step_ops(model)
    ratios = {}
    with torch.inference_mode():
        for method in (
            kvc.ShadowKV(budget=64),
            kvc.Quest(budget=64),
            kvc.Loki(budget=64),
            kvc.SnapKV(budget=64),
            kvc.FullKV(),
        ):
            cache = method.make_cache(model, TokenSpans.every(model.config.vocab_size))
            logits = model(torch.randint(10, 1000, (1, 256)), **{CACHE: cache}, logits_to_keep=1).logits[:, -1]
            state = DecodeState.start(logits, torch.tensor([256]), 4, set())
            cache.reserve(3)
            greedy_step(model, cache, state)
            ratios[method.name] = audit_step(lambda: greedy_step(model, cache, state)).total / reference
    assert all(ratio <= 1.5 for ratio in ratios.values()), ratios


@dataclass
class HostBound(kvc.FullKV):
    """A toy method whose decoding step would read the host."""

    name: ClassVar[str] = "hostbound"

    def make_layer(self, layer_idx, model) -> KVLayer:
        layer = KVLayer(layer_idx)
        layer.policy.uncapturable = lambda: "its layers read chunk ids on the host"
        return layer


def test_a_step_that_cannot_be_one_graph_is_refused_by_name():
    model, tok = tiny_model(), char_tokenizer()
    with pytest.raises(
        ValueError,
        match=r"compile=True cannot capture hostbound\(\)'s decoding step: its layers read chunk ids on the host; "
        r"run it without compile",
    ):
        kvc.generate(model, tok, random_text(50), method=HostBound(), compile=True)
    with pytest.raises(
        kvc.InvalidParameterError, match=r"compile='yes' is invalid; give True, False or a kvcompress.Compile"
    ):
        kvc.generate(model, tok, random_text(50), compile="yes")
