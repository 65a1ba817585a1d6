"""Long prompts with bounded memory: chunked MLPs and lazy masks give the same outputs, and no
tensor of prompt x prompt or prompt x intermediate size is created."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcompress as kvc
from kvcompress import longprompt
from kvcompress.longprompt import SequenceChunked, chunk_mlps

from .fixtures import char_tokenizer, family_model, random_text, tiny_model

METHODS = [kvc.FullKV(), kvc.SnapKV(budget=64), kvc.H2O(budget=64), kvc.StreamingLLM(budget=48), kvc.ShadowKV(budget=32), kvc.Quest(budget=64), kvc.Loki(budget=64)]


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.fixture
def small_limits(monkeypatch):
    """The long-prompt paths at test sizes: MLPs in chunks of 32 tokens, lazy masks from 1000
    elements, mask blocks of 4000 elements."""
    monkeypatch.setattr(longprompt, "MLP_CHUNK", 32)
    monkeypatch.setattr(longprompt, "MASK_LIMIT", 1000)
    monkeypatch.setattr(longprompt, "BLOCK_ELEMENTS", 4000)


def test_chunked_mlp_keeps_outputs_names_and_attributes():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    names = set(model.state_dict())
    with torch.no_grad():
        before = model(ids).logits
        assert chunk_mlps(model, 16) == 2 and chunk_mlps(model, 16) == 2  # idempotent
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SequenceChunked) and mlp.gate_proj is mlp.inner.gate_proj
    assert set(model.state_dict()) == names
    model.load_state_dict(tiny_model(seed=1).state_dict())
    assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, tiny_model(seed=1).model.layers[0].mlp.gate_proj.weight)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_lazy_masks_and_chunked_mlps_give_the_same_outputs(method, small_limits, monkeypatch):
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in (40, 300, 170)]
    bounded = kvc.generate(model, tok, prompts, method=method, max_new_tokens=8)
    monkeypatch.setattr(longprompt, "MLP_CHUNK", 1 << 20)
    monkeypatch.setattr(longprompt, "MASK_LIMIT", 1 << 40)
    kvc.FullKV().make_cache(model)  # re-chunk with the large limit
    plain = kvc.generate(model, tok, prompts, method=method, max_new_tokens=8)
    assert bounded.token_ids == plain.token_ids
    for a, b in zip(bounded.cache.layers, plain.cache.layers):
        assert torch.equal(a.kept_positions(), b.kept_positions())


@pytest.mark.parametrize("family", ["gemma3", "mistral-sliding"])
def test_lazy_sliding_window_masks(family, small_limits, monkeypatch):
    model, tok = family_model(family), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in (60, 200)]
    bounded = kvc.generate(model, tok, prompts, method=kvc.SnapKV(budget=40, window=8), max_new_tokens=6)
    monkeypatch.setattr(longprompt, "MASK_LIMIT", 1 << 40)
    plain = kvc.generate(model, tok, prompts, method=kvc.SnapKV(budget=40, window=8), max_new_tokens=6)
    assert bounded.token_ids == plain.token_ids


@pytest.mark.parametrize("method", [kvc.FullKV(), kvc.SnapKV(budget=64), kvc.ShadowKV(budget=32)], ids=lambda m: m.name)
def test_no_tensor_grows_with_prompt_squared_or_intermediate_size(method, small_limits):
    """A padded batch of 2 x 400 tokens through the tiny model (hidden 64, MLP 128): the largest
    tensor any operation creates is at most batch x prompt x hidden (no 400 x 400 mask, no 400 x 128
    MLP activation, no 400 x vocab logits)."""
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(399, seed=1), random_text(250, seed=2)]
    cache = method.make_cache(model, tok)
    tok.padding_side = "left"
    inputs = tok(prompts, return_tensors="pt", padding=True)
    watch = LargestTensor()
    with torch.no_grad(), watch:
        model(**inputs, past_key_values=cache, logits_to_keep=1)
    assert watch.largest <= 2 * 400 * 64
