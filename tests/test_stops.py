"""Stop strings (generation/stops.py): an answer ends where its text first holds one, each row of a batch at its
own; its tokens run to the one that completed the string (left pending, as an answer cut by max_new_tokens); bad
strings are refused in one line; the command line takes them as --stop."""

from __future__ import annotations

import io
import json

import pytest
import torch

import kvcompress as kvc
from kvcompress.chat import Printer
from kvcompress.cli.main import main
from kvcompress.generation.stops import Stops

from .fixtures import char_tokenizer, random_text, tiny_model

PROMPTS = [[{"role": "user", "content": random_text(160, seed=seed)}] for seed in (3, 4)]
METHOD = kvc.SnapKV(budget=48, window=8)


def endless_model():
    """The tiny model with its end token's output row zeroed, so answers run to max_new_tokens."""
    model, tok = tiny_model(), char_tokenizer()
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] = 0
    return model, tok


def endless(model, tok, prompt, **options):
    return kvc.generate(model, tok, prompt, method=METHOD, max_new_tokens=40, **options)


def first_repeat(text: str) -> str:
    """A two-character string of ``text`` that first appears after its tenth character (the answer's middle)."""
    return next(text[i : i + 2] for i in range(10, len(text) - 2) if text.index(text[i : i + 2]) == i)


def test_an_answer_ends_before_its_first_stop_string_and_its_completing_token_is_pending():
    model, tok = endless_model()
    full = endless(model, tok, PROMPTS[0])
    stop = first_repeat(full.text)
    stopped = endless(model, tok, PROMPTS[0], stop=[stop, "never said"])
    assert stopped.text == full.text[: full.text.index(stop)]
    kept = stopped.token_ids[0]  # up to the token that completed the string
    assert kept == full.token_ids[0][: len(kept)]
    assert stop in tok.decode(kept, skip_special_tokens=True) and stop not in tok.decode(kept[:-1])
    assert stopped.rows[0].pending == kept[-1]  # unfed, as a cut answer's last token
    # the conversation goes on from there as from an answer cut by max_new_tokens at that length
    cut = kvc.generate(model, tok, PROMPTS[0], method=METHOD, max_new_tokens=len(kept))
    assert cut.token_ids == stopped.token_ids
    assert (
        kvc.generate(model, tok, "Go on.", past=stopped, max_new_tokens=8).token_ids
        == kvc.generate(model, tok, "Go on.", past=cut, max_new_tokens=8).token_ids
    )


def test_each_row_of_a_batch_stops_at_its_own_string_as_it_would_alone():
    model, tok = endless_model()
    alone = [endless(model, tok, prompt).text for prompt in PROMPTS]
    stops = [first_repeat(text) for text in alone]
    batch = endless(model, tok, PROMPTS, stop=stops)
    for row, text in enumerate(alone):
        own = endless(model, tok, PROMPTS[row], stop=stops)
        assert batch.text[row] == own.text and batch.token_ids[row] == own.token_ids[0]
        assert own.text == text[: min(text.index(s) for s in stops if s in text)]


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        ("", r"stop='' is invalid; give a non-empty string, a list of them, or None"),
        ([], r"stop=\[\] is invalid; give a non-empty string, a list of them, or None"),
        (["a", 3], r"stop=\['a', 3\] is invalid; give a non-empty string, a list of them, or None"),
    ],
)
def test_a_bad_stop_is_refused_in_one_line(stop, message):
    model, tok = tiny_model(), char_tokenizer()
    with pytest.raises(kvc.InvalidParameterError, match=message):
        endless(model, tok, PROMPTS[0], stop=stop)


def test_the_command_line_takes_stop_strings(tmp_path, capsys):
    model, tok = endless_model()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    text = PROMPTS[0][0]["content"]
    full = endless(model, tok, PROMPTS[0])
    stop = first_repeat(full.text)
    code = main(
        [
            "generate",
            "--model",
            str(tmp_path / "model"),
            "--prompt",
            text,
            "--method",
            "snapkv",
            "--budget",
            "48",
            "--window",
            "8",
            "--max-new-tokens",
            "40",
            "--stop",
            stop,
            "--stop",
            "never said",
            "--json",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["text"] == full.text[: full.text.index(stop)]


def test_the_command_line_refuses_an_empty_stop_in_its_own_words(tmp_path, capsys):
    model, tok = endless_model()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    code = main(
        ["generate", "--model", str(tmp_path / "model"), "--prompt", "hi", "--stop", "", "--max-new-tokens", "2"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1] == (
        "kvcompress: error: --stop '' is invalid; give a non-empty string (repeat --stop for several)"
    )


def streamed(model, tok, stop) -> str:
    """What a stream of the first prompt's answer prints with stop strings ``stop``."""
    out = io.StringIO()
    endless(model, tok, PROMPTS[0], stop=stop, streamer=Printer(tok, out, Stops.of(stop, tok)))
    return out.getvalue()


def test_a_stream_shows_the_answer_and_never_a_stop_strings_first_characters():
    model, tok = endless_model()
    full = endless(model, tok, PROMPTS[0]).text
    stop = first_repeat(full)
    assert streamed(model, tok, stop) == full[: full.index(stop)] + "\n"  # not the string, nor its first tokens
    # the answer's end begins a string that never comes: held back while it might, shown when the answer ends
    unfinished = full[-2:] + "\u2603"
    assert streamed(model, tok, unfinished) == full + "\n"


def test_the_command_line_streams_an_answer_cut_before_its_stop_string(tmp_path, capsys):
    model, tok = endless_model()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    full = endless(model, tok, PROMPTS[0])
    stop = first_repeat(full.text)
    code = main(
        [
            "generate",
            "--model",
            str(tmp_path / "model"),
            "--prompt",
            PROMPTS[0][0]["content"],
            "--method",
            "snapkv",
            "--budget",
            "48",
            "--window",
            "8",
            "--max-new-tokens",
            "40",
            "--stop",
            stop,
            "--stream",
        ]
    )
    assert code == 0 and capsys.readouterr().out.startswith(full.text[: full.text.index(stop)] + "\n")
