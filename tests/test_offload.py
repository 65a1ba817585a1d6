"""The offload store: chunk gather with reuse of the previous step's chunks (torch ops and the Triton
kernel, which runs here through Triton's CPU interpreter), ShadowKV's fetch accounting, and the GPU
path (zero-copy view, side stream, no host synchronisation), which is skipped without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvcompress as kvc
from kvcompress.storage.offload import ChunkStore, fetch_chunks, match_previous, reuse_previous, zero_copy_view

from .fixtures import CACHE, tiny_model

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def reference_gather(
    store: torch.Tensor, chunks: torch.Tensor, previous_chunks: torch.Tensor | None, previous: torch.Tensor | None
) -> torch.Tensor:
    """Loop by loop: each chosen chunk from the previous buffer if it was chosen last step, else from the store."""
    batch, heads, k = chunks.shape
    c, d = store.shape[-2:]
    out = torch.empty(batch, heads, k * c, d, dtype=store.dtype)
    for b in range(batch):
        for h in range(heads):
            for j, chunk in enumerate(chunks[b, h].tolist()):
                before = [] if previous_chunks is None else previous_chunks[b, h].tolist()
                source = (
                    previous[b, h, before.index(chunk) * c : (before.index(chunk) + 1) * c]
                    if chunk in before
                    else store[b, h, chunk]
                )
                out[b, h, j * c : (j + 1) * c] = source
    return out


def random_steps(seed: int = 0, batch: int = 2, heads: int = 3, n: int = 40, k: int = 6, c: int = 4, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    store = torch.randn(batch, heads, n, c, d, generator=gen)
    first = torch.rand(batch, heads, n, generator=gen).argsort(-1)[..., :k].sort(-1).values
    second = torch.rand(batch, heads, n, generator=gen).argsort(-1)[..., :k]
    second[..., : k // 2] = first[..., : k // 2]  # some chunks are chosen again
    return store, first, second.sort(-1).values


def test_gather_with_reuse_matches_a_loop_reference():
    store, first, second = random_steps()
    previous = fetch_chunks(store, first)
    assert torch.equal(previous, reference_gather(store, first, None, None))
    hit, slot = match_previous(second, first)
    assert hit.any() and not hit.all()
    stale = previous + 100  # hits must come from the buffer, not from the store
    assert torch.equal(
        reuse_previous(fetch_chunks(store, second), hit, slot, stale), reference_gather(store, second, first, stale)
    )


def test_cpu_store_fetches_and_overlaps_in_order():
    store, first, second = random_steps(seed=1)
    chunks = ChunkStore(store, offload=True)
    assert chunks.mode == "cpu" and chunks.view is chunks.host and chunks.nbytes == store.numel() * 4
    values, other = chunks.fetch(first, None, None, None, overlap=lambda: "keys")
    assert other == "keys" and torch.equal(values, reference_gather(store, first, None, None))
    hits = torch.zeros((), dtype=torch.long)
    again, _ = chunks.fetch(second, first, values + 100, hits, overlap=lambda: None)
    assert (
        torch.equal(again, reference_gather(store, second, first, values + 100))
        and int(hits) == int(match_previous(second, first)[0].sum()) > 0
    )


TRITON_CHECK = textwrap.dedent(
    """
    import torch
    from kvcompress.storage import ops
    from kvcompress.storage.kernels import gather_chunks_triton, rotated_keys_triton
    from kvcompress.storage.offload import gather_chunks, fetch_chunks
    from kvcompress.methods.shadowkv import rotated_keys
    for dtype in (torch.float32, torch.float16):
        gen = torch.Generator().manual_seed(0)
        store = torch.randn(2, 3, 50, 8, 16, generator=gen).to(dtype)
        first = torch.rand(2, 3, 50, generator=gen).argsort(-1)[..., :7].sort(-1).values
        second = torch.cat([first[..., :4], torch.rand(2, 3, 50, generator=gen).argsort(-1)[..., :3]], -1)
        second = torch.where(torch.arange(7) < 4, second, (second + 1) % 50).sort(-1).values
        out = gather_chunks_triton(store, first, None, None, None)
        assert torch.equal(out, fetch_chunks(store, first)), "first step"
        previous = out + 1  # hits must come from the buffer
        hits, expected_hits = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
        out = gather_chunks_triton(store, second, first, previous, hits)
        assert torch.equal(out, gather_chunks(store, second, first, previous, expected_hits)), "with hits"
        assert int(hits) == int(expected_hits) > 0, "hit count"

    # ShadowKV's keys: rebuilt from the factors and rotated (full and partial rotary), positions up to 1M
    for dtype, rotary_half in ((torch.float32, 8), (torch.float32, 4), (torch.float16, 8)):
        gen = torch.Generator().manual_seed(1)
        a = torch.randn(2, 131072, 12, generator=gen).to(dtype)
        b = (torch.randn(2, 12, 3, 16, generator=gen) / 4).to(dtype)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * rotary_half, 2).float() / (2 * rotary_half)))
        chunks = torch.stack([torch.randperm(16384, generator=gen)[:5] for _ in range(6)]).view(2, 3, 5).sort(-1).values
        chunks[..., -1] = 16383  # the last chunk: positions near 131K
        fused = rotated_keys_triton(a, b, chunks, inv_freq, 1.25, 8)
        torch.testing.assert_close(fused, rotated_keys(a, b, chunks, inv_freq, 1.25, 8), rtol=2e-3, atol=2e-3)

    # Both kernels inside ShadowKV's decoding: the same logits as torch ops, the same chunks reused.
    import kvcompress as kvc
    from tests.fixtures import CACHE, tiny_model
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    prompt, steps = torch.randint(3, 128, (1, 300), generator=gen), torch.randint(3, 128, (1, 8), generator=gen)
    def decode():
        cache = kvc.ShadowKV(budget=32, rank=8, outliers=1).make_cache(model)
        with torch.no_grad():
            model(prompt, **{CACHE: cache})
            logits = [model(steps[:, t : t + 1], **{CACHE: cache}).logits for t in range(steps.shape[1])]
        return torch.cat(logits, 1), cache.stats()
    plain, plain_stats = decode()
    with ops.triton_everywhere():
        fused, fused_stats = decode()
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert fused_stats["chunk_hit_rate"] == plain_stats["chunk_hit_rate"] > 0
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_match_torch_ops_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_shadowkv_reports_its_value_fetches():
    model = tiny_model()
    cache = kvc.ShadowKV(budget=32, rank=8, outliers=1).make_cache(model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 300)), **{CACHE: cache})
        for token in torch.randint(3, 128, (5,)).tolist():
            model(torch.tensor([[token]]), **{CACHE: cache})
    stats = cache.stats()
    layers = len(cache.layers)
    assert stats["value_fetch"] == "cpu"
    # every selected chunk (4 per KV head, 2 heads) is read from the store at each of 5 steps
    assert stats["fetched_bytes_per_step"] == layers * 2 * 4 * 8 * 16 * 4
    assert isinstance(cache.layers[0].policy.hits, torch.Tensor)  # counted on the device


@needs_gpu
def test_zero_copy_view_reads_pinned_host_memory():
    host = torch.randn(4, 64, dtype=torch.bfloat16).pin_memory()
    view = zero_copy_view(host, torch.device("cuda"))
    assert view is not None and view.is_cuda and view.dtype == torch.bfloat16
    host[2, 5] = 7.0  # no copy: the GPU sees later host writes
    torch.cuda.synchronize()
    assert view[2, 5].item() == 7.0
    assert zero_copy_view(torch.randn(3), torch.device("cuda")) is None  # not pinned


@needs_gpu
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_gather_reads_pinned_host_memory_on_the_gpu():
    store, first, second = random_steps(seed=2, n=64, k=8, c=8, d=128)
    host = store.to(torch.bfloat16).pin_memory()
    view = zero_copy_view(host, torch.device("cuda"))
    from kvcompress.storage.kernels import gather_chunks_triton

    previous = fetch_chunks(host, first).cuda() + 1
    hits = torch.zeros((), dtype=torch.long, device="cuda")
    out = gather_chunks_triton(view, second.cuda(), first.cuda(), previous, hits)
    torch.testing.assert_close(out.cpu(), reference_gather(host, second, first, previous.cpu()), rtol=0, atol=0)
    assert int(hits) == int(match_previous(second, first)[0].sum())


def test_gpu_decode_step_never_synchronizes_and_matches_cpu():
    """On a GPU: a ShadowKV step over its pinned store never synchronizes and matches the CPU's. Without one the CPU
    half still runs, so the test keeps up with the policy's interface (it called a method the 11-28 split removed and
    failed only on the H200)."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    prompt, steps = torch.randint(3, 128, (1, 300), generator=gen), torch.randint(3, 128, (1, 3), generator=gen)
    query = torch.randn(1, 4, 1, 16, generator=gen)
    out = {}
    for device in ("cpu", "cuda") if CUDA else ("cpu",):
        model.to(device)
        cache = kvc.ShadowKV(budget=32, rank=8, outliers=1).make_cache(model)
        with torch.no_grad():
            model(prompt.to(device), **{CACHE: cache})
            for t in range(steps.shape[1]):
                model(steps[:, t : t + 1].to(device), **{CACHE: cache})
        layer, step_query = cache.layers[0], query.to(device)
        if device == "cuda":
            assert layer.policy.store.mode.startswith("zero-copy") and layer.policy.store.host.is_pinned()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
        try:
            visible = layer.slots.visibility(None, 1)
            out[device] = layer.policy.attend(step_query, layer.keys, layer.values, visible, 0.25)
        finally:
            if CUDA:
                torch.cuda.set_sync_debug_mode("default")
    assert out["cpu"].shape == (1, 4, 1, 16) and out["cpu"].isfinite().all()
    if CUDA:
        torch.testing.assert_close(out["cuda"].cpu(), out["cpu"], rtol=1e-4, atol=1e-4)
