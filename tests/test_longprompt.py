"""Long prompts with bounded memory: chunked MLPs and lazy masks give the same outputs, and no
tensor of prompt x prompt or prompt x intermediate size is created."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcompress as kvc
from kvcompress.integrations.transformers import longprompt
from kvcompress.integrations.transformers.longprompt import SequenceChunked, chunk_mlps

from .fixtures import CACHE, char_tokenizer, family_model, random_text, tiny_model

METHODS = [
    kvc.FullKV(),
    kvc.SnapKV(budget=64),
    kvc.H2O(budget=64),
    kvc.StreamingLLM(budget=48),
    kvc.ShadowKV(budget=32),
    kvc.Quest(budget=64),
    kvc.Loki(budget=64),
]


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
    assert torch.equal(
        model.model.layers[0].mlp.gate_proj.weight, tiny_model(seed=1).model.layers[0].mlp.gate_proj.weight
    )


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
        model(**inputs, **{CACHE: cache}, logits_to_keep=1)
    assert watch.largest <= 2 * 400 * 64


@pytest.fixture
def small_blocks(monkeypatch, small_limits):
    """Decoder layers take long prompts 64 positions at a time (re-wrapped on the next make_cache)."""
    monkeypatch.setattr(longprompt, "PREFILL_BLOCK", 64)


def blocked_and_plain(model, method, prompts, monkeypatch, **kwargs):
    tok = char_tokenizer()
    blocked = kvc.generate(model, tok, prompts, method=method, max_new_tokens=8, **kwargs)
    monkeypatch.setattr(longprompt, "PREFILL_BLOCK", 1 << 20)
    kvc.FullKV().make_cache(model)
    return blocked, kvc.generate(model, tok, prompts, method=method, max_new_tokens=8, **kwargs)


@pytest.mark.parametrize(
    "method",
    METHODS + [kvc.H2O(budget=64, evict_during_decoding=True), kvc.SnapKV(budget=64, heads="adaptive")],
    ids=lambda m: m.label(),
)
def test_a_prompt_in_blocks_gives_the_same_outputs(method, small_blocks, monkeypatch):
    model = tiny_model()
    blocked, plain = blocked_and_plain(model, method, [random_text(n, seed=n) for n in (40, 300, 170)], monkeypatch)
    assert blocked.token_ids == plain.token_ids
    if not getattr(method, "evict_during_decoding", False):
        for a, b in zip(blocked.cache.layers, plain.cache.layers):
            assert torch.equal(a.kept_positions(), b.kept_positions())


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral-sliding", "gpt2-no-rope"])
def test_a_prompt_in_blocks_on_windows_soft_capping_and_other_signatures(family, small_blocks, monkeypatch):
    model = family_model(family)
    blocked, plain = blocked_and_plain(
        model, kvc.SnapKV(budget=40, window=8), [random_text(n, seed=n) for n in (60, 230)], monkeypatch
    )
    assert blocked.token_ids == plain.token_ids


def test_a_prompt_in_blocks_writes_each_layer_over_its_input(small_blocks, monkeypatch):
    """Per prompt token, the peak of the tensors a prefill creates (between two lengths) grows by less
    than 5 hidden-sized vectors in blocks of 64, by more without them. A model whose hidden size is
    large next to its keys and values, as in real models (hidden 256; 1 KV head of 32)."""
    from .test_prefill_groups import LiveBytes

    model, tok = (
        tiny_model(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=32),
        char_tokenizer(),
    )

    def per_token(block: int) -> float:
        monkeypatch.setattr(longprompt, "PREFILL_BLOCK", block)
        kvc.FullKV().make_cache(model)
        peaks = {}
        for n in (400, 800):
            cache = kvc.SnapKV(budget=64, window=8).make_cache(model, tok)
            with torch.inference_mode(), LiveBytes() as live:
                model(
                    torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)),
                    **{CACHE: cache},
                    logits_to_keep=1,
                )
            peaks[n] = live.peak()
        return (peaks[800] - peaks[400]) / 400 / (model.config.hidden_size * 4)

    blocked, whole = per_token(64), per_token(1 << 20)
    assert blocked < 5 <= whole, (blocked, whole)
    calls = []
    handle = model.model.layers[0].inner.register_forward_hook(lambda module, args, out: calls.append(out.shape[1]))
    monkeypatch.setattr(longprompt, "PREFILL_BLOCK", 64)
    kvc.FullKV().make_cache(model)
    with torch.inference_mode():  # observed by a hook: not in blocks
        model(
            torch.randint(3, 128, (1, 300)), **{CACHE: kvc.SnapKV(budget=64).make_cache(model, tok)}, logits_to_keep=1
        )
    handle.remove()
    assert calls == [300]


def test_given_embeddings_are_not_overwritten(small_blocks):
    model, tok = tiny_model(), char_tokenizer()
    embeds = model.model.embed_tokens(
        torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    ).detach()
    kept = embeds.clone()
    with torch.inference_mode():
        out = model(
            inputs_embeds=embeds,
            **{CACHE: kvc.SnapKV(budget=64, clustering="pool").make_cache(model, tok)},
            logits_to_keep=1,
        ).logits
        plain = model(inputs_embeds=embeds, logits_to_keep=1).logits
    assert torch.equal(embeds, kept)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-4)
