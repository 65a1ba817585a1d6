"""A conversation over a stored document, every turn compressed per question.

The reference is question-aware compression of the whole conversation so far in one prompt (the
document, every earlier question and answer, the newest message): a follow-up over the store is
prefilled over every token that prompt's prefill attends to, so the method must keep the same
positions and give the same tokens, at every turn. The store is read, never written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kvcompress as kvc
from kvcompress.generation.result import read_header
from tests.fixtures import char_tokenizer, random_text, tiny_model

DOCUMENT = [{"role": "user", "content": random_text(400, seed=11)}]
TURNS = (
    "What is the first word?",
    "And the second one?",
    "Say it again.",
    "Which word is the longest?",
    "Repeat your last answer.",
    "Now the third word.",
    "Is it longer than the first?",
    "Spell it.",
    "What did I ask first?",
    "Thanks. One more: the last word?",
)
PER_QUESTION = [
    kvc.SnapKV(budget=48, window=8),
    kvc.SnapKV(budget=48, window=8, heads="adaptive"),
    kvc.H2O(budget=48),
    kvc.StreamingLLM(budget=48),
    kvc.ExpectedAttention(budget=48),
    kvc.SnapKV(budget=64, window=8, layers="pyramid"),
    kvc.ShadowKV(budget=48),
    kvc.Quest(budget=48),
    kvc.Loki(budget=48),
]


@pytest.fixture(scope="module")
def model_and_store():
    model, tok = tiny_model(), char_tokenizer()
    return model, tok, kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV(), query_window=None)


def kept(result: kvc.Result) -> list[torch.Tensor]:
    return [layer.kept_positions() for layer in result.cache.layers]


def same_as_whole_conversation(model, tok, turn: kvc.Result, method: kvc.Method, row: int = 0) -> None:
    """``turn`` (one row of it) against ``method`` over the conversation so far as one prompt."""
    reference = kvc.generate(model, tok, turn.rows[row].messages, method=method, max_new_tokens=6)
    if len(turn.rows) == 1:
        assert turn.stats["prompt_tokens"] == reference.stats["prompt_tokens"]
        assert all(torch.equal(a, b) for a, b in zip(kept(turn), kept(reference)))
    assert turn.token_ids[row] == reference.token_ids[0]


@pytest.mark.parametrize(
    "method",
    PER_QUESTION,
    ids=lambda m: (
        m.describe().split("(")[0]
        + ("-adaptive" if getattr(m, "heads", "uniform") == "adaptive" else "")
        + ("-pyramid" if getattr(m, "layers", "uniform") == "pyramid" else "")
    ),
)
def test_every_turn_is_compressed_with_the_whole_conversation(model_and_store, method):
    model, tok, store = model_and_store
    turn = kvc.generate(model, tok, TURNS[0], past=store, method=method, max_new_tokens=6)
    for text in TURNS[1:3]:
        turn = kvc.generate(model, tok, text, past=turn, method=method, max_new_tokens=6)
        assert [m["role"] for m in turn.rows[0].messages][-3:] == ["user", "assistant", "user"]
        same_as_whole_conversation(model, tok, turn, method)
        assert turn.store is store and turn.stats["context_on"] == "cpu"


def test_ten_turns_leave_the_store_as_it_was(model_and_store):
    model, tok, store = model_and_store
    before = [t.clone() for layer in store.cache.layers for t in (layer.keys, layer.values)]
    method = kvc.SnapKV(budget=48, window=8)
    turn = store
    for text in TURNS:
        turn = kvc.generate(model, tok, text, past=turn, method=method, max_new_tokens=6)
    same_as_whole_conversation(model, tok, turn, method)
    assert len(turn.rows[0].messages) == 2 * len(TURNS) - 1
    after = [t for layer in store.cache.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and all(row.open_turn for row in store.rows)


def test_a_batch_of_conversations_is_each_conversation_alone(model_and_store):
    model, tok, store = model_and_store
    method = kvc.SnapKV(budget=48, window=8)
    firsts, follow_ups = [TURNS[0], TURNS[3]], [TURNS[1], "?"]
    batch = kvc.generate(model, tok, firsts, past=store, method=method, max_new_tokens=6)
    batch = kvc.generate(model, tok, follow_ups, past=batch, method=method, max_new_tokens=6)
    for row, (first, follow_up) in enumerate(zip(firsts, follow_ups)):
        alone = kvc.generate(model, tok, first, past=store, method=method, max_new_tokens=6)
        alone = kvc.generate(model, tok, follow_up, past=alone, method=method, max_new_tokens=6)
        assert batch.token_ids[row] == alone.token_ids[0]
        same_as_whole_conversation(model, tok, batch, method, row)


def test_turns_with_and_without_a_method_mix(model_and_store):
    """A follow-up with no method continues the last turn's cache as it is; a later one with a method is still
    compressed with the whole conversation over the store."""
    model, tok, store = model_and_store
    method = kvc.SnapKV(budget=48, window=8)
    turn = kvc.generate(model, tok, TURNS[0], past=store, method=method, max_new_tokens=6)
    appended = kvc.generate(model, tok, TURNS[1], past=turn, max_new_tokens=6)
    assert appended.cache is turn.cache and appended.store is store
    # each turn counts what it fed: the first its question, the appended one its message (and the last answer's
    # unfed token), while the cache's prompt stays the first turn's
    stored = int(store.attention_mask.sum())
    assert turn.stats["turn_tokens"] == turn.stats["prompt_tokens"] - stored
    assert appended.stats["prompt_tokens"] == turn.stats["prompt_tokens"]
    assert len(TURNS[1]) < appended.stats["turn_tokens"] < len(TURNS[1]) + 40
    again = kvc.generate(model, tok, TURNS[2], past=appended, method=method, max_new_tokens=6)
    same_as_whole_conversation(model, tok, again, method)
    assert again.stats["turn_tokens"] == again.stats["prompt_tokens"] - stored


def test_asking_a_store_without_a_method_does_not_use_it_up(model_and_store):
    """Tried as a new user would: a question with no method, then one with a method, over one store."""
    model, tok, store = model_and_store
    plain = kvc.generate(model, tok, TURNS[0], past=store, max_new_tokens=6)
    joined = [{"role": "user", "content": DOCUMENT[0]["content"] + "\n\n" + TURNS[0]}]
    full = kvc.generate(model, tok, joined, method=kvc.FullKV(), max_new_tokens=6)
    assert plain.token_ids == full.token_ids and all(row.open_turn for row in store.rows)
    method = kvc.SnapKV(budget=48, window=8)
    asked = kvc.generate(model, tok, TURNS[0], past=store, method=method, max_new_tokens=6)
    same_as_whole_conversation(model, tok, asked, method)


CONTINUE_ELSEWHERE = """
import json, sys
import kvcompress as kvc
from tests.fixtures import char_tokenizer, tiny_model
model, tok = tiny_model(), char_tokenizer()
loaded = kvc.load(sys.argv[1], model, tok)
turn = kvc.generate(model, tok, sys.argv[2], past=loaded, method=kvc.SnapKV(budget=48, window=8), max_new_tokens=6)
print(json.dumps({"tokens": turn.token_ids, "messages": turn.rows[0].messages, "stored": loaded.store is not None}))
"""


def test_a_saved_conversation_continues_in_another_process(model_and_store, tmp_path):
    model, tok, store = model_and_store
    method = kvc.SnapKV(budget=48, window=8)
    turn = kvc.generate(model, tok, TURNS[0], past=store, method=method, max_new_tokens=6)
    turn = kvc.generate(model, tok, TURNS[1], past=turn, method=method, max_new_tokens=6)
    turn.save(tmp_path / "chat.kvc")
    store.save(tmp_path / "store.kvc")
    # a file holding a store is version 4 (an earlier reader refuses it by version); any other stays version 3
    assert (read_header(tmp_path / "chat.kvc")["version"], read_header(tmp_path / "store.kvc")["version"]) == (4, 3)
    assert "store_row" not in read_header(tmp_path / "store.kvc")["rows"][0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [".", "src", os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", CONTINUE_ELSEWHERE, str(tmp_path / "chat.kvc"), TURNS[2]],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    elsewhere = json.loads(done.stdout)
    here = kvc.generate(model, tok, TURNS[2], past=turn, method=method, max_new_tokens=6)
    assert elsewhere == {"tokens": here.token_ids, "messages": here.rows[0].messages, "stored": True}
    # loaded twice: the same conversation, its store in host memory once more
    again = kvc.load(tmp_path / "chat.kvc", model, tok)
    assert again.store.cache.stats()["tokens_kept_fraction"] == 1.0 and all(r.open_turn for r in again.store.rows)
    same_as_whole_conversation(
        model, tok, kvc.generate(model, tok, TURNS[2], past=again, method=method, max_new_tokens=6), method
    )
