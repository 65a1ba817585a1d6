"""Sampled decoding and streaming: a seed repeats an answer, the draw follows the nucleus of the
temperature-scaled distribution (checked against frequencies computed here), and a streamer sees the
prompt, then every token as it comes."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from transformers import TextStreamer

import kvcompress as kvc
from kvcompress.generation.decode import DecodeState, Sampling, next_token
from tests.fixtures import char_tokenizer, random_text, tiny_model

PROMPT = [{"role": "user", "content": random_text(200, seed=3)}]


def test_the_draw_follows_the_nucleus_of_the_scaled_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    state = DecodeState.start(logits, torch.zeros(1, dtype=torch.long), 2, set(), sampling=Sampling(0.7, 0.9))
    generator = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(20000):
        state.draw(generator)
        draws.append(int(next_token(logits, state)))
    counts = torch.bincount(torch.tensor(draws), minlength=6).double() / len(draws)
    # the reference: softmax at temperature 0.7, the most probable tokens until they reach 0.9, renormalised
    probs = (logits[0].double() / 0.7).softmax(-1)
    nucleus = (probs.cumsum(-1) - probs) <= 0.9
    expected = torch.where(nucleus, probs, 0) / probs[nucleus].sum()
    assert int(nucleus.sum()) == 3 and torch.allclose(counts, expected, atol=0.015)
    # a nucleus of one token is the greedy choice
    narrow = DecodeState.start(
        logits, torch.zeros(1, dtype=torch.long), 2, set(), sampling=Sampling(1.0, 1e-6), generator=generator
    )
    assert int(narrow.token) == 0


def test_a_seed_repeats_an_answer_and_temperature_zero_is_greedy():
    model, tok = tiny_model(), char_tokenizer()
    method = kvc.SnapKV(budget=48, window=8)

    def run(**options):
        return kvc.generate(model, tok, PROMPT, method=method, max_new_tokens=12, **options).token_ids

    greedy = run()
    assert run(temperature=0.0) == greedy and run(temperature=1.5, top_p=1e-6, seed=1) == greedy
    first, again, other = run(temperature=1.5, seed=1), run(temperature=1.5, seed=1), run(temperature=1.5, seed=2)
    assert first == again and first != other and first != greedy


def test_a_streamer_sees_the_prompt_then_each_token():
    model, tok = tiny_model(), char_tokenizer()

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    recorder = Recorder()
    result = kvc.generate(model, tok, PROMPT, max_new_tokens=10, streamer=recorder, temperature=1.0, seed=4)
    prompt, *tokens = recorder.puts
    assert recorder.ended and len(prompt[0]) == result.stats["prompt_tokens"]
    assert [t for put in tokens for t in put] == result.token_ids[0]
    # transformers' own TextStreamer prints the answer as it comes
    shown = io.StringIO()
    with redirect_stdout(shown):
        streamed = kvc.generate(model, tok, PROMPT, max_new_tokens=10, streamer=TextStreamer(tok, skip_prompt=True))
    assert shown.getvalue().strip() == streamed.text.strip()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("temperature", -1, r"^kvcompress: temperature=-1 is outside the valid range \[0, 100\]$"),
        ("top_p", 0, r"^kvcompress: top_p=0 is outside the valid range \(0, 1\]$"),
        ("seed", -3, r"^kvcompress: seed=-3 is invalid; it must be an integer >= 0 \(or None for an unseeded draw\)$"),
    ],
)
def test_bad_sampling_settings_are_refused_in_one_line(option, value, message):
    with pytest.raises(kvc.InvalidParameterError, match=message):
        kvc.generate(tiny_model(), char_tokenizer(), PROMPT, max_new_tokens=2, **{option: value})
