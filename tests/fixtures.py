"""Tiny random-weight GQA models and a character tokenizer, built from code (no downloads)."""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIALS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
ARCHITECTURES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; BOS prepended to raw text; a simple chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer GQA model (4 query heads, 2 KV heads, head_dim 16) with random weights."""
    params = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "mistral":
        params["sliding_window"] = None
    params.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ARCHITECTURES[arch](**params), attn_implementation="sdpa")
    return model.eval()


def prefilled_cache(method, prompt_tokens: int, **model_overrides):
    """A tiny model's cache after prefilling ``prompt_tokens`` random tokens through ``method``."""
    model = tiny_model(**model_overrides)
    cache = method.make_cache(model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, prompt_tokens)), past_key_values=cache)
    return cache


def random_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic lowercase words."""
    rng = random.Random(seed)
    words, size = [], 0
    while size < n_chars:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n_chars]
