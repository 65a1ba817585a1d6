"""The split decoding kernel (``decode_kernel.decode_attention``): one query per head over a long cache, split along
the slots, reading 8- and 4-bit coded slots as they are stored. Here it runs through Triton's CPU interpreter
(float32 and float16: the interpreter's bfloat16 products are wrong) against attention written out in float64
from decoded slots; on a GPU, in bfloat16 at a 40K cache."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvcompress.storage import decode_kernel, kernel_choice
from kvcompress.storage.codec import codec_of_code

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def reference(query, keys, values, visible, scaling, key_bits, value_bits):
    """Softmax attention in float64 over the decoded slots (the codec's own decode)."""
    dim = query.shape[-1]
    if key_bits:
        keys = codec_of_code(key_bits, dim, query.dtype).decode(keys)
    if value_bits:
        values = codec_of_code(value_bits, dim, query.dtype).decode(values)
    logits = torch.einsum("bhgd,bhsd->bhgs", query.double(), keys.double()) * scaling
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhgs,bhsd->bhgd", logits.softmax(-1), values.double())


def case(batch, heads, rows, seq, dim, key_bits, value_bits, dtype, per_head, seed=0, device="cpu"):
    """Random queries and stored slots (coded where bits > 0), a mask hiding ~30% of the slots and one whole
    stretch of 200 (a slice of the split that sees nothing), the newest slot always visible."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    stored = []
    for bits in (key_bits, value_bits):
        vectors = torch.randn(batch, heads, seq, dim, generator=gen) * 2
        stored.append(codec_of_code(bits, dim, dtype).encode(vectors) if bits else vectors.to(dtype))
    visible = torch.rand(batch, heads if per_head else 1, 1, seq, generator=gen) < 0.7
    visible[..., seq // 3 : seq // 3 + 200] = False
    visible[..., -1] = True
    return [t.to(device) for t in (query, *stored, visible)]


def test_the_split_kernel_is_a_decoding_candidate_only_where_triton_runs():
    assert "triton" not in kernel_choice.candidates("decode", "cpu", 64)
    assert all("triton" not in kernel_choice.candidates(phase, "cuda", 64) for phase in ("prefill", "turn"))
    assert "triton" not in kernel_choice.candidates("decode", "cuda", 80)  # a head the kernel does not tile
    if importlib.util.find_spec("triton") is not None:
        assert kernel_choice.candidates("decode", "cuda", 128)[-1] == "triton"
    with pytest.raises(ValueError, match=r"unknown kernels \['triton'\] for prefill.*triton for decode"):
        kernel_choice._parse_forced("prefill=triton")
    assert kernel_choice._parse_forced("decode=triton,efficient") == {"decode": ("triton", "efficient")}


def test_a_compiled_step_takes_the_kernel_fastest_on_the_device_and_an_eager_one_the_fastest_to_wait_for(monkeypatch):
    """An eager step pays each kernel's launches on the host; a compiled step replays them from a graph and pays only
    the device's time: the split kernel, slower to launch than SDPA's one kernel and faster on the device at 2K slots
    (H200, 11-28), is the compiled step's choice and not the eager one's. Each phase is timed once for both."""
    timed = []

    def times(name, probe, is_causal, enable_gqa):  # (waited for, on the device)
        timed.append(name)
        return {
            "math": (3e-4, 3e-4),
            "flash": (2e-4, 2e-4),
            "efficient": (1e-4, 9e-5),
            "triton": (2.5e-4, 1e-5),
            "cudnn": None,
        }[name]

    monkeypatch.setattr(kernel_choice, "_time_backend", times)
    monkeypatch.setattr(kernel_choice, "candidates", lambda *args: ("math", "flash", "efficient", "cudnn", "triton"))
    monkeypatch.delenv("KVCOMPRESS_SDPA", raising=False)
    kernel_choice.forget_choices()
    try:
        query, keys = torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 100, 64)
        eager = kernel_choice.choose_backends("decode", query, keys, None, False, False)
        assert eager == ("efficient", "flash", "triton", "math") and len(timed) == 5
        assert kernel_choice.sdpa_choices(graphed=True) == {
            "decode/cpu/float32/64/False/None": ("triton", "efficient", "flash", "math")
        }
        compiled = kernel_choice._compiled_backends("decode", "cpu", "torch.float32", 64, False, 0)
        assert compiled == "triton,efficient,flash,math"
        assert kernel_choice.choose_backends("decode", query, keys, None, False, False) == eager and len(timed) == 5
    finally:
        kernel_choice.forget_choices()


def test_the_torch_implementation_matches_the_reference():
    for key_bits, value_bits in ((0, 0), (8, 8), (4, 4), (8, 4), (6, 4)):
        args = case(2, 3, 3, 333, 64, key_bits, value_bits, torch.float32, per_head=key_bits == 4)
        out = decode_kernel.decode_attention(args[0], args[1], args[2], args[3], 0.125, key_bits, value_bits)
        torch.testing.assert_close(
            out.double(), reference(*args[:4], 0.125, key_bits, value_bits), rtol=1e-5, atol=1e-5
        )


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from kvcompress.storage import decode_kernel, kernel_choice, kernels, ops
    from tests.test_decode_kernel import case, reference
    shapes = [(2, 3, 3, 1100, 64, False), (1, 2, 4, 300, 128, True), (1, 1, 1, 5, 32, False), (1, 1, 8, 3000, 16, True)]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for key_bits, value_bits in ((0, 0), (8, 8), (4, 4), (8, 4), (6, 4)):
            for batch, heads, rows, seq, dim, per_head in shapes:
                args = case(batch, heads, rows, seq, dim, key_bits, value_bits, dtype, per_head)
                with ops.triton_everywhere():
                    out = decode_kernel.decode_attention(*args[:4], dim ** -0.5, key_bits, value_bits)
                expected = reference(*args[:4], dim ** -0.5, key_bits, value_bits)
                error = (out.double() - expected).abs().max().item()
                assert out.dtype == dtype and error < tolerance, (dtype, key_bits, value_bits, seq, dim, error)
    assert kernels.decode_split(1, 3000, 64) == (47, 1)  # one block a slice: the slices are weighed together
    assert kernels.decode_split(8, 131072, 64) == (32, 64)  # 256 programs of 4,096 slots

    # Inside a model: a tiny float32 model's decoding steps with the split kernel forced for every decoding step
    # (the full cache, and SnapKV's 4-bit slots read as codes) give the logits of SDPA's math kernel.
    import os
    import kvcompress as kvc
    from tests.fixtures import CACHE, tiny_model
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    prompt, steps = torch.randint(3, 128, (2, 200), generator=gen), torch.randint(3, 128, (2, 6), generator=gen)
    calls = []
    plain_kernel = kernels.decode_attention_triton
    def counted(*args):
        calls.append(args[1].dtype)
        return plain_kernel(*args)
    kernels.decode_attention_triton = counted
    def decode(method, kernel):
        os.environ["KVCOMPRESS_SDPA"] = f"decode={kernel}"
        kernel_choice.forget_choices()
        cache = method.make_cache(model)
        with torch.no_grad():
            model(prompt, **{CACHE: cache})
            return torch.cat([model(steps[:, t : t + 1], **{CACHE: cache}).logits for t in range(steps.shape[1])], 1)
    # where the split kernel runs, a step hands the codes on undecoded; decoded for SDPA's kernels only when one wins
    from kvcompress.storage import dense
    whole, decoded_pair = [], dense.decoded_pair
    dense.decoded_pair = lambda *args: whole.append(1) or decoded_pair(*args)
    for method in (kvc.FullKV(), kvc.SnapKV(budget=48, window=8, kv_bits=4, key_bits=4, clustering="pool"),
                   kvc.SnapKV(budget=48, kv_bits=8, clustering="pool"),
                   kvc.SnapKV(budget=48, kv_bits=4, clustering="pool")):
        before = len(whole)
        plain = decode(method, "math")  # no kernel reads codes: the step decodes its slots
        decoded_first = len(whole)
        assert (decoded_first > before) == (method.kv_bits < 16), (method, decoded_first - before)
        with ops.triton_everywhere():
            fused = decode(method, "triton")
            assert len(whole) == decoded_first, "the split kernel's step decoded its slots first"
            handed = decode(method, "math")  # handed the codes, SDPA chosen: decoded in dense_attention
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(handed, plain, rtol=0, atol=0)
    # every decoding step of every layer: the full cache's float32 slots, then the three coded runs' codes (the last
    # kv_bits=4 as typed: keys in 6 bits)
    assert calls == [torch.float32] * 12 + [torch.uint8] * 36, calls
    print("ok")
    """
)


@needs_triton
def test_the_split_kernel_matches_the_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVCOMPRESS_CPU_KERNEL": "0"}  # codes read by Triton's kernel alone
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@needs_gpu
@needs_triton
def test_the_split_kernel_matches_the_reference_on_the_gpu():
    for key_bits, value_bits in ((0, 0), (8, 8), (4, 4), (8, 4)):
        for batch, heads, rows, seq, dim in ((1, 8, 4, 40000, 128), (2, 3, 3, 1500, 64)):
            args = case(batch, heads, rows, seq, dim, key_bits, value_bits, torch.bfloat16, True, device="cuda")
            out = decode_kernel.decode_attention(*args[:4], dim**-0.5, key_bits, value_bits)
            expected = reference(*args[:4], dim**-0.5, key_bits, value_bits)
            torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def build_for_hopper(kernel, signature: dict[str, str], constants: dict[str, object], aligned=()) -> bytes:
    """``kernel`` compiled ahead of time for an H100/H200 (sm_90) by Triton's own compiler and ptxas, no GPU needed:
    the compiler checks what the interpreter does not (types across a function's branches: the split kernel built
    in the interpreter and failed on the H200, 11-28). ``aligned``: arguments a launch finds divisible by 16 (Triton
    specializes on it: pointers from PyTorch's allocator, strides of the 8B shape's rows). Returns the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    built = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"enable_fp_fusion": True},
    )  # as launched
    return built.asm["cubin"]


def decode_kernel_signature(key_bits: int, value_bits: int) -> dict[str, str]:
    pointers = {
        "query": "*bf16",
        "keys": "*u8" if key_bits else "*bf16",
        "key_meta": "*fp16",
        "values": "*u8" if value_bits else "*bf16",
        "value_meta": "*fp16",
        "visible": "*u8",
        "out": "*fp32",
        "lse": "*fp32",
    }
    strides = ("q_batch", "q_head", "k_batch", "k_head", "k_slot", "v_batch", "v_head", "v_slot", "m_batch", "m_head")
    return {**pointers, "heads": "i64", "seq": "i64", "scaling": "fp32", **dict.fromkeys(strides, "i64")}


def build_decode_kernel(key_bits: int, value_bits: int, dim: int, rows: int = 4, masked: bool = True) -> bytes:
    """The split kernel's sm_90 build for these codes and head (``rows`` query heads per KV head, 64-slot blocks),
    specialized as a launch on the 8B shape is: pointers and every size but the head count divisible by 16."""
    import triton

    from kvcompress.storage import kernels
    from kvcompress.storage.codec import group_size

    signature = decode_kernel_signature(key_bits, value_bits)
    aligned = [name for name, kind in signature.items() if kind.startswith("*") or kind == "i64" and name != "heads"]
    constants = dict(
        GROUP_ROWS=rows,
        DIM=dim,
        BLOCK_G=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=64,
        BLOCKS=4,
        KEY_BITS=key_bits,
        VALUE_BITS=value_bits,
        QUANT_GROUP=group_size(dim),
        MASKED=masked,
        PRECISE=False,
    )
    return build_for_hopper(kernels._decode_attention_kernel, signature, constants, aligned)


needs_nvidia_backend = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="Triton with its NVIDIA backend",
)


@needs_nvidia_backend
@pytest.mark.parametrize(
    "key_bits,value_bits,masked,dim",
    [(0, 0, True, 128), (8, 8, False, 128), (4, 4, True, 128), (6, 4, True, 128), (6, 8, True, 16)],
)
def test_the_split_kernel_builds_for_hopper(key_bits, value_bits, masked, dim):
    assert build_decode_kernel(key_bits, value_bits, dim, masked=masked)


@needs_nvidia_backend
@pytest.mark.parametrize("dtype,precise", [("fp32", True), ("bf16", False)])
def test_shadowkvs_kernels_build_for_hopper(dtype, precise):
    from kvcompress.storage import kernels

    rotated = {
        "factor_a": f"*{dtype}",
        "factor_b": f"*{dtype}",
        "chunks": "*i64",
        "inv_freq": "*fp32",
        "out": f"*{dtype}",
        "heads": "i64",
        "region": "i64",
        "k": "i64",
        "scale": "fp32",
    }
    assert build_for_hopper(
        kernels._rotated_keys_kernel,
        rotated,
        dict(RANK=160, UNIT=8, DIM=128, HALF_ROT=64, BLOCK_U=16, BLOCK_R=16, BLOCK_D=128, PRECISE=precise),
    )
    gather = {
        "store": f"*{dtype}",
        "chunks": "*i64",
        "previous_chunks": "*i64",
        "previous": f"*{dtype}",
        "hits": "*i64",
        "out": f"*{dtype}",
        "n_chunks": "i64",
        "k": "i64",
    }
    assert build_for_hopper(
        kernels._gather_chunks_kernel, gather, dict(REUSE=True, LOG_K=6, CHUNK_NUMEL=1024, BLOCK=1024)
    )
