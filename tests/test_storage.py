"""The storage: one interface, one class per layout, driven by layers that override none of it."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

import kvcompress as kvc
from kvcompress.cache.layer import KVLayer, WindowLayer, WindowPolicy
from kvcompress.cache.policy import LayerPolicy
from kvcompress.methods.bounded import BoundedPolicy
from kvcompress.methods.eviction import HeadAdaptivePolicy
from kvcompress.methods.h2o import H2OPolicy
from kvcompress.methods.sparse import SparseDecodePolicy
from kvcompress.storage.capped import CappedSlots
from kvcompress.storage.dense import DenseSlots
from kvcompress.storage.packed import PackedSlots
from kvcompress.storage.ring import RingSlots
from kvcompress.storage.slots import Slots

from .fixtures import CACHE, char_tokenizer, random_text, tiny_model
from .test_architecture import module_imports

LAYOUTS = (DenseSlots, RingSlots, CappedSlots, PackedSlots)
STORAGE_OPERATIONS = {"make_room", "reserve", "relayout", "write", "new_slots", "mark_padding", "close_step"}


def interface() -> set[str]:
    return {name for name, value in vars(Slots).items() if callable(value) and not name.startswith("_")}


def test_every_layout_implements_the_whole_interface():
    for layout in LAYOUTS:
        missing = {name for name in interface() if getattr(layout, name) is getattr(Slots, name)}
        assert not missing, f"{layout.__name__} leaves {sorted(missing)} to the interface"


def test_layers_hold_their_storage_and_override_none_of_it():
    assert KVLayer.__mro__[1] is DynamicLayer  # one class, no roles mixed in (cache/layer.py)
    assert not STORAGE_OPERATIONS & set(vars(KVLayer)), "the layer drives its storage; it hands none of it on"
    for kind, base in (
        (WindowLayer, KVLayer),
        *(
            (policy, LayerPolicy)
            for policy in (WindowPolicy, H2OPolicy, HeadAdaptivePolicy, SparseDecodePolicy, BoundedPolicy)
        ),
    ):
        for cls in kind.__mro__[: kind.__mro__.index(base) + 1]:
            overrides = STORAGE_OPERATIONS & set(vars(cls))
            assert not overrides, f"{cls.__name__} overrides {sorted(overrides)}"


def test_the_storage_knows_no_layer_and_no_method():
    graph = module_imports()
    for storage in ("kvcompress.storage.slots", "kvcompress.storage.packed"):
        above = ("kvcompress.cache", "kvcompress.methods", "kvcompress.integrations")
        assert not {t for t in graph[storage] if t.startswith(above)}, storage


def test_a_head_adaptive_layer_swaps_its_storage_and_keeps_its_length():
    model, tok = tiny_model(), char_tokenizer()
    prompt = random_text(300, seed=8)
    adaptive_method = kvc.SnapKV(budget=32, window=8, heads="adaptive")
    result = kvc.generate(model, tok, prompt, method=adaptive_method, max_new_tokens=5)
    uniform = kvc.generate(model, tok, prompt, method=kvc.SnapKV(budget=32, window=8), max_new_tokens=5)
    for adaptive, dense in zip(result.cache.layers, uniform.cache.layers):
        assert isinstance(adaptive.slots, PackedSlots) and isinstance(dense.slots, DenseSlots)
        assert adaptive.get_seq_length() == dense.get_seq_length() == dense.prefill_len + 4  # the last token is not fed
        # no slots for attention: the packing attends
        assert adaptive.keys.shape[-2] == 0 and adaptive.slots.view(decoded=False).valid is None


def test_a_ring_keeps_the_window_and_a_cap_its_limit_while_decoding():
    torch.manual_seed(0)
    ring, capped = RingSlots(window=5), CappedSlots(limit=6, fills={"note": 0.0}, accumulated=("note",))
    for slots in (ring, capped):
        keys = torch.randn(1, 2, 10, 4)
        slots.hold(keys, keys.clone())
        slots.advance(10)
        slots.set(keys[:, :, -4:].clone(), keys[:, :, -4:].clone(), positions=torch.arange(6, 10).expand(1, 2, -1))
    capped.notes["note"] = torch.ones(1, 2, 4)
    for step in range(6):
        for slots in (ring, capped):
            token = torch.full((1, 2, 1, 4), float(step))
            slots.make_room(1)
            slots.write(token, token)
            if slots is capped and slots.used >= capped.limit:  # what a capping layer does: keep the limit at the front
                slots.valid[:, capped.limit :] = False
            slots.close_step(1)
            slots.advance(1)
    assert ring.seen == capped.seen == 16 and ring.used == 4 and capped.used == 6
    seen_next = ring.slot_index[ring.visibility(None, 1)[0, 0, 0]]  # what token 16 sees besides itself: the 4 before it
    assert sorted(seen_next.tolist()) == [12, 13, 14, 15]
    assert ring.kept_positions(10, torch.tensor([10])).numel() == 0  # every prompt token is out of the window now
    assert int(capped.cursor) == 6 and capped.notes["note"].shape[-1] == capped.keys.shape[-2]


def test_a_ring_saved_before_rows_counted_their_own_tokens_loads_counting_them():
    """A file written before ``real`` and ``count`` (a ring without padding among its slots) loads with each slot's
    index among its row's real tokens counted in order, and sees what it saw."""
    ring = RingSlots(window=5)
    keys = torch.randn(2, 2, 8, 4)
    ring.hold(keys, keys.clone())
    ring.valid = torch.ones(2, 8, dtype=torch.bool)
    ring.valid[1, :3] = False  # a shorter row, left-padded
    ring.advance(8)
    for _ in range(4):  # the slots wrap around the ring
        ring.make_room(1)
        ring.write(keys[:, :, :1], keys[:, :, :1])
        ring.close_step(1)
        ring.advance(1)
    state = {name: value for name, value in ring.state_dict().items() if name not in ("real", "count")}
    old = RingSlots(window=5)
    old.load_state_dict(state, torch.device("cpu"))
    assert torch.equal(old.visibility(None, 1), ring.visibility(None, 1))
    assert torch.equal(old.kept_positions(8, torch.tensor([8, 5])), ring.kept_positions(8, torch.tensor([8, 5])))


def test_a_turn_fed_at_once_after_an_evicting_cache_is_full_stays_causal():
    """H2O evicting while decoding holds its budget; a turn of several tokens then writes after the
    held slots, and each of its tokens sees the held ones and the turn's tokens up to itself only."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(9)
    prompt, steps, turn, other = (torch.randint(3, 128, (1, n), generator=gen) for n in (100, 5, 6, 3))

    def turn_logits(tokens: torch.Tensor) -> torch.Tensor:
        cache = kvc.H2O(budget=24, evict_during_decoding=True).make_cache(model)
        with torch.no_grad():
            model(prompt, **{CACHE: cache})
            for t in range(steps.shape[1]):
                model(steps[:, t : t + 1], **{CACHE: cache})
            assert cache.layers[0].slots.used == 24
            return model(tokens, **{CACHE: cache}).logits[0]

    whole = turn_logits(turn)
    # The first token alone attends as in the turn (eviction comes after attention); later tokens change none before.
    torch.testing.assert_close(whole[:1], turn_logits(turn[:, :1]))
    torch.testing.assert_close(whole[:3], turn_logits(torch.cat([turn[:, :3], other], dim=1))[:3])
