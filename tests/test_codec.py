"""Kept tokens in 8 or 4 bits (storage/codec.py): the codes against a reference written from the scheme, the bytes
measured from the tensors under every layout, every method coded in batches, compiled steps, saved files and stored
contexts, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress as kvc
from kvcompress.serving.settings import method_of
from kvcompress.storage.codec import hadamard, make_codec

from .fixtures import FAMILIES, char_tokenizer, family_model, random_text, tiny_model
from .test_batches import LENGTHS, METHODS
from .test_compile import compiled, fresh_dynamo, graphs  # noqa: F401 (fresh_dynamo: autouse, every test here)


def reference_int(vectors: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric round-to-nearest per token and group of channels, one vector at a time, written from the scheme:
    scale = (max - min) / (2^bits - 1) and the minimum, both rounded to float16 first; code = round((x - min) / scale);
    decoded = code * scale + min."""
    out = torch.empty_like(vectors, dtype=torch.float32)
    flat, decoded = vectors.reshape(-1, vectors.shape[-1]).float(), out.view(-1, vectors.shape[-1])
    levels = 2**bits - 1
    for row in range(flat.shape[0]):
        for start in range(0, flat.shape[1], group):
            part = flat[row, start : start + group]
            low = part.min().half().float()
            scale = ((part.max() - part.min()) / levels).half().float()
            codes = torch.zeros_like(part) if scale == 0 else ((part - low) / scale).round().clamp(0, levels)
            decoded[row, start : start + group] = codes * scale + low
    return out


@pytest.mark.parametrize(("name", "bits"), [("int8", 8), ("int6", 6), ("int4", 4)])
@pytest.mark.parametrize("dim", [64, 128, 96])
def test_integer_codes_decode_to_the_reference(name, bits, dim):
    vectors = torch.randn(2, 3, 17, dim) * torch.linspace(0.1, 8, dim)  # channels of very different ranges
    codec = make_codec(name, dim, torch.float32)
    rows = codec.encode(vectors)
    assert rows.dtype == torch.uint8 and rows.shape == (2, 3, 17, codec.row_bytes)
    assert codec.row_bytes == dim * bits // 8 + 4 * (dim // math.gcd(dim, 64))
    # equal but where a value sits on a code's half step: the codec multiplies by 1 / scale, the reference divides
    differ = (codec.decode(rows) - reference_int(vectors, bits, math.gcd(dim, 64))).abs() > 1e-4
    assert int(differ.sum()) <= vectors.numel() // 1000


def test_six_bit_rows_are_int4s_nibbles_then_the_top_bits_four_a_byte():
    """The layout docs/file-format.md gives, for one group of 64 channels: channel 2i's low 4 bits in byte i's low
    nibble, 2i + 1's in its high one; then the top 2 bits, byte 32 + m holding at bits 2j, 2j + 1 those of place
    m + 16j of the order nibbles unpack (channels 0, 2, ..., 62, then 1, 3, ..., 63); then the scale and minimum."""
    codes = torch.randperm(64, generator=torch.Generator().manual_seed(0))  # every 6-bit code once: range 0..63
    rows = make_codec("int6", 64, torch.float32).encode(codes.float())
    nibbles = [(int(codes[2 * i]) & 15) | (int(codes[2 * i + 1]) & 15) << 4 for i in range(32)]
    unpack_order = list(range(0, 64, 2)) + list(range(1, 64, 2))
    tops = [sum((int(codes[unpack_order[m + 16 * j]]) >> 4) << (2 * j) for j in range(4)) for m in range(16)]
    assert rows[:48].tolist() == nibbles + tops
    assert rows[48:].view(torch.float16).tolist() == [1.0, 0.0]  # scale (63 - 0) / 63, minimum 0


def test_fp8_is_vllms_float8_e4m3_with_scale_one_saturating():
    vectors = torch.randn(4, 64) * 100
    vectors[0, 0], vectors[0, 1] = 1000.0, -1000.0
    codec = make_codec("fp8", 64, torch.bfloat16)
    expected = vectors.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(codec.decode(codec.encode(vectors)), expected) and codec.row_bytes == 64


def test_turned_codes_keep_attention_logits_and_undo_exactly():
    turn = hadamard(64, torch.device("cpu"))
    assert torch.allclose(turn @ turn, torch.eye(64), atol=1e-6)
    codec = make_codec("int8", 64, torch.float32, rotated=True)
    keys, query = torch.randn(5, 64), torch.randn(3, 64)
    assert torch.allclose(codec.into_basis(query) @ codec.into_basis(keys).T, query @ keys.T, atol=1e-4)
    assert torch.allclose(codec.restore(codec.encode(keys)), keys, atol=0.05)
    assert make_codec("fp8", 64, torch.float32, rotated=True).rotated is False  # vLLM's fp8 is never turned


# 16-bit model, 64-channel heads: the bytes the issue names are against the same cache at 16 bits
LAYOUT_SPECS = {
    "dense": "snapkv:budget=64",
    "dense-full": "full",
    "ring": "streamingllm:budget=64",
    "capped": "h2o:budget=64:evict_during_decoding=true",
    "packed": "snapkv:budget=64:heads=adaptive",
    "chunks": "quest:budget=64:offload=true",
    "values-only chunks": "shadowkv:budget=64",
}


@pytest.mark.parametrize("layout", sorted(LAYOUT_SPECS))
def test_coded_bytes_are_measured_from_the_tensors_under_every_layout(layout):
    model = tiny_model(head_dim=64, hidden_size=256).to(torch.bfloat16)
    tok, prompt = char_tokenizer(), random_text(600, seed=3)
    # kv_bits=4 as typed: keys in 6 bits where the layout holds keys apart (k6v4, 88 of 256 bytes), int4 in a chunk
    # store; key_bits=4: both in 4 bits (36 of 128)
    settings = {16: "kv_bits=16", 8: "kv_bits=8", 4: "kv_bits=4", "4+4": "kv_bits=4:key_bits=4"}
    methods = {bits: kvc.method_from_spec(f"{LAYOUT_SPECS[layout]}:{given}") for bits, given in settings.items()}
    stats = {
        bits: kvc.generate(model, tok, prompt, method=method, max_new_tokens=4).stats
        for bits, method in methods.items()
    }
    assert methods[4].kv_codec() == ("int4" if "chunks" in layout else "int6+int4")
    for bits, bound in ((8, 0.55), (4, 0.30 if "chunks" in layout else 0.35), ("4+4", 0.30)):
        for key in ("kv_bytes_kept", "offloaded_bytes"):
            if stats[16][key]:
                assert stats[bits][key] <= bound * stats[16][key], (key, bits, stats[bits][key] / stats[16][key])
        assert stats[bits]["kv_bytes_full"] == stats[16]["kv_bytes_full"]  # the reference: the model's dtype
        assert stats[bits]["kv_tokens_per_layer"] == stats[16]["kv_tokens_per_layer"]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_each_row_of_a_coded_batch_equals_the_row_alone(method):
    coded = type(method)(**{**method.settings(), "kv_bits": 4})
    model, tok = tiny_model(), char_tokenizer()
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    batch = kvc.generate(model, tok, prompts, method=coded, max_new_tokens=8)
    for row, prompt in enumerate(prompts):
        assert batch.token_ids[row] == kvc.generate(model, tok, prompt, method=coded, max_new_tokens=8).token_ids[0]


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:budget=64:kv_bits=4:key_bits=4",
        "full:kv_bits=8:kv_format=fp8",
        "snapkv:budget=64:heads=adaptive:kv_bits=4:key_bits=8",
        "snapkv:budget=64:kv_bits=4:key_bits=6",
        "shadowkv:budget=32:kv_bits=8",
    ],
)
def test_a_coded_step_compiles_to_the_eager_tokens_in_one_graph(spec):
    model, tok, method = tiny_model(), char_tokenizer(), kvc.method_from_spec(spec)
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    eager = kvc.generate(model, tok, prompts, method=method, max_new_tokens=10)
    assert compiled(model, tok, prompts, method=method, max_new_tokens=10).token_ids == eager.token_ids
    assert graphs() == 1


@pytest.mark.parametrize(
    ("key_bits", "spec"),
    [
        (4, "int4/16/float32/rotated"),
        (8, "int8/16/float32/rotated+int4/16/float32/rotated"),
        (None, "int6/16/float32/rotated+int4/16/float32/rotated"),
    ],
)
def test_a_coded_conversation_saved_loaded_and_continued_answers_as_in_memory(tmp_path, key_bits, spec):
    model, tok = tiny_model(), char_tokenizer()
    first = kvc.generate(
        model,
        tok,
        random_text(400, seed=2),
        method=kvc.SnapKV(budget=64, kv_bits=4, key_bits=key_bits),
        max_new_tokens=6,
    )
    first.save(tmp_path / "a.kvc")
    again = kvc.load(tmp_path / "a.kvc", model, tok)
    assert again.cache.layers[0].slots.codec.spec() == spec
    follow = [
        kvc.generate(model, tok, "and then?", past=r, max_new_tokens=6).token_ids for r in (first.copy(), again.copy())
    ]
    assert follow[0] == follow[1]
    again.save(tmp_path / "b.kvc")  # a second save of what was loaded: the same tensors
    reloaded = kvc.load(tmp_path / "b.kvc", model, tok)
    assert reloaded.cache.stats()["kv_bytes_kept"] == first.cache.stats()["kv_bytes_kept"]


def test_a_coded_store_is_continued_by_each_question_decoded():
    model, tok = tiny_model(), char_tokenizer()
    document = random_text(500, seed=4)
    plain = kvc.compress(model, tok, document, method=kvc.FullKV())
    coded = kvc.compress(model, tok, document, method=kvc.FullKV(kv_bits=8))
    assert coded.stats["kv_bytes_kept"] < 0.7 * plain.stats["kv_bytes_kept"]
    for question in ("first word?", "last word?"):
        over = [
            kvc.generate(model, tok, question, past=store, method=kvc.SnapKV(budget=64), max_new_tokens=6)
            for store in (plain, coded)
        ]
        assert over[1].stats["prompt_tokens"] == over[0].stats["prompt_tokens"]
        assert over[1].token_ids == over[0].token_ids  # 8-bit codes: the same greedy answer on this model
    stored = coded.cache.layers[0].stored_prompt()
    assert stored.keys.dtype == torch.float32  # a question reads the store decoded, in the model's basis
    assert torch.allclose(stored.keys, plain.cache.layers[0].stored_prompt().keys, atol=0.05)


@pytest.mark.parametrize("layout", ["dense", "dense-full", "ring", "capped", "packed"])
def test_keys_in_more_bits_than_values_cost_each_their_own_rows(layout):
    model = tiny_model(head_dim=64, hidden_size=256).to(torch.bfloat16)
    tok, prompt = char_tokenizer(), random_text(600, seed=3)
    runs = {
        name: kvc.generate(
            model, tok, prompt, max_new_tokens=4, method=kvc.method_from_spec(f"{LAYOUT_SPECS[layout]}:{spec}")
        )
        for name, spec in (
            ("k8v4", "kv_bits=4:key_bits=8"),
            ("k6v4", "kv_bits=4:key_bits=6"),
            ("int8", "kv_bits=8"),
            ("16", "kv_bits=16"),
        )
    }
    stats = {name: run.stats for name, run in runs.items()}
    # a 64-channel token: keys 64 + 4 bytes of scales (int8) or 48 + 4 (int6), values 32 + 4 (int4), against
    # 68 + 68 in int8
    assert stats["k8v4"]["kv_bytes_kept"] * 136 == stats["int8"]["kv_bytes_kept"] * 104
    assert stats["k6v4"]["kv_bytes_kept"] * 136 == stats["int8"]["kv_bytes_kept"] * 88
    assert stats["k8v4"]["kv_bytes_kept"] <= 0.41 * stats["16"]["kv_bytes_kept"]
    assert stats["k6v4"]["kv_bytes_kept"] <= 0.35 * stats["16"]["kv_bytes_kept"]
    for name, widths, spec in (
        ("k8v4", (68, 36), "int8/64/bfloat16/rotated+int4/64/bfloat16/rotated"),
        ("k6v4", (52, 36), "int6/64/bfloat16/rotated+int4/64/bfloat16/rotated"),
    ):
        slots = runs[name].cache.layers[0].slots
        assert (slots.keys.shape[-1], slots.values.shape[-1]) == widths
        assert slots.codec.spec() == spec


def test_keys_and_values_are_each_their_own_codecs_rounding():
    """Stored keys equal the int8 codec's round trip of the model's keys, values the int4 codec's, exactly; a
    batch's rows answer as each alone."""
    model, tok = tiny_model(), char_tokenizer()
    document = random_text(500, seed=4)
    plain = kvc.compress(model, tok, document, method=kvc.FullKV()).cache.layers[0].stored_prompt()
    split = kvc.compress(model, tok, document, method=kvc.FullKV(kv_bits=4, key_bits=8)).cache.layers[0]
    dim = plain.keys.shape[-1]
    int8, int4 = (make_codec(name, dim, torch.float32, rotated=True) for name in ("int8", "int4"))
    assert torch.equal(split.stored_prompt().keys, int8.restore(int8.encode(plain.keys)))
    assert torch.equal(split.stored_prompt().values, int4.restore(int4.encode(plain.values)))
    method = kvc.SnapKV(budget=64, kv_bits=4, key_bits=8)
    prompts = [random_text(n, seed=n) for n in LENGTHS]
    batch = kvc.generate(model, tok, prompts, method=method, max_new_tokens=6)
    for row, prompt in enumerate(prompts):
        assert batch.token_ids[row] == kvc.generate(model, tok, prompt, method=method, max_new_tokens=6).token_ids[0]


def test_codec_settings_are_refused_in_one_line_naming_the_value():
    with pytest.raises(kvc.InvalidParameterError, match=r"^SnapKV: kv_bits=5 is unknown; valid: 16, 8, 4$"):
        kvc.SnapKV(kv_bits=5)
    with pytest.raises(kvc.InvalidParameterError, match=r"kv_format='fp8' stores 8 bits, got kv_bits=4"):
        kvc.FullKV(kv_bits=4, kv_format="fp8")
    with pytest.raises(kvc.InvalidParameterError, match=r"SnapKV: kv_bits=4 cannot be served per request"):
        method_of({"method": "snapkv", "kv_bits": 4})
    with pytest.raises(
        kvc.InvalidParameterError,
        match=r"^SnapKV: key_bits=8 sets the keys' bits where kept tokens are stored in codes, and "
        r"kv_bits=16 keeps the model's precision; valid: kv_bits=8 or kv_bits=4 with key_bits=8$",
    ):
        kvc.SnapKV(key_bits=8)  # (issue 68.8: it had said "valid: key_bits >= kv_bits", with kv_bits at 16)
    with pytest.raises(kvc.InvalidParameterError, match=r"key_bits=4 with kv_bits=8"):
        kvc.SnapKV(kv_bits=8, key_bits=4)
    with pytest.raises(kvc.InvalidParameterError, match=r"key_bits=6 with kv_bits=8"):
        kvc.SnapKV(kv_bits=8, key_bits=6)
    with pytest.raises(kvc.InvalidParameterError, match=r"^SnapKV: key_bits=5 is unknown; valid: 8, 6, 4$"):
        kvc.SnapKV(kv_bits=4, key_bits=5)
    with pytest.raises(
        kvc.InvalidParameterError,
        match=r"^ShadowKV: key_bits=8 differs from kv_bits=4, which its "
        r"chunk store \(one codec for every stored row\) cannot hold",
    ):
        kvc.ShadowKV(kv_bits=4, key_bits=8)
    assert kvc.SnapKV(budget=64).describe() == kvc.SnapKV(budget=64, kv_bits=16).describe()  # quiet at its default
    assert "key_bits=8" in kvc.SnapKV(budget=64, kv_bits=4, key_bits=8).describe()
    assert "kv_bits=4" in kvc.SnapKV(budget=64, kv_bits=4).describe()


def test_each_layer_is_given_a_codec_object_turned_unless_its_steps_write_the_models_basis():
    """A sparse method's layers write gathered (or rebuilt) keys in the model's basis: codes of unturned rows; a
    prompt method's layers and every sliding-window layer write through their storage: turned rows."""
    model = family_model("gemma3")
    for method, own_turned in ((kvc.SnapKV(budget=64, kv_bits=4), True), (kvc.Quest(kv_bits=8), False)):
        cache = method.make_cache(model, char_tokenizer())
        turned = {layer.is_sliding: layer.kv_codec.keys.rotated for layer in cache.layers}
        assert turned == {True: True, False: own_turned}, method.describe()
    assert kvc.SnapKV(budget=64).storage_codec(16, torch.float32) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_every_model_family_decodes_a_coded_cache(family):
    """Sliding-window rings, soft-capping, partial rotary, learned sinks, no RoPE: each codes what it keeps."""
    model, tok = family_model(family), char_tokenizer()
    prompts = [random_text(300, seed=1), random_text(120, seed=2)]
    for coded in (kvc.SnapKV(budget=64, kv_bits=4), kvc.FullKV(kv_bits=8, kv_format="fp8")):
        plain = type(coded)(**{**coded.settings(), "kv_bits": 16, "kv_format": "int"})
        sizes = [
            kvc.generate(model, tok, prompts, method=m, max_new_tokens=4).stats["kv_bytes_kept"] for m in (coded, plain)
        ]
        assert sizes[0] < 0.3 * sizes[1]  # float32 tiny heads of 16 channels: 12 (int4) or 16 (fp8) of 64 bytes


def test_a_long_cache_is_coded_in_pieces_to_the_same_rows(monkeypatch):
    """Coding a cache longer than ``ENCODE_TOKENS`` piece by piece gives the rows of coding it at once: exactly
    where nothing is turned; turned, the turn's product may round a code at a half step the other way (BLAS sums in
    an order that depends on the shape), in a handful of bytes."""
    from kvcompress.storage import codec as codec_module

    keys, values = torch.randn(2, 3, 1000, 64), torch.randn(2, 3, 1000, 64)
    for name in ("int4", "int8+int4", "fp8"):
        for rotated in (False, True):
            kv_codec = codec_module.make_kv_codec(name, 64, torch.float32, rotated=rotated)
            whole = codec_module.encoded_pair(kv_codec, keys, values)
            monkeypatch.setattr(codec_module, "ENCODE_TOKENS", 96)
            pieces = codec_module.encoded_pair(kv_codec, keys, values)
            monkeypatch.undo()
            differ = sum(int((a != b).sum()) for a, b in zip(whole, pieces))
            assert differ == 0 if not rotated else differ < 1e-3 * whole[0].numel(), (name, rotated, differ)
