"""Bad input gets a clear error naming the parameter, the value and the valid range."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import kvcompress as kvc
from kvcompress.cli import main

from .fixtures import char_tokenizer, random_text, tiny_model


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: kvc.SnapKV(budget=32, window=32), r"budget=32 must be greater than window=32"),
        (lambda: kvc.SnapKV(budget=16, window=32), r"budget=16 must be greater than window=32"),
        (lambda: kvc.SnapKV(budget=0), r"budget=0 is invalid; it must be an integer >= 1"),
        (lambda: kvc.SnapKV(kernel=4), r"kernel=4 is invalid; it must be a positive odd integer"),
        (lambda: kvc.SnapKV(kernel=0), r"kernel=0 is invalid"),
        (lambda: kvc.SnapKV(kernel=-3), r"kernel=-3 is invalid"),
        (lambda: kvc.SnapKV(pooling="median"), r"pooling='median' is unknown; valid: max, avg"),
        (lambda: kvc.SnapKV(ratio=0.0), r"ratio=0.0 is outside the valid range \(0, 1\]"),
        (lambda: kvc.SnapKV(ratio=1.5), r"ratio=1.5 is outside the valid range \(0, 1\]"),
        (lambda: kvc.SnapKV(window=0), r"window=0 is invalid"),
        (lambda: kvc.StreamingLLM(budget=4, sinks=4), r"budget=4 must be greater than sinks=4"),
        (lambda: kvc.StreamingLLM(sinks=-1), r"sinks=-1 is invalid"),
        (lambda: kvc.method_from_name("h2o2"), r"method='h2o2' is unknown; valid: full, snapkv, streamingllm, h2o, shadowkv, quest, loki"),
        (lambda: kvc.method_from_name("full", budget=3), r"method 'full' does not take budget"),
    ],
)
def test_bad_parameters(make, expected):
    with pytest.raises(kvc.InvalidParameterError, match=expected):
        make()


def test_prompt_longer_than_the_context_is_refused_not_truncated():
    model, tok = tiny_model(max_position_embeddings=128), char_tokenizer()
    long, medium = random_text(200), random_text(100)
    n_long, n_medium = len(tok(long)["input_ids"]), len(tok(medium)["input_ids"])
    with pytest.raises(kvc.PromptTooLongError, match=rf"prompt 0 has {n_long} tokens, longer than the model's context of 128"):
        kvc.generate(model, tok, long, method=kvc.SnapKV(budget=64, window=8))
    with pytest.raises(kvc.PromptTooLongError, match=rf"max_new_tokens=64 .* lower max_new_tokens to {128 - n_medium}"):
        kvc.generate(model, tok, medium, max_new_tokens=64)


def test_shadowkv_refuses_a_model_without_rotary_attention():
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(kvc.UnsupportedModelError, match=r"ShadowKV needs rotary position embeddings it can invert, and GPT2LMHeadModel: it has no single rotary"):
        kvc.ShadowKV().make_cache(model)


def test_attention_outside_kvcompress_is_detected():
    model = tiny_model()
    cache = kvc.SnapKV(budget=40, window=8).make_cache(model)
    model.set_attn_implementation("eager")
    with pytest.raises(kvc.UnsupportedModelError, match=r"layer 0 was updated twice"):
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 60)), past_key_values=cache)
            model(torch.randint(3, 128, (1, 1)), past_key_values=cache)


def test_bad_max_new_tokens():
    with pytest.raises(kvc.InvalidParameterError, match=r"max_new_tokens=0 is invalid"):
        kvc.generate(tiny_model(), char_tokenizer(), "hello", max_new_tokens=0)


def test_bad_prompt_type():
    with pytest.raises(TypeError, match=r"prompt must be a string, a list of chat messages"):
        kvc.generate(tiny_model(), char_tokenizer(), 42)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "--method", "magic", "--prompt", "x"], "method='magic' is unknown"),
        (["generate", "--method", "snapkv", "--budget", "8", "--prompt", "x"], "budget=8 must be greater than window=32"),
        (["generate", "--method", "snapkv", "--kernel", "6", "--prompt", "x"], "kernel=6 is invalid"),
        (["generate", "--method", "streamingllm", "--window", "8", "--prompt", "x"], "method 'streamingllm' does not take --window; it takes: --budget, --ratio, --sinks"),
        (["generate", "--method", "snapkv"], "give exactly one of --prompt TEXT or --prompt-file FILE"),
        (["generate", "--method", "shadowkv", "--budget", "4", "--prompt", "x"], "budget=4 is smaller than one chunk"),
        (["generate", "--method", "snapkv", "--rank", "8", "--prompt", "x"], "does not take --rank"),
    ],
)
def test_cli_reports_errors_without_traceback(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
