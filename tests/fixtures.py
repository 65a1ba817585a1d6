"""Tiny random-weight GQA models and a character tokenizer, built from code (no downloads)."""

from __future__ import annotations

import random

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from kvcompress.cache.kv_cache import cache_keyword

# The name of a model's cache argument in the installed transformers: ``cache`` from 5.24 on, where
# ``past_key_values`` is deprecated, and ``past_key_values`` before.
CACHE = cache_keyword(LlamaForCausalLM)
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIALS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt "
    "%}[assistant]{% endif %}"
)
ARCHITECTURES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


def char_tokenizer(bos: bool = True) -> PreTrainedTokenizerFast:
    """One token per character; BOS prepended to raw text (unless ``bos=False``); a simple chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer plus one merge, ``"\n\n"``, under GPT-2's pre-tokenization (a run of
    spaces leaves its last one to the word after it): ``"\n\n"`` ends a text as one token but splits
    in two before a word, as byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen) do."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS + ["\n\n"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "\n")], unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+(?!\S)|\s+| ?\w+|[^\s\w]+"), behavior="isolated")
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


# The model families users run, as tiny random-weight models: sliding windows (all layers, or
# alternating local/global), logit soft-capping, query/key norms, partial rotary, no RoPE at all,
# mixtures of experts, interleaved rotary (GLM-4, Cohere), layers without RoPE (SmolLM3), and
# learned attention sinks (gpt-oss).
FAMILIES = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "mistral-sliding": dict(model_type="mistral", sliding_window=16),
    "qwen2": dict(model_type="qwen2"),
    "qwen2-sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "qwen3": dict(model_type="qwen3"),
    "gemma2": dict(model_type="gemma2", sliding_window=16, query_pre_attn_scalar=16),
    "gemma3": dict(model_type="gemma3_text", sliding_window=16, query_pre_attn_scalar=16, sliding_window_pattern=2),
    "phi3-partial-rotary": dict(model_type="phi3", partial_rotary_factor=0.5),
    "gpt2-no-rope": dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=64, n_positions=1024),
    "qwen3-moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(model_type="granite"),
    "glm4": dict(model_type="glm4"),
    "smollm3": dict(model_type="smollm3"),
    "cohere": dict(model_type="cohere"),
    "gpt-oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
}


def family_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer random-weight model of ``family`` (see ``FAMILIES``; ``overrides``: config fields such as a wider
    ``head_dim``), in its default attention implementation."""
    settings = dict(FAMILIES[family])
    model_type = settings.pop("model_type")
    shared = dict(vocab_size=128, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model_type != "gpt2":
        shared.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
        )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **{**shared, **settings, **overrides})
    ).eval()


def fixed_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` with every weight drawn here in name order (norms around 1), not by transformers'
    initialisers: the same model under any transformers version (the saved-file fixtures need it)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            parameter.copy_(centre + 0.2 * torch.randn(parameter.shape, generator=generator))
    return model


def prefilled_cache(method, prompt_tokens: int, **model_overrides):
    """A tiny model's cache after prefilling ``prompt_tokens`` random tokens through ``method``."""
    model = tiny_model(**model_overrides)
    cache = method.make_cache(model, char_tokenizer())
    with torch.no_grad():
        model(torch.randint(3, 128, (1, prompt_tokens)), **{CACHE: cache})
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
