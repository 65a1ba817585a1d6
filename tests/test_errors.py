"""Bad input gets a clear error naming the parameter, the value and the valid range."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import kvcompress as kvc
from kvcompress.cli import main

from .fixtures import CACHE, char_tokenizer, random_text, tiny_model


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
        (lambda: kvc.ExpectedAttention(budget=4, sinks=4), r"ExpectedAttention: budget=4 must be greater than sinks=4"),
        (lambda: kvc.KVzip(chunk=0), r"KVzip: chunk=0 is invalid; it must be an integer >= 1"),
        (lambda: kvc.KVzip(clustering="pool"), r"KVzip: clustering='pool' is unknown; valid: spans, none"),
        (
            lambda: kvc.method_from_name("h2o2"),
            r"method='h2o2' is unknown; valid: full, snapkv, streamingllm, h2o, kvzip, expected, shadowkv, quest, loki",
        ),
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
    with pytest.raises(
        kvc.PromptTooLongError, match=rf"prompt 0 has {n_long} tokens, longer than the model's context of 128"
    ):
        kvc.generate(model, tok, long, method=kvc.SnapKV(budget=64, window=8))
    with pytest.raises(kvc.PromptTooLongError, match=rf"max_new_tokens=64 .* lower max_new_tokens to {128 - n_medium}"):
        kvc.generate(model, tok, medium, max_new_tokens=64)


def test_shadowkv_refuses_a_model_without_rotary_attention():
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        kvc.UnsupportedModelError,
        match=r"ShadowKV needs rotary position embeddings it can invert, and GPT2LMHeadModel: it has no single rotary",
    ):
        kvc.ShadowKV().make_cache(model)


def test_attention_outside_kvcompress_is_detected():
    model = tiny_model()
    cache = kvc.SnapKV(budget=40, window=8).make_cache(model, char_tokenizer())
    model.set_attn_implementation("eager")
    with pytest.raises(kvc.UnsupportedModelError, match=r"layer 0 was updated twice"):
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 60)), **{CACHE: cache})
            model(torch.randint(3, 128, (1, 1)), **{CACHE: cache})


def test_bad_max_new_tokens():
    with pytest.raises(kvc.InvalidParameterError, match=r"max_new_tokens=0 is invalid"):
        kvc.generate(tiny_model(), char_tokenizer(), "hello", max_new_tokens=0)


def test_bad_prompt_type():
    with pytest.raises(TypeError, match=r"prompt must be a string, a list of chat messages"):
        kvc.generate(tiny_model(), char_tokenizer(), 42)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "--method", "magic", "--prompt", "x"], "--method magic is unknown"),
        (
            ["generate", "--method", "snapkv", "--budget", "8", "--prompt", "x"],
            "--budget 8 must be greater than --window 32",
        ),
        (["generate", "--method", "snapkv", "--kernel", "6", "--prompt", "x"], "--kernel 6 is invalid"),
        (
            ["generate", "--method", "streamingllm", "--window", "8", "--prompt", "x"],
            "method 'streamingllm' does not take --window; it takes: --budget, --ratio, --heads, --head-floor, "
            "--layers, "
            "--layer-floor, --pyramid-beta, --decode-budget, --every, --decode-window, --kv-bytes, --sinks",
        ),
        (["generate", "--method", "snapkv"], "give exactly one of --prompt TEXT or --prompt-file FILE"),
        (
            ["generate", "--method", "shadowkv", "--budget", "4", "--prompt", "x"],
            "--budget 4 is smaller than one chunk (--chunk 8)",
        ),
        (["generate", "--method", "snapkv", "--rank", "8", "--prompt", "x"], "does not take --rank"),
    ],
)
def test_cli_reports_errors_without_traceback(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


@pytest.mark.parametrize(
    "make, expected",
    [
        (
            lambda: kvc.SnapKV(ratio=0.5, budget=100),
            r"SnapKV: give budget or ratio, not both \(got budget=100, ratio=0.5\)",
        ),
        (lambda: kvc.ShadowKV(ratio=0.5, budget=8), r"ShadowKV: give budget or ratio, not both"),
        (lambda: kvc.SnapKV(ratio=0.5, budget=-100), r"SnapKV: budget=-100 is invalid; it must be an integer >= 1"),
        (
            lambda: kvc.H2O(evict_during_decoding="no"),
            r"H2O: evict_during_decoding='no' is invalid; it must be True or False",
        ),
        (lambda: kvc.Quest(offload="yes"), r"Quest: offload='yes' is invalid; it must be True or False"),
        (
            lambda: kvc.H2O(budget="8"),
            r"H2O: budget='8' is invalid; it must be an integer >= 1 \(or None for the default\)",
        ),
        (lambda: kvc.SnapKV(window=None), r"SnapKV: window=None is invalid; give an integer >= 1"),
        (lambda: kvc.SnapKV(kernel=3.0), r"SnapKV: kernel=3.0 is invalid; it must be an integer >= 1"),
        (lambda: kvc.SnapKV(ratio=float("nan")), r"SnapKV: ratio=nan is invalid"),
        (lambda: kvc.Loki(calibration="/missing.pt"), r"Loki: calibration='/missing.pt' is not a file"),
    ],
)
def test_misuse_is_named(make, expected):
    with pytest.raises(kvc.InvalidParameterError, match=expected):
        make()


def test_budget_none_means_the_default():
    assert kvc.H2O(budget=None).budget_tokens == 1024 and kvc.ShadowKV().budget_tokens == 2048


def test_loki_calibration_of_the_wrong_shape(tmp_path):
    path = tmp_path / "components.pt"
    torch.save(torch.eye(16).expand(3, 2, 16, 16).clone(), path)
    with pytest.raises(
        kvc.InvalidParameterError, match=r"holds \(3, 2, 16, 16\); expected a tensor of shape \[2, 2, 16, 16\]"
    ):
        kvc.Loki(calibration=str(path)).make_cache(tiny_model())


def test_an_empty_prompt_is_refused():
    model = tiny_model()
    with pytest.raises(kvc.InvalidParameterError, match=r"prompt 0 is empty: it has no tokens"):
        kvc.generate(model, char_tokenizer(bos=False), "")
    with pytest.raises(kvc.CacheMisuseError, match=r"the input has no tokens \(an empty prompt\)"):
        with torch.no_grad():
            model(torch.zeros(1, 0, dtype=torch.long), **{CACHE: kvc.SnapKV().make_cache(model, char_tokenizer())})


def test_a_cache_refuses_a_second_prompt():
    model, tok = tiny_model(), char_tokenizer()
    cache = kvc.SnapKV(budget=40, window=8).make_cache(model, char_tokenizer())
    model.generate(**tok(random_text(100), return_tensors="pt"), **{CACHE: cache}, max_new_tokens=3)
    # transformers 5.17 passes the new prompt's mask (caught by its size), 5.23 does not (caught by the positions)
    with pytest.raises(
        kvc.CacheMisuseError, match=r"this cache already holds 103 tokens.*a new prompt needs a new cache"
    ):
        model.generate(**tok(random_text(60), return_tensors="pt"), **{CACHE: cache}, max_new_tokens=3)
    with pytest.raises(
        kvc.CacheMisuseError,
        match=r"this cache already holds 103 tokens, and generate\(\) feeds only tokens beyond them: a new prompt "
        r"needs a new cache",
    ):
        model.generate(**tok("ab", return_tensors="pt"), **{CACHE: cache}, max_new_tokens=3)
    other = tok(random_text(60), return_tensors="pt")
    with pytest.raises(
        kvc.CacheMisuseError,
        match=r"the attention mask must cover them plus the 61 new ones \(164 columns\) but it has 61.*a new prompt "
        r"needs a new cache",
    ):
        with torch.no_grad():
            model(**other, **{CACHE: cache})


@pytest.mark.parametrize("made_for, used_with", [(4, 2), (2, 4)])
def test_a_cache_refuses_another_model(made_for, used_with):
    cache = kvc.FullKV().make_cache(tiny_model(num_hidden_layers=made_for))
    model = tiny_model(num_hidden_layers=used_with)
    kvc.FullKV().make_cache(model)  # the model is set up for kvcompress, but this cache is not its own
    with pytest.raises(
        kvc.CacheMisuseError,
        match=rf"this cache was made for another model instance \({made_for} layers; this LlamaForCausalLM has "
        rf"{used_with}\)",
    ):
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 20)), **{CACHE: cache})


def test_a_cache_refuses_a_model_made_after_its_own_was_freed():
    """A cache whose model was freed refuses every later model: it knows its model by identity, not by id(), which
    CPython hands on to an object made where a freed one lay (a CI run once met that)."""
    made_for = tiny_model()
    cache = kvc.FullKV().make_cache(made_for)
    del made_for
    gc.collect()
    for _ in range(3):  # whichever address each new model takes
        model = tiny_model()
        kvc.FullKV().make_cache(model)
        with pytest.raises(kvc.CacheMisuseError, match=r"this cache was made for another model instance \(2 layers"):
            with torch.no_grad():
                model(torch.randint(3, 128, (1, 20)), **{CACHE: cache})


def test_generate_takes_a_method_or_its_name():
    model, tok = tiny_model(), char_tokenizer()
    by_name = kvc.generate(model, tok, random_text(100), method="streamingllm", max_new_tokens=4)
    assert (
        by_name.token_ids
        == kvc.generate(model, tok, random_text(100), method=kvc.StreamingLLM(), max_new_tokens=4).token_ids
    )
    with pytest.raises(kvc.InvalidParameterError, match=r"method=42 is invalid; give a kvcompress method"):
        kvc.generate(model, tok, "hello", method=42)
    with pytest.raises(kvc.InvalidParameterError, match=r"max_new_tokens=True is invalid"):
        kvc.generate(model, tok, "hello", max_new_tokens=True)


def test_cli_errors_name_files_flags_and_folders(tmp_path, capsys):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert main(["generate", "--prompt-file", str(binary)]) == 2
    assert f"--prompt-file {binary}: not UTF-8 text" in capsys.readouterr().err
    assert main(["generate", "--model", "/missing/dir", "--prompt", "x"]) == 2
    assert "--model /missing/dir: no such directory" in capsys.readouterr().err
    assert main(["generate", "--method", "snapkv", "--ratio", "0.5", "--budget", "-100", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "SnapKV: --budget -100 is invalid; it must be an integer >= 1 (or leave it out for the default)" in err
    assert main(["generate", "--method", "shadowkv", "--ratio", "0.5", "--budget", "300", "--prompt", "x"]) == 2
    assert "ShadowKV: give --budget or --ratio, not both (got --budget 300, --ratio 0.5)" in capsys.readouterr().err


def test_ctrl_c_in_a_long_command_says_where_results_are(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvcompress.cli.library.run_accuracy", interrupted)
    monkeypatch.setattr("kvcompress.cli.library.load_model", lambda *a, **k: (tiny_model(), char_tokenizer()))
    assert main(["bench", "accuracy", "--out", str(tmp_path / "acc")]) == 130
    err = capsys.readouterr().err
    assert err == (
        f"kvcompress: interrupted; results so far are in {tmp_path / 'acc'} and rerunning the same command resumes\n"
    )


def test_a_refusal_holds_its_setting_value_and_range_as_data():
    """A library refusal carries what it refuses (the setting, its value, the valid values) as fields, and the command
    line spells it from those fields, never from the message's text: flags with values, a remedy's setting, a switch
    turned off, a setting left to its default; a setting the command has no flag for keeps the library's words."""
    import pickle

    from kvcompress.cli import in_flag_words

    with pytest.raises(kvc.InvalidParameterError) as refused:
        kvc.SnapKV(budget=0)
    error = refused.value
    assert error.settings == {"budget": 0} and error.values["valid"] == "an integer >= 1"
    assert str(error) == "SnapKV: budget=0 is invalid; it must be an integer >= 1 (or None for the default)"
    assert in_flag_words(error, ["budget"]) == (
        "SnapKV: --budget 0 is invalid; it must be an integer >= 1 (or leave it out for the default)"
    )
    assert in_flag_words(error, []).startswith("SnapKV: budget=0 is invalid")  # no such flag: the library's words
    again = pickle.loads(pickle.dumps(error))  # (a vLLM worker's refusal reaches the engine so)
    assert type(again) is type(error) and str(again) == str(error) and again.settings == error.settings

    with pytest.raises(kvc.InvalidParameterError) as refused:
        kvc.SnapKV(budget=256, kv_format="fp8", kv_bits=4)
    assert refused.value.settings == {"kv_format": "fp8", "kv_bits": 4}
    assert in_flag_words(refused.value, ["kv_format", "kv_bits"]) == (
        "SnapKV: --kv-format fp8 stores 8 bits, got --kv-bits 4; valid: --kv-bits 8 with --kv-format fp8, or "
        "--kv-format int"
    )
    switch = kvc.InvalidParameterError("{owner}: {offload=} or {question_window=}", owner="X", offload=True,
                                       question_window=False)  # fmt: skip
    assert str(switch) == "X: offload=True or question_window=False"
    assert in_flag_words(switch, ["offload", "question_window"]) == "X: --offload or --no-question-window"
    bound = kvc.InvalidParameterError("{decode_budget=} has no {budget!n}", decode_budget=None)
    assert in_flag_words(bound, ["decode_budget", "budget"]) == "no --decode-budget has no --budget"
    plain = kvc.CacheMisuseError("kvcompress: {not a field} stays as written")  # no values: plain text
    assert (
        str(plain) == "kvcompress: " + in_flag_words(plain, ["field"]) == "kvcompress: {not a field} stays as written"
    )
