"""Compress once, ask many: a context compressed without its question, saved, loaded into the same
model and asked, gives the tokens the same question gives in the process that compressed it."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvcompress as kvc
from kvcompress.cli import main

from .fixtures import FAMILIES, char_tokenizer, family_model, random_text, tiny_model
from .test_batches import METHODS


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.label())
def test_a_saved_cache_answers_as_the_one_in_memory(method, tmp_path):
    model, tok = tiny_model(), char_tokenizer()
    documents = [random_text(400, seed=1), random_text(150, seed=2)]
    asked = kvc.generate(model, tok, documents, question="what is first?", method=method, max_new_tokens=8)
    compressed = kvc.compress(model, tok, documents, method=method)
    compressed.save(tmp_path / "doc.kvc")
    here = kvc.generate(model, tok, "what is first?", past=compressed, max_new_tokens=8)
    assert here.token_ids == asked.token_ids  # compress + ask = compress without the question, then append it
    loaded = kvc.load(tmp_path / "doc.kvc", model, tok)
    again = kvc.generate(model, tok, "what is first?", past=loaded, max_new_tokens=8)
    assert again.token_ids == here.token_ids
    later = kvc.generate(model, tok, "and then?", past=again, max_new_tokens=6)
    assert later.token_ids == kvc.generate(model, tok, "and then?", past=here, max_new_tokens=6).token_ids
    for saved, kept in zip(loaded.cache.layers, compressed.cache.layers):
        if not getattr(method, "evict_during_decoding", False):
            assert torch.equal(saved.kept_positions(), kept.kept_positions())


def test_a_chat_context_and_a_compiled_answer(tmp_path):
    model, tok = tiny_model(), char_tokenizer()
    chat = [{"role": "user", "content": random_text(300, seed=3)}]
    asked = kvc.generate(model, tok, chat, question="which word?", method=kvc.SnapKV(budget=64), max_new_tokens=8)
    kvc.compress(model, tok, chat, method=kvc.SnapKV(budget=64)).save(tmp_path / "chat.kvc")
    loaded = kvc.load(tmp_path / "chat.kvc", model, tok)
    answer = kvc.generate(
        model, tok, "which word?", past=loaded, max_new_tokens=8, compile=kvc.Compile(backend="eager")
    )
    assert answer.token_ids == asked.token_ids and answer.rows[0].messages == asked.rows[0].messages


@pytest.mark.parametrize(
    "method", [kvc.FullKV(), kvc.SnapKV(budget=256), kvc.ShadowKV(budget=64)], ids=lambda m: m.name
)
def test_the_file_holds_what_the_cache_holds(method, tmp_path):
    """Within 5% of the bytes the cache reports (on the device, plus ShadowKV's offloaded store)."""
    model, tok = (
        tiny_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64),
        char_tokenizer(),
    )
    result = kvc.compress(model, tok, random_text(1000, seed=4), method=method)
    result.save(tmp_path / "doc.kvc")
    reported = result.stats["device_bytes"] + result.stats["offloaded_bytes"]
    assert abs(os.path.getsize(tmp_path / "doc.kvc") / reported - 1) <= 0.05


def test_files_that_cannot_be_loaded_are_refused_by_name(tmp_path):
    model, tok = tiny_model(), char_tokenizer()
    path = tmp_path / "doc.kvc"
    kvc.compress(model, tok, random_text(200, seed=5), method=kvc.SnapKV(budget=64)).save(path)
    with pytest.raises(
        kvc.CacheFileError, match=r"was saved from another model .* load it into the model it was made with"
    ):
        kvc.load(path, tiny_model(seed=1), tok)
    named = tiny_model()
    named.config._name_or_path = "/models/tiny-a"  # (as a model loaded from a folder says where)
    kvc.compress(named, tok, random_text(200, seed=5), method=kvc.SnapKV(budget=64)).save(tmp_path / "named.kvc")
    refusal = (
        r"^\S+named.kvc was saved from another model \(LlamaForCausalLM from /models/tiny-a\) \(fingerprint "
        r"\w+, this LlamaForCausalLM: \w+\); load"
    )
    with pytest.raises(kvc.CacheFileError, match=refusal):
        kvc.load(tmp_path / "named.kvc", tiny_model(seed=1), tok)
    with safe_open(str(path), framework="pt") as file:
        tensors, meta = (
            {key: file.get_tensor(key) for key in file.keys()},
            json.loads(file.metadata()["kvcompress-cache"]),
        )
    for change, message in (
        (
            {"version": 1, "written_by": "kvcompress 0.0.9"},
            r"other.kvc is in kvcompress cache format version 1 \(written by kvcompress 0.0.9\); this kvcompress \S+ "
            r"reads "
            r"versions 2, 3 and 4: compress the document again with this version",
        ),
        ({"format": "other"}, r"other.kvc is not a kvcompress cache file \(its format is 'other'\)"),
        ({"method": {"name": "nosuch", "fields": {}}}, r"was made with method 'nosuch', which is not registered here"),
    ):
        save_file(tensors, str(tmp_path / "other.kvc"), metadata={"kvcompress-cache": json.dumps({**meta, **change})})
        with pytest.raises(kvc.CacheFileError, match=message):
            kvc.load(tmp_path / "other.kvc", model, tok)
    data = path.read_bytes()
    (tmp_path / "cut.kvc").write_bytes(data[: len(data) // 2])
    with pytest.raises(kvc.CacheFileError, match=r"cut.kvc is not a whole kvcompress cache file"):
        kvc.load(tmp_path / "cut.kvc", model, tok)


@pytest.mark.parametrize("spec", ["snapkv:budget=64", "full:kv_bits=4"])
def test_bytes_changed_inside_a_files_tensors_are_refused_by_its_checksum(spec, tmp_path):
    """As a new user damaged one: bytes flipped after the header (in the tensors) used to load and answer garbage."""
    model, tok = tiny_model(), char_tokenizer()
    path = tmp_path / "doc.kvc"
    kvc.compress(model, tok, random_text(400, seed=5), method=kvc.method_from_spec(spec)).save(path)
    data = bytearray(path.read_bytes())
    body = 8 + int.from_bytes(data[:8], "little")  # safetensors: the header's length, the header, then the tensors
    flips = min(20_000, (len(data) - body) // 2)
    for offset in range(body, body + 2 * flips, 2):
        data[offset] ^= 0x5A
    (tmp_path / "flipped.kvc").write_bytes(bytes(data))
    with pytest.raises(kvc.CacheFileError, match=r"^\S*flipped.kvc is damaged: its tensors do not match the checksum"):
        kvc.load(tmp_path / "flipped.kvc", model, tok)
    assert kvc.load(path, model, tok).cache.method == kvc.method_from_spec(spec)  # the whole file still loads


def test_compress_then_ask_on_the_command_line(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_model(max_position_embeddings=2048).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (tmp_path / "doc.txt").write_text(random_text(300, seed=6))
    assert (
        main(
            [
                "compress",
                "--model",
                str(folder),
                "--prompt-file",
                str(tmp_path / "doc.txt"),
                "--raw",
                "--method",
                "snapkv",
                "--budget",
                "64",
                "--out",
                str(tmp_path / "doc.kvc"),
            ]
        )
        == 0
    )
    assert "ask with: kvcompress generate --past" in capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                "--model",
                str(folder),
                "--past",
                str(tmp_path / "doc.kvc"),
                "--prompt",
                "first word?",
                "--max-new-tokens",
                "5",
                "--json",
            ]
        )
        == 0
    )
    answer = json.loads(capsys.readouterr().out)
    assert answer["method"].startswith("snapkv(budget=64") and answer["new_tokens"] == 5
    assert main(["generate", "--model", str(folder), "--past", str(tmp_path / "missing.kvc"), "--prompt", "x"]) == 2


@functools.lru_cache(maxsize=1)
def family_fingerprints() -> dict[str, str]:
    from kvcompress.io.saved import model_fingerprint

    return {family: model_fingerprint(family_model(family)) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_saved_context_of_every_family_loads_and_answers_alike(family, tmp_path):
    """Each family's compressed context, saved and loaded, answers as the live one; its fingerprint is its own."""
    from kvcompress.io.saved import model_fingerprint

    model, tok = family_model(family), char_tokenizer()
    method = kvc.KVzip(budget=40, layers="uniform")  # a thinned context on every family (learned sinks included)
    context = kvc.compress(model, tok, [{"role": "user", "content": random_text(200, seed=5)}], method=method)
    context.save(tmp_path / "doc.kvc")
    expected = kvc.generate(model, tok, "which word?", past=context.copy(), max_new_tokens=5).token_ids
    assert (
        kvc.generate(
            model, tok, "which word?", past=kvc.load(tmp_path / "doc.kvc", model, tok), max_new_tokens=5
        ).token_ids
        == expected
    )
    assert model_fingerprint(model) not in [value for other, value in family_fingerprints().items() if other != family]
