"""The cache layer as a pipeline: one phase at a time (its transitions in one table), each tensor a layer holds
declared once (saving, loading, batch operations and moving derive from the declaration), and misuse refused by
name on every path a user can take."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache import held
from kvcompress.cache.held import hold
from kvcompress.cache.layer import KVLayer
from kvcompress.cache.phase import TRANSITIONS, Phase, PhaseError, moved
from kvcompress.methods import method_from_spec

from .fixtures import CACHE, char_tokenizer, random_text, tiny_model


def undeclared(layer: KVLayer) -> list[str]:
    """Tensor attributes of ``layer`` and its policy their classes do not declare (none may be: a test asks every
    method's layers)."""
    return sorted(
        name
        for holder in (layer, layer.policy)
        for name, value in vars(holder).items()
        if isinstance(value, torch.Tensor) and name not in held.declared(type(holder))
    )


SPECS = [
    "full",
    "snapkv:budget=24:window=4",
    "snapkv:budget=24:window=4:heads=adaptive",
    "snapkv:budget=24:window=4:layers=pyramid",
    "streamingllm:budget=24",
    "h2o:budget=24",
    "h2o:budget=24:evict_during_decoding=True",
    "expected:budget=24",
    "kvzip:budget=24",
    "shadowkv:budget=16:rank=4:outliers=1:local_chunks=1",
    "quest:budget=32:page_size=8",
    "quest:budget=32:page_size=8:offload=True",
    "loki:budget=24:recent=8",
]


@pytest.mark.parametrize("spec", SPECS)
def test_a_dropped_result_frees_its_cache_at_once(spec):
    """No reference cycle keeps a cache alive until the next cycle collection (a layer holds its method's policy, the
    policy its layer weakly): a request's memory is back as soon as its result is dropped, on a GPU too."""
    model, tok = tiny_model(), char_tokenizer()
    result = kvc.generate(model, tok, random_text(150, seed=4), method=method_from_spec(spec), max_new_tokens=4)
    held_objects = [result.cache, *result.cache.layers, *(layer.slots for layer in result.cache.layers)]
    refs = [weakref.ref(each) for each in held_objects]
    del held_objects
    collecting = gc.isenabled()
    gc.disable()
    try:
        del result
        assert [ref for ref in refs if ref() is not None] == []
    finally:
        if collecting:
            gc.enable()


def test_every_phase_is_reached_from_an_empty_layer_and_decoding_is_the_end():
    reached, frontier = {Phase.EMPTY}, [Phase.EMPTY]
    while frontier:
        for after in TRANSITIONS[frontier.pop()] - reached:
            reached.add(after)
            frontier.append(after)
    assert reached == set(Phase) and TRANSITIONS[Phase.DECODING] == frozenset()


def test_an_illegal_transition_names_both_phases():
    with pytest.raises(
        PhaseError,
        match=r"layer 3 cannot go from decoding \(compressed; each step appends\) to prompt "
        r"\(coming in, in blocks\) \(a second prompt\)",
    ):
        moved(3, Phase.DECODING, Phase.PROMPT, "a second prompt")
    assert issubclass(PhaseError, kvc.CacheMisuseError)


def test_a_used_layer_refuses_to_continue_a_stored_context_by_its_phase():
    model, tok = tiny_model(), char_tokenizer()
    context = kvc.compress(model, tok, random_text(80, seed=2))
    used = kvc.generate(model, tok, random_text(60, seed=3), max_new_tokens=2).cache
    with pytest.raises(
        PhaseError, match=r"layer 0 cannot go from decoding .* to prompt .*a prompt continuing a stored"
    ):
        used.layers[0].continue_prompt(context.cache.layers[0], torch.tensor([0]), [0], None)


@pytest.mark.parametrize("spec", SPECS)
def test_every_tensor_a_methods_layer_holds_is_declared(spec):
    """After a batch of two lengths is prefilled, compressed and decoded, no layer holds a tensor its class does not
    declare (so saving, loading, batch selection, beam reordering and moving cannot forget one)."""
    model, tok = tiny_model(), char_tokenizer()
    result = kvc.generate(
        model, tok, [random_text(150, seed=4), random_text(90, seed=5)], method=method_from_spec(spec), max_new_tokens=4
    )
    for layer in result.cache.layers:
        assert undeclared(layer) == [], f"{type(layer).__name__} holds undeclared tensors"
        assert layer.phase is Phase.DECODING and layer.open_step is None


class _Toy(KVLayer):
    notes: torch.Tensor | None = hold(rows=True, counted=True)  # [b, 3]
    table: torch.Tensor | None = hold()  # [5]: not per row


def test_a_declared_tensor_goes_through_every_operation_and_an_undeclared_one_is_caught():
    layer = _Toy(0)
    layer.lazy_initialization(torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8))
    layer.slots.set(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8))
    layer.phase, layer.prefill_len, layer.prompt_tokens = Phase.DECODING, 4, torch.tensor([4, 4])
    layer.notes, layer.table = torch.arange(6.0).view(2, 3), torch.arange(5.0)
    layer.batch_select_indices(torch.tensor([1, 1, 0]))
    assert layer.notes.tolist() == [[3.0, 4.0, 5.0], [3.0, 4.0, 5.0], [0.0, 1.0, 2.0]] and layer.table.shape == (5,)
    state = held.save(layer)
    assert state["notes"] is layer.notes and state["table"] is layer.table
    loaded = _Toy(0)
    held.load(loaded, state, torch.device("cpu"))
    assert torch.equal(loaded.notes, layer.notes) and loaded.phase is Phase.DECODING
    held.move(loaded, lambda t: t.double())
    assert loaded.notes.dtype == loaded.table.dtype == loaded.keys.dtype == torch.float64
    assert loaded.stats()["index_bytes"] >= loaded.notes.numel() * 8
    loaded.scratch = torch.zeros(3)
    assert undeclared(loaded) == ["scratch"]


def _answer(model, tok, past):
    return kvc.generate(model, tok, "and then?", past=past.copy(), max_new_tokens=4).token_ids


def test_misuse_across_model_instances_is_a_named_error_that_loses_nothing():
    """As a new user would: a result continued with another instance of the model, a used cache and a fresh one
    passed to another model's generate or forward."""
    model, other, tok = tiny_model(), tiny_model(seed=1), char_tokenizer()
    ids = tok(random_text(100, seed=6), return_tensors="pt")
    result = kvc.generate(
        model, tok, random_text(120, seed=1), method=kvc.SnapKV(budget=32, window=8), max_new_tokens=3
    )
    before = _answer(model, tok, result)
    with pytest.raises(
        kvc.CacheMisuseError,
        match=r"made for another model instance .*continue a conversation with the "
        r"model that began it",
    ):
        kvc.generate(other, tok, "more", past=result, max_new_tokens=3)
    used = kvc.SnapKV(budget=32, window=8).make_cache(model, tok)
    model.generate(**ids, **{CACHE: used}, max_new_tokens=3, do_sample=False)
    fresh = kvc.SnapKV(budget=32, window=8).make_cache(model, tok)
    for cache in (used, fresh):
        with pytest.raises(
            kvc.CacheMisuseError, match=r"called by a model it was not made for .*method.make_cache\(model\)"
        ):
            other.generate(**ids, **{CACHE: cache}, max_new_tokens=3, do_sample=False)
        with pytest.raises(kvc.CacheMisuseError, match=r"called by a model it was not made for"), torch.no_grad():
            other(**ids, **{CACHE: cache})
    assert _answer(model, tok, result) == before  # the refused calls wrote nothing
    assert fresh.get_seq_length() == 0 and all(layer.phase is Phase.EMPTY for layer in fresh.layers)


def test_the_budget_is_one_function_of_the_methods_fields_and_the_layers_share():
    """kept_tokens: budget or ceil(ratio * length), never under the reserved tokens (SnapKV's window), a layer's
    pyramid share of the budget or global share of each row's count beyond them, capped by each row's length."""
    lengths = torch.tensor([100, 1000, 5])
    assert kvc.SnapKV(ratio=0.01, window=8).kept_tokens(lengths).tolist() == [8, 10, 5]
    assert kvc.SnapKV(budget=64, window=8).kept_tokens(lengths).tolist() == [64, 64, 5]
    assert kvc.SnapKV(budget=64, window=8).kept_tokens(lengths, 0.5).tolist() == [8 + 28, 8 + 28, 5]  # pyramid
    shares = torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64)  # global: of each row's own count
    assert kvc.SnapKV(budget=64, window=8).kept_tokens(lengths, shares).tolist() == [100, 8 + 28, 5]
    assert kvc.StreamingLLM(ratio=0.001, sinks=4).kept_tokens(torch.tensor([900])).tolist() == [4]
