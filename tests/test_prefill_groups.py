"""A batch prefilled in groups of rows: the batched prefill's tokens for every method, and a peak that
holds one group's prefill plus the kept cache of every row (measured from the tensors)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kvcompress as kvc
from kvcompress.generation.feed import prefill_groups
from kvcompress.storage.offload import ChunkStore

from .fixtures import char_tokenizer, random_text, tiny_model
from .test_batches import LENGTHS, METHODS


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages created inside, as they are created and freed: ``events``
    (bytes, storage) in order, so a peak can leave some storages out."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.events.append((storage.nbytes(), key))
                    weakref.finalize(storage, self._freed, storage.nbytes(), key)
        return out

    def _freed(self, size: int, key: int) -> None:
        self.seen.discard(key)
        self.events.append((-size, key))

    def peak(self, without: set[int] = frozenset()) -> int:
        now = top = 0
        for size, key in self.events:
            if key not in without:
                now += size
                top = max(top, now)
        return top


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_groups_of_rows_give_the_batched_prefill(method):
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS] + [random_text(300, seed=7), random_text(60, seed=8)]
    batched = kvc.generate(model, tok, prompts, method=method, max_new_tokens=10, prefill_tokens=None)
    # two rows at a time
    grouped = kvc.generate(model, tok, prompts, method=method, max_new_tokens=10, prefill_tokens=900)
    assert grouped.token_ids == batched.token_ids
    assert torch.equal(grouped.attention_mask, batched.attention_mask) and torch.equal(
        grouped.next_position, batched.next_position
    )
    if not (isinstance(method, kvc.H2O) and method.evict_during_decoding):
        for layer in range(2):
            assert torch.equal(grouped.cache.kept_positions(layer), batched.cache.kept_positions(layer))
    if isinstance(method, (kvc.FullKV, kvc.ShadowKV, kvc.Quest)) or getattr(method, "heads", "") == "adaptive":
        follow_up = kvc.generate(
            model, tok, "and then?", past=grouped, max_new_tokens=6, compile=kvc.Compile(backend="eager")
        )
        assert follow_up.token_ids == kvc.generate(model, tok, "and then?", past=batched, max_new_tokens=6).token_ids


@pytest.mark.parametrize("method", [kvc.SnapKV(budget=64), kvc.ShadowKV(budget=32)], ids=lambda m: m.name)
def test_eight_rows_peak_at_one_row_plus_the_kept_caches(method, monkeypatch):
    """Peak bytes of the tensors a prefill creates: eight rows prefilled a row at a time peak at one
    row's prefill plus the seven other rows' kept caches (15% slack). ShadowKV's offloaded values are
    left out (on a GPU they live in host memory)."""
    model, tok = tiny_model(), char_tokenizer()
    prompt = tok(random_text(1000, seed=3))["input_ids"]
    stores: set[int] = set()
    original = ChunkStore.__init__

    def recorded(store, *args, **kwargs):
        original(store, *args, **kwargs)
        stores.add(store.host.untyped_storage().data_ptr())

    monkeypatch.setattr(ChunkStore, "__init__", recorded)

    def peak(rows: int, group: int | None) -> tuple[int, int]:
        with torch.inference_mode(), LiveBytes() as live:
            feeder, _ = prefill_groups(model, lambda: method.make_cache(model, tok), [prompt] * rows, 0, group)
        return live.peak(without=stores), feeder.cache.stats()["device_bytes"]

    one, kept = peak(1, len(prompt))
    eight, _ = peak(8, len(prompt))
    assert eight <= 1.15 * (one + 7 * kept), (one, kept, eight)
    if isinstance(method, kvc.SnapKV):
        assert eight <= 1.15 * one  # a small kept cache: batch 8 costs hardly more than one row (issue 22)
    assert peak(8, None)[0] > 3 * one  # all rows at once: the peak grows with the batch
    with torch.inference_mode(), LiveBytes() as live:
        prefill_groups(model, lambda: method.make_cache(model, tok), [prompt] * 8, 0, None)
    assert live.peak() > 3 * one  # all rows at once: the peak grows with the batch


def test_bad_prefill_tokens_are_refused():
    model, tok = tiny_model(), char_tokenizer()
    refusal = r"prefill_tokens=0 is invalid; it must be an integer >= 1 \(or None for one prefill of all rows\)"
    with pytest.raises(kvc.InvalidParameterError, match=refusal):
        kvc.generate(model, tok, [random_text(50)] * 2, prefill_tokens=0)
