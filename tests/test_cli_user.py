"""A user's first hour (issue 28): every command right or refused in one line, nothing overwritten,
nothing misleading. Commands run as subprocesses where the process matters (exit status, signals,
file modes), in-process through ``cli.main`` elsewhere (same code, no start-up cost)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

import kvcompress as kvc
from kvcompress.cli import main
from kvcompress.integrations.transformers.models import default_model_dir

from .fixtures import bpe_tokenizer, random_text, tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny model saved as a user's model folder, with a byte-level-BPE-like tokenizer."""
    path = tmp_path_factory.mktemp("model")
    tiny_model(max_position_embeddings=2048).save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


@pytest.fixture()
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(random_text(300, seed=3) + ".\n")
    return path


def cli(*args: str, cwd=None, umask: int | None = None) -> subprocess.CompletedProcess:
    """``kvcompress ARGS`` in a new process (as the console script runs it)."""
    return subprocess.run(
        [sys.executable, "-m", "kvcompress", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        preexec_fn=None if umask is None else lambda: os.umask(umask),
    )


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_outputs_are_never_clobbered(folder, doc, tmp_path):
    before = doc.read_bytes()
    refused = cli("compress", "--model", folder, "--prompt-file", doc, "--budget", "16", "--out", doc)
    assert refused.returncode == 2 and doc.read_bytes() == before
    assert (
        one_line(refused.stderr)
        == f"kvcompress: error: --out {doc} is the input file (--prompt-file); write to another file"
    )

    out = tmp_path / "doc.kvc"
    made = cli("compress", "--model", folder, "--prompt-file", doc, "--budget", "16", "--out", out, umask=0o027)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # a new file's mode, from the umask
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial file left

    again = cli("compress", "--model", folder, "--prompt-file", doc, "--budget", "16", "--out", out)
    assert again.returncode == 2
    assert one_line(again.stderr) == f"kvcompress: error: --out {out} exists; add --force to replace it"


def test_force_replaces_and_the_folder_is_checked_before_any_work(folder, doc, tmp_path, capsys, monkeypatch):
    out = tmp_path / "doc.kvc"
    out.write_text("an older file")
    assert (
        run(capsys, "compress", "--model", folder, "--prompt-file", doc, "--budget", "16", "--out", out, "--force")[0]
        == 0
    )
    assert kvc.load(out, *kvc.load_model(str(folder))).cache.method.name == "kvzip"

    monkeypatch.setattr(
        "kvcompress.cli.library.load_model",
        lambda *a, **k: pytest.fail("the model was loaded before the output was checked"),
    )
    code, _, err = run(capsys, "compress", "--prompt-file", doc, "--out", tmp_path / "nodir" / "sub" / "x.kvc")
    assert code == 2 and one_line(err) == (
        f"kvcompress: error: --out {tmp_path / 'nodir' / 'sub' / 'x.kvc'}: the folder {tmp_path / 'nodir' / 'sub'} "
        "does not exist"
    )
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--save", tmp_path)
    assert code == 2 and one_line(err) == f"kvcompress: error: --save {tmp_path} is a folder; give a file name"


def test_saving_into_a_missing_folder_is_refused_by_the_library(folder):
    model, tok = kvc.load_model(str(folder))
    context = kvc.compress(model, tok, random_text(100), method=kvc.KVzip(budget=16))
    with pytest.raises(FileNotFoundError, match=r"cannot save to nodir/x.kvc: the folder nodir does not exist"):
        context.save("nodir/x.kvc")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--raw", "--prompt", ""], "--prompt is empty; give the text to compress"),
        (["--prompt", "  \n"], "--prompt is empty; give the text to compress"),
    ],
)
def test_empty_prompts_are_refused(folder, tmp_path, capsys, flags, message):
    code, _, err = run(capsys, "compress", "--model", folder, *flags, "--out", tmp_path / "a.kvc")
    assert code == 2 and one_line(err) == f"kvcompress: error: {message}"
    assert not (tmp_path / "a.kvc").exists()


def test_empty_prompts_are_refused_by_the_library(folder):
    model, tok = kvc.load_model(str(folder))
    for prompt in ("", [{"role": "user", "content": ""}], ["some text", " "]):
        with pytest.raises(kvc.InvalidParameterError, match=r"prompt \d is empty: it has no tokens of its own"):
            kvc.compress(model, tok, prompt, method=kvc.KVzip(budget=16))
        with pytest.raises(kvc.InvalidParameterError, match=r"prompt \d is empty"):
            kvc.generate(model, tok, prompt, method=kvc.SnapKV(budget=64, window=8))


def test_an_interrupt_says_only_what_is_true(folder, doc, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvcompress.cli.library.compress", interrupted)
    code, _, err = run(capsys, "compress", "--model", folder, "--prompt-file", doc, "--out", tmp_path / "fresh.kvc")
    assert code == 130 and err == f"kvcompress: interrupted; nothing was written to {tmp_path / 'fresh.kvc'}\n"
    (tmp_path / "old.kvc").write_text("kept")
    code, _, err = run(
        capsys, "compress", "--model", folder, "--prompt-file", doc, "--out", tmp_path / "old.kvc", "--force"
    )
    assert code == 130 and err == f"kvcompress: interrupted; {tmp_path / 'old.kvc'} is unchanged\n"
    assert (tmp_path / "old.kvc").read_text() == "kept"


def test_an_interrupt_while_starting_is_one_line(doc, tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcompress", "compress", "--prompt-file", str(doc), "--out", str(tmp_path / "x.kvc")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # the imports (torch, transformers) take seconds
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err == "kvcompress: interrupted while starting; nothing was done\n"


def test_method_flags_follow_the_chosen_method(folder, doc, tmp_path, capsys):
    code, _, err = run(
        capsys,
        "compress",
        "--model",
        folder,
        "--prompt-file",
        doc,
        "--method",
        "kvzip",
        "--clustering",
        "none",
        "--budget",
        "16",
        "--out",
        tmp_path / "a.kvc",
    )
    assert code == 0, err
    assert kvc.load(tmp_path / "a.kvc", *kvc.load_model(str(folder))).cache.method.clustering == "none"
    with pytest.raises(SystemExit) as exit:
        main(
            [
                "compress",
                "--prompt-file",
                str(doc),
                "--method",
                "kvzip",
                "--clustering",
                "pool",
                "--out",
                str(tmp_path / "b.kvc"),
            ]
        )
    err = capsys.readouterr().err
    assert exit.value.code == 2 and one_line(err) == (
        "kvcompress compress: error: argument --clustering: invalid choice: 'pool' (choose from 'spans', 'none') (see "
        "kvcompress compress --help)"
    )
    code, _, err = run(capsys, "generate", "--method", "shadowkv", "--window", "3", "--prompt", "x")
    assert code == 2 and one_line(err) == (
        "kvcompress: error: method 'shadowkv' does not take --window; it takes: --budget, --ratio, --chunk, --rank, "
        "--rank-error, --outliers, --local-chunks, --kv-bits, --kv-format, --key-bits"
    )


def test_a_byte_budget_is_a_fraction_on_the_command_line(folder, doc, tmp_path, capsys):
    code, _, err = run(
        capsys,
        "compress",
        "--model",
        folder,
        "--prompt-file",
        doc,
        "--method",
        "snapkv",
        "--window",
        "8",
        "--kv-bytes",
        "1/8",
        "--out",
        tmp_path / "a.kvc",
    )
    assert code == 0, err
    loaded = kvc.load(tmp_path / "a.kvc", *kvc.load_model(str(folder)))
    assert loaded.cache.method.kv_bytes == 0.125 and loaded.stats["kv_bytes_share"] <= 0.125
    with pytest.raises(SystemExit) as exit:  # (argparse's own refusal)
        main(["compress", "--prompt-file", str(doc), "--kv-bytes", "1/0", "--out", str(tmp_path / "b.kvc")])
    assert exit.value.code == 2 and one_line(capsys.readouterr().err) == (
        "kvcompress compress: error: argument --kv-bytes: invalid number value: '1/0' (see kvcompress compress --help)"
    )
    code, _, err = run(
        capsys, "compress", "--model", folder, "--prompt-file", doc, "--kv-bytes", "3/2", "--out", tmp_path / "b.kvc"
    )
    assert code == 2 and one_line(err) == "kvcompress: error: KVzip: --kv-bytes 1.5 is outside the valid range (0, 1]"
    assert not (tmp_path / "b.kvc").exists()


def test_help_shows_the_chosen_methods_flags_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--method", "kvzip", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "settings of --method kvzip" in text and "--clustering {spans,none}" in text
    assert "(default: 2000)" in text and "--window" not in text  # KVzip's chunk; SnapKV's window is not KVzip's
    assert "--max-new-tokens MAX_NEW_TOKENS tokens to generate at most (default: 64)" in text
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "settings of --method snapkv (the default method" in text
    assert "--pooling {max,avg}" in text and "(default: 1024)" in text


def test_methods_lists_every_method_with_its_fields(capsys):
    code, out, _ = run(capsys, "methods")
    assert code == 0
    for name in kvc.METHODS:
        assert f"{name}: " in out
    for row in ("--budget", "--clustering", "one of spans, none", "--rank-error", "a number in (0, 1]", "--page-size"):
        assert row in out


def test_past_keeps_its_method_and_honours_question(folder, doc, tmp_path, capsys):
    saved = tmp_path / "doc.kvc"
    assert run(capsys, "compress", "--model", folder, "--prompt-file", doc, "--budget", "16", "--out", saved)[0] == 0
    code, _, err = run(capsys, "generate", "--model", folder, "--past", saved, "--prompt", "q", "--budget", "64")
    assert code == 2 and one_line(err).startswith(f"kvcompress: error: {saved} was compressed with kvzip(budget=16")
    assert "--budget 64 would not apply" in err and "name --method to compress each question" in err
    code, _, err = run(
        capsys, "generate", "--model", folder, "--past", saved, "--prompt", "q", "--method", "snapkv", "--budget", "64"
    )
    assert code == 2 and one_line(err).startswith("kvcompress: error: this context was compressed with kvzip(budget=16")
    # a thinned packed context cannot take a question's prefill
    assert "store the document with `kvcompress compress --method full`" in err and "kvc." not in err
    code, _, err = run(capsys, "generate", "--model", folder, "--past", saved, "--prompt", "q", "--question", "q2")
    assert code == 2 and "give the question once" in one_line(err)
    code, out, _ = run(
        capsys,
        "generate",
        "--model",
        folder,
        "--past",
        saved,
        "--question",
        "which word?",
        "--max-new-tokens",
        "4",
        "--json",
    )
    asked = json.loads(out)
    model, tok = kvc.load_model(str(folder))
    expected = kvc.generate(
        model,
        tok,
        [{"role": "user", "content": doc.read_text()}],
        question="which word?",
        method=kvc.KVzip(budget=16),
        max_new_tokens=4,
    )
    assert asked["text"] == expected.text
    assert (
        run(
            capsys,
            "generate",
            "--model",
            folder,
            "--past",
            saved,
            "--prompt",
            "q",
            "--method",
            "kvzip",
            "--budget",
            "16",
            "--max-new-tokens",
            "2",
        )[0]
        == 0
    )  # the file's own settings agree


def test_a_context_continued_twice_names_copy(folder):
    model, tok = kvc.load_model(str(folder))
    context = kvc.compress(model, tok, [{"role": "user", "content": random_text(200)}], method=kvc.KVzip(budget=16))
    kvc.generate(model, tok, "first?", past=context, max_new_tokens=2)
    with pytest.raises(
        kvc.CacheMisuseError, match=r"already continued by another generate\(past=...\) call.*past=context.copy\(\)"
    ):
        kvc.generate(model, tok, "second?", past=context, max_new_tokens=2)


def test_bench_accuracy_names_only_the_files_it_wrote(folder, tmp_path, capsys):
    out = tmp_path / "acc"
    code, text, _ = run(
        capsys,
        "bench",
        "accuracy",
        "--model",
        folder,
        "--tasks",
        "fact",
        "--methods",
        "full",
        "--lengths",
        "200",
        "--samples",
        "1",
        "--out",
        out,
    )
    wrote = " ".join(text.split()).split(f"wrote {out}/")[1].split(", ")
    assert code == 0 and "niah_heatmaps.png" not in wrote
    assert all((out / name.strip()).exists() for name in wrote)


def test_compress_s_travels_with_the_context(folder, tmp_path):
    model, tok = kvc.load_model(str(folder))
    context = kvc.compress(model, tok, [{"role": "user", "content": random_text(300)}], method=kvc.KVzip(budget=16))
    context.cache.observe_s += 20.0  # as if the pass had taken 20 s: the figure must not be lost or re-measured
    spent = context.stats["compress_s"] + 20.0
    context.save(tmp_path / "c.kvc")
    for past in (context.copy(), kvc.load(tmp_path / "c.kvc", model, tok)):
        assert kvc.generate(model, tok, "q?", past=past, max_new_tokens=2).stats["compress_s"] == pytest.approx(spent)


def test_file_errors_are_one_line_without_a_doubled_prefix(folder, tmp_path, capsys):
    cut = tmp_path / "trunc.kvc"
    cut.write_bytes(b"\x10\x00\x00")
    code, _, err = run(capsys, "generate", "--model", folder, "--past", cut, "--prompt", "q")
    assert code == 2 and one_line(err).startswith(f"kvcompress: error: {cut} is not a whole kvcompress cache file")
    code, _, err = run(capsys, "generate", "--model", folder, "--past", tmp_path / "missing.kvc", "--prompt", "q")
    assert code == 2 and one_line(err) == f"kvcompress: error: {tmp_path / 'missing.kvc'}: no such file"


def test_a_preset_name_is_refused_at_once(capsys):
    code, _, err = run(capsys, "generate", "--model", "smollm2-135m", "--prompt", "hi")
    assert code == 2 and one_line(err).startswith(
        "kvcompress: error: --model smollm2-135m is a random-weight architecture preset"
    )


@pytest.mark.parametrize(
    "method",
    [kvc.Loki(budget=64), kvc.Quest(budget=64), kvc.FullKV(), kvc.ShadowKV(budget=64, chunk=8)],
    ids=lambda m: m.name,
)
def test_kept_counts_tokens_not_room(folder, method):
    model, tok = kvc.load_model(str(folder))
    stats = kvc.generate(model, tok, random_text(700), method=method, max_new_tokens=8).stats
    assert stats["kv_kept_fraction"] <= 1.0
    assert stats["device_bytes"] == stats["kv_bytes_kept"] + stats["spare_bytes"] + stats["index_bytes"]
    if method.name in ("full", "loki", "quest"):  # every token is held on the device, once
        assert stats["kv_kept_fraction"] == 1.0


@pytest.mark.real_model
def test_the_readme_walk(tmp_path):
    """The README's commands, in order, as a new user types them (the embedded model)."""
    if not (default_model_dir() / "model.safetensors").exists():
        pytest.skip("embedded model not fetched (run `make model`)")
    (tmp_path / "doc.txt").write_text(
        "The archive keeps old maps. The vault code for the east wing is 4817. The garden has roses.\n"
    )
    made = cli("compress", "--prompt-file", "doc.txt", "--budget", "64", "--out", "doc.kvc", cwd=tmp_path)
    assert made.returncode == 0 and "ask with: kvcompress generate --past doc.kvc --prompt QUESTION" in made.stdout
    asked = cli(
        "generate",
        "--past",
        "doc.kvc",
        "--prompt",
        "What is the vault code for the east wing?",
        "--max-new-tokens",
        "24",
        "--json",
        cwd=tmp_path,
    )
    assert asked.returncode == 0 and "4817" in json.loads(asked.stdout)["text"]
    direct = cli(
        "generate",
        "--method",
        "snapkv",
        "--budget",
        "64",
        "--prompt-file",
        "doc.txt",
        "--question",
        "What is the vault code for the east wing?",
        "--max-new-tokens",
        "24",
        "--json",
        cwd=tmp_path,
    )
    assert direct.returncode == 0 and json.loads(direct.stdout)["method"].startswith("snapkv(budget=64")


def test_a_choice_named_none_is_that_choice_in_a_method_spec():
    """`kvzip:clustering=none` (bench specs) is KVzip's per-token choice, not Python's None; a field
    whose choices lack it still takes `none` as its default rule."""
    assert kvc.method_from_spec("kvzip:layers=global:clustering=none").clustering == "none"
    assert kvc.method_from_spec("expected:clustering=none").clustering == "none"
    assert kvc.method_from_spec("h2o:recent=none").recent is None


def test_version_names_the_package_and_what_it_runs_on():
    done = subprocess.run([sys.executable, "-m", "kvcompress", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert re.fullmatch(r"kvcompress \S+ \(torch \S+, transformers \S+\)\n", done.stdout), done.stdout


def test_a_range_against_another_setting_names_both_flags():
    from kvcompress.cli import in_flag_words
    from kvcompress.methods import field_specs

    with pytest.raises(ValueError) as refused:
        kvc.SnapKV(budget=256, kv_bits=8, key_bits=4)
    words = in_flag_words(refused.value, [spec.name for spec in field_specs(kvc.SnapKV)])  # generate's options
    assert words.endswith("valid: --key-bits >= --kv-bits (8, 6 or 4) with --kv-format int"), words


def test_a_method_setting_is_refused_in_the_flags_words_and_its_description_kept():
    err = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcompress",
            "generate",
            "--method",
            "snapkv",
            "--budget",
            "16",
            "--window",
            "32",
            "--prompt",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    ).stderr
    assert err == (
        "kvcompress: error: SnapKV: --budget 16 must be greater than --window 32 (--budget counts the "
        "observation window; valid: --budget > 32)\n"
    )
    assert "budget=" not in err and "window=" not in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--every", "32"], "--every 32 applies only with --decode-budget; give that, or leave --every out"),
        (["--decode-window", "8"], "--decode-window 8 applies only with --decode-budget"),
        (["--head-floor", "0.5"], "--head-floor 0.5 applies only with --heads adaptive or --layers global"),
        (["--pyramid-beta", "4"], "--pyramid-beta 4.0 applies only with --layers pyramid"),
        (["--seed", "3"], "--seed 3 applies only when sampling: give --temperature above 0"),
        (["--top-p", "0.9", "--seed", "1"], "--top-p 0.9 --seed 1 applies only when sampling"),
    ],
)
def test_a_flag_that_would_do_nothing_is_refused_naming_the_flag_it_needs(folder, capsys, flags, message):
    """Issue 68.7: a setting that needs another is refused in one line (never accepted and shown in the method)."""
    code, out, err = run(capsys, "generate", "--model", folder, "--prompt", "x", "--max-new-tokens", "1", *flags)
    assert code == 2 and out == "" and message in one_line(err)


def test_the_settings_that_need_another_are_refused_in_python_and_taken_with_it():
    with pytest.raises(
        kvc.InvalidParameterError,
        match=r"^SnapKV: head_floor=0.5 applies only with heads='adaptive' or layers='global'",
    ):
        kvc.SnapKV(head_floor=0.5)
    with pytest.raises(kvc.InvalidParameterError, match=r"every=16 applies only with decode_budget"):
        kvc.H2O(every=16)
    assert kvc.SnapKV(heads="adaptive", head_floor=0.5).head_floor == 0.5
    assert kvc.SnapKV(layers="pyramid", pyramid_beta=4.0).pyramid_beta == 4.0
    assert kvc.SnapKV(decode_budget=256, every=16, decode_window=8).every == 16
    model, tok = tiny_model(), bpe_tokenizer()
    with pytest.raises(kvc.InvalidParameterError, match=r"^seed=2 applies only when sampling: give temperature > 0"):
        kvc.generate(model, tok, "x", seed=2, max_new_tokens=1)


def test_the_smaller_refusals_a_newcomer_met_are_one_true_line(folder, doc, tmp_path, capsys):
    """Issue 68.8 and 68.10, each as the user met it."""
    code, _, err = run(capsys, "generate", "--model", folder, "--past", tmp_path, "--prompt", "q")
    assert (
        code == 2 and one_line(err) == f"kvcompress: error: {tmp_path} is a folder; give a kvcompress cache file (.kvc)"
    )
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "generate", "--model", tmp_path / "empty", "--prompt", "q")
    assert code == 2 and "the folder holds no model (no config.json)" in one_line(err)
    # --kv-format fp8 alone is 8 bits (the only width it has); --key-bits alone names what it needs
    code, out, _ = run(
        capsys, "generate", "--model", folder, "--prompt", "q", "--kv-format", "fp8", "--max-new-tokens", "1", "--json"
    )
    assert code == 0 and json.loads(out)["kv_stored_as"] == "fp8"
    code, _, err = run(capsys, "generate", "--model", folder, "--prompt", "q", "--key-bits", "6")
    assert code == 2 and "valid: --kv-bits 8 or --kv-bits 4 with --key-bits 6" in one_line(err)
    # help for a method that does not exist is refused, not shown
    code, out, err = run(capsys, "generate", "--method", "bogus", "--help")
    assert code == 2 and out == ""
    assert one_line(err) == f"kvcompress: error: --method bogus is unknown; valid: {', '.join(kvc.METHODS)}"
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    shown = capsys.readouterr().out
    assert "/save FILE" in shown and "/reset" in shown and '"""' in shown
    assert re.fullmatch(r"\d+\.\d+\S*|unknown", kvc.__version__)


def test_an_interrupted_stream_ends_the_answers_line_first(folder, doc, tmp_path):
    """Issue 68.10: Ctrl-C in ``generate --stream`` leaves the answer on its own line, the notice on the next."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcompress",
            "generate",
            "--model",
            str(folder),
            "--prompt-file",
            str(doc),
            "--stream",
            "--max-new-tokens",
            "1500",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = process.stdout.read(1)  # the answer has begun (1,500 tokens of the tiny model take ~1 s)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert first and process.returncode == 130 and (first + out).endswith("\n"), err
    assert err == "kvcompress: interrupted\n"


def test_fp8_alone_is_eight_bits_whether_a_method_is_named_or_a_saved_one_is_kept():
    """``--kv-format fp8`` means 8 bits on every way a method is built from flags (a saved chat's kept method too)."""
    from kvcompress.cli import build_parser
    from kvcompress.cli.method_flags import method_from_args, method_with_flags

    args = build_parser(["chat"]).parse_args(["chat", "--past", "x.kvc", "--kv-format", "fp8"])
    assert method_from_args("snapkv", args) == kvc.SnapKV(kv_bits=8, kv_format="fp8")
    assert method_with_flags(kvc.SnapKV(budget=48), args) == kvc.SnapKV(budget=48, kv_bits=8, kv_format="fp8")


def test_a_model_without_a_chat_template_is_fed_plain_text(tmp_path, capsys):
    """A base model (gemma3-270m) has no chat template: the commands feed it the text as it is, as ``--raw`` does,
    instead of failing in the template."""
    base = tmp_path / "base"
    tiny_model(max_position_embeddings=2048).save_pretrained(base)
    tokenizer = bpe_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(base)
    prompt = random_text(200, seed=5)
    code, plain, err = run(capsys, "generate", "--model", base, "--prompt", prompt, "--max-new-tokens", "4", "--json")
    assert code == 0, err
    code, raw, _ = run(
        capsys, "generate", "--model", base, "--prompt", prompt, "--max-new-tokens", "4", "--json", "--raw"
    )
    assert code == 0 and json.loads(plain)["text"] == json.loads(raw)["text"]
    code, _, err = run(
        capsys, "compress", "--model", base, "--prompt", prompt, "--budget", "16", "--out", tmp_path / "base.kvc"
    )
    assert code == 0 and (tmp_path / "base.kvc").is_file(), err


def test_h2o_over_a_stored_document_names_the_clis_way_to_keep_its_queries(folder, doc, tmp_path, capsys):
    """H2O scores a question with every query of the document: a document stored with the default query window is
    refused in the command line's words, and one stored with ``--query-window all`` is asked."""
    saved, whole = tmp_path / "doc.kvc", tmp_path / "whole.kvc"
    assert run(capsys, "compress", "--model", folder, "--prompt-file", doc, "--method", "full", "--out", saved)[0] == 0
    code, _, err = run(
        capsys,
        "generate",
        "--model",
        folder,
        "--past",
        saved,
        "--prompt",
        "q",
        "--method",
        "h2o",
        "--budget",
        "16",
        "--max-new-tokens",
        "2",
    )
    assert code == 2 and "kvcompress compress --method full --query-window all" in one_line(err)
    assert "kvc." not in err and "query_window" not in err
    assert (
        run(
            capsys,
            "compress",
            "--model",
            folder,
            "--prompt-file",
            doc,
            "--method",
            "full",
            "--query-window",
            "all",
            "--out",
            whole,
        )[0]
        == 0
    )
    assert (
        run(
            capsys,
            "generate",
            "--model",
            folder,
            "--past",
            whole,
            "--prompt",
            "q",
            "--method",
            "h2o",
            "--budget",
            "16",
            "--max-new-tokens",
            "2",
        )[0]
        == 0
    )
    with pytest.raises(SystemExit):
        run(capsys, "compress", "--model", folder, "--prompt-file", doc, "--query-window", "some", "--out", tmp_path)
    assert "--query-window: 'some' is invalid; give a count of queries >= 0, or all" in capsys.readouterr().err


def test_a_stop_string_reads_its_escapes_as_python_does(capsys):
    """``--stop '\\n'`` as typed in a shell (a backslash and an n) is a newline; ``'\\\\n'`` a backslash and an n."""
    from kvcompress.cli import build_parser

    for typed, meant in (("\\n", "\n"), ("\\\\n", "\\n"), ("Q:\\t", "Q:\t"), ("\u00e9\\n", "\u00e9\n"), ("\n", "\n")):
        assert build_parser().parse_args(["generate", "--prompt", "p", "--stop", typed]).stop == [meant], typed
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "p", "--stop", "end\\"])
    assert "'end\\\\' has an unfinished escape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--stop '\\n' is a newline" in " ".join(capsys.readouterr().out.split())


def test_help_answers_without_torch_or_transformers():
    """Every command's ``--help`` (and a chosen method's) is parsed from the catalogue: torch and transformers are
    imported only once a command runs (issue 81: each help took 5-9 s)."""
    every_help = [
        ["--help"],
        ["generate", "--help"],
        ["generate", "--method", "shadowkv", "--help"],
        ["chat", "--help"],
        ["compress", "--help"],
        ["methods", "--help"],
        ["demo", "--help"],
        ["observe", "--help"],
        ["bench", "accuracy", "--help"],
        ["bench", "speed", "--help"],
        ["bench", "headline", "--help"],
        ["bench", "shared-context", "--help"],
        ["serve", "--help"],
        ["fetch-model", "--help"],
    ]
    code = (
        "import contextlib, io, sys\nfrom kvcompress.cli import main\n"
        f"for argv in {every_help!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as shown, contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    assert 'usage: kvcompress' in shown.getvalue(), argv\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_parsers_catalogue_is_the_librarys():
    """``cli/catalogue.json`` (what every parser shows) equals what the library holds now: a method's new field or a
    new preset reaches the CLI (rewrite it with ``python -m kvcompress.cli.catalogue``)."""
    from kvcompress.cli import catalogue

    assert catalogue.catalogue() == catalogue.live_catalogue(), "run python -m kvcompress.cli.catalogue"
