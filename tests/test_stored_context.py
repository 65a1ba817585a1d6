"""A document prefilled once and stored, each question then compressed over it with its own method.

The reference is question-aware compression of the joined prompt (document and question in one
prompt): a question's prefill over the whole stored context attends to every token the joined
prefill attends to, so the method sees the same keys and queries and must keep the same positions
and give the same tokens. The store is read, never written: questions asked of it change nothing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import kvcompress as kvc
from kvcompress.generation.conversation import ask
from tests.fixtures import char_tokenizer, family_model, random_text, tiny_model

DOCUMENT = [{"role": "user", "content": random_text(400, seed=7)}]
QUESTIONS = (
    "What is the first word?",
    "1 or 2?",
    "Which of the words above is the longest one, and where does it stand?",
)

# Every method that compresses a prompt at its end (or selects from it while decoding), at a budget under the prompt.
PER_QUESTION = [
    kvc.SnapKV(budget=48, window=8),
    kvc.SnapKV(budget=48, window=8, clustering="pool"),
    kvc.SnapKV(budget=48, window=8, heads="adaptive"),
    kvc.SnapKV(budget=64, window=8, layers="pyramid"),
    kvc.H2O(budget=48),
    kvc.StreamingLLM(budget=48),
    kvc.ExpectedAttention(budget=48),
    kvc.ShadowKV(budget=48),
    kvc.Quest(budget=48),
    kvc.Loki(budget=48),
]


def joined(question: str, document=DOCUMENT) -> list[dict]:
    """The question-aware prompt: the document's message with the question after it."""
    return [{"role": "user", "content": document[0]["content"] + "\n\n" + question}]


def kept(result: kvc.Result) -> list[torch.Tensor]:
    return [layer.kept_positions() for layer in result.cache.layers]


@pytest.fixture(scope="module")
def model_and_store():
    model, tok = tiny_model(), char_tokenizer()
    return model, tok, kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV(), query_window=None)


@pytest.mark.parametrize(
    "method",
    PER_QUESTION,
    ids=lambda m: (
        m.describe().split(",")[0]
        + ("-" + m.heads if getattr(m, "heads", "uniform") != "uniform" else "")
        + ("-" + m.layers if getattr(m, "layers", "uniform") != "uniform" else "")
        + ("-pool" if getattr(m, "clustering", "") == "pool" else "")
    ),
)
def test_a_question_over_a_stored_context_keeps_what_the_joined_prompt_keeps(model_and_store, method):
    model, tok, store = model_and_store
    for question in QUESTIONS[:2]:
        asked = kvc.generate(model, tok, question, past=store, method=method, max_new_tokens=8)
        reference = kvc.generate(model, tok, joined(question), method=method, max_new_tokens=8)
        assert asked.stats["prompt_tokens"] == reference.stats["prompt_tokens"]
        assert all(torch.equal(a, b) for a, b in zip(kept(asked), kept(reference)))
        assert asked.token_ids == reference.token_ids and asked.text == reference.text
        # decodes from what the method keeps, no more
        assert asked.stats["kv_bytes_kept"] == reference.stats["kv_bytes_kept"]


@pytest.mark.parametrize(
    "settings",
    [{}, {"votes": "sum", "pooling": "avg"}, {"clustering": "pool", "kernel": 1}],
    ids=["default", "sum-avg", "pool"],
)
def test_a_question_shorter_than_the_window_is_the_window(model_and_store, settings):
    """question_window: over a stored context only the question's own tokens vote and are kept whole, the context's
    last tokens scored as any other: what SnapKV with its window set to the question's tokens keeps, exactly."""
    model, tok, store = model_and_store
    question = "1?"
    tokens = len(ask(tok, copy.deepcopy(store.rows[0]), question))
    assert tokens < 24  # (the char tokenizer's template and question: shorter than the window below)
    asked = kvc.generate(
        model, tok, question, past=store, method=kvc.SnapKV(budget=48, window=24, **settings), max_new_tokens=8
    )
    reference = kvc.generate(
        model,
        tok,
        question,
        past=store,
        max_new_tokens=8,
        method=kvc.SnapKV(budget=48, window=tokens, question_window=False, **settings),
    )
    assert all(torch.equal(a, b) for a, b in zip(kept(asked), kept(reference)))
    assert asked.token_ids == reference.token_ids
    last = kvc.generate(
        model,
        tok,
        question,
        past=store,
        max_new_tokens=8,
        method=kvc.SnapKV(budget=48, window=24, question_window=False, **settings),
    )
    assert not all(torch.equal(a, b) for a, b in zip(kept(asked), kept(last)))  # (the last 24 as before: not the same)
    # a new prompt's question has no known start: the last window tokens vote, whatever question_window says
    joined_prompt = [
        kvc.generate(
            model,
            tok,
            joined(question),
            max_new_tokens=8,
            method=kvc.SnapKV(budget=48, window=24, question_window=on, **settings),
        )
        for on in (True, False)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*map(kept, joined_prompt)))
    assert all(torch.equal(a, b) for a, b in zip(kept(last), kept(joined_prompt[1])))  # (off: the joined prompt's)


def test_the_store_is_read_never_written(model_and_store):
    model, tok, store = model_and_store
    before = [tensor.clone() for layer in store.cache.layers for tensor in (layer.keys, layer.values)]
    mask, rows = store.attention_mask.clone(), [row.transcript for row in store.rows]
    method = kvc.SnapKV(budget=48, window=8)
    first = kvc.generate(model, tok, QUESTIONS[0], past=store, method=method, max_new_tokens=8)
    for index in range(20):
        kvc.generate(model, tok, QUESTIONS[index % 3] + " " * (index % 2), past=store, method=method, max_new_tokens=4)
    again = kvc.generate(model, tok, QUESTIONS[0], past=store, method=method, max_new_tokens=8)
    assert again.token_ids == first.token_ids
    after = [tensor for layer in store.cache.layers for tensor in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert (
        torch.equal(store.attention_mask, mask)
        and [row.transcript for row in store.rows] == rows
        and all(row.open_turn for row in store.rows)
    )
    # today's way still works: the full cache continued
    continued = kvc.generate(model, tok, QUESTIONS[0], past=store.copy(), max_new_tokens=8)
    assert (
        continued.token_ids
        == kvc.generate(model, tok, joined(QUESTIONS[0]), method=kvc.FullKV(), max_new_tokens=8).token_ids
    )


@pytest.mark.parametrize(
    "method",
    [kvc.SnapKV(budget=48, window=8), kvc.H2O(budget=48), kvc.SnapKV(budget=48, window=8, heads="adaptive")],
    ids=["snapkv", "h2o", "snapkv-adaptive"],
)
def test_questions_of_very_different_lengths_are_a_batch_each_row_as_alone(model_and_store, method):
    model, tok, store = model_and_store
    questions = ["1?", QUESTIONS[2] * 3, QUESTIONS[0]]
    batch = kvc.generate(model, tok, questions, past=store, method=method, max_new_tokens=8)
    for row, question in enumerate(questions):
        alone = kvc.generate(model, tok, question, past=store, method=method, max_new_tokens=8)
        assert batch.token_ids[row] == alone.token_ids[0] and batch.text[row] == alone.text
        assert all(torch.equal(a[row][a[row] >= 0], b[0][b[0] >= 0]) for a, b in zip(kept(batch), kept(alone)))


def step_logits(model, run) -> list[torch.Tensor]:
    """The last position's logits of every model call ``run()`` makes (the prompt's, then each step's)."""
    calls: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, out: calls.append(out.logits[:, -1].float()))
    try:
        run()
    finally:
        hook.remove()
    return calls


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("method", [kvc.FullKV(), kvc.SnapKV(budget=48, window=8)], ids=["full", "snapkv"])
def test_a_sliding_window_counts_each_rows_own_tokens_in_a_batch_over_a_stored_context(family, method):
    """Questions of very different lengths over one stored context are right-aligned, so padding lies between the
    context and a shorter question (and, turn after turn, between an answer and a shorter next message): a
    sliding-window layer that counted it as tokens hid from that row context its window reaches alone (logits 1.0
    apart on the tiny Gemma 3, the same greedy tokens). Each row's logits, at every turn's prompt and step, are the
    row's alone, over four turns of different lengths."""
    model, tok = family_model(family), char_tokenizer()
    store = kvc.compress(model, tok, random_text(300, seed=4), method=kvc.FullKV())
    turns = [
        ["1?", QUESTIONS[2] * 3, QUESTIONS[0]],
        [QUESTIONS[2] * 2, "And?", QUESTIONS[1]],
        ["Why?", QUESTIONS[0] * 2, "x"],
        [QUESTIONS[1], "y", QUESTIONS[2]],
    ]

    def conversation(messages: list) -> tuple[list[list[torch.Tensor]], kvc.Result]:
        """Each turn's logits, asking ``messages`` (a batch's, or one row's) turn by turn over the store."""
        past, logits = store, []
        for turn, message in enumerate(messages):
            held: dict[str, kvc.Result] = {}
            logits.append(
                step_logits(
                    model,
                    lambda: held.setdefault(
                        "result",
                        kvc.generate(
                            model, tok, message, past=past, method=method if turn == 0 else None, max_new_tokens=4
                        ),
                    ),
                )
            )
            past = held["result"]
        return logits, past

    batch, last = conversation(turns)
    assert [len(logits) for logits in batch] == [4] * len(turns)  # each turn's prompt and three steps fed back
    for row in range(len(turns[0])):
        alone, last_alone = conversation([messages[row] for messages in turns])
        assert last.token_ids[row] == last_alone.token_ids[0]
        for ours, theirs in zip(batch, alone):
            for step_ours, step_theirs in zip(ours, theirs):
                torch.testing.assert_close(step_ours[row], step_theirs[0], rtol=1e-4, atol=1e-4)


def test_a_stored_batch_of_documents_asks_each_its_own_question():
    model, tok = tiny_model(), char_tokenizer()
    documents = [DOCUMENT, [{"role": "user", "content": random_text(90, seed=8)}]]
    store = kvc.compress(model, tok, documents, method=kvc.FullKV())
    method = kvc.SnapKV(budget=48, window=8)
    batch = kvc.generate(model, tok, list(QUESTIONS[:2]), past=store, method=method, max_new_tokens=8)
    for row, (document, question) in enumerate(zip(documents, QUESTIONS[:2])):
        assert (
            batch.token_ids[row]
            == kvc.generate(model, tok, joined(question, document), method=method, max_new_tokens=8).token_ids[0]
        )


@pytest.mark.parametrize("family", ["gemma2", "mistral-sliding", "qwen3"])
def test_families_with_sliding_windows_and_norms_answer_as_the_joined_prompt(family):
    model, tok = family_model(family), char_tokenizer()
    store = kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV())
    method = kvc.SnapKV(budget=48, window=8)
    for question in QUESTIONS[:2]:
        asked = kvc.generate(model, tok, question, past=store, method=method, max_new_tokens=8)
        assert asked.token_ids == kvc.generate(model, tok, joined(question), method=method, max_new_tokens=8).token_ids


def test_a_saved_store_loads_and_answers_alike_twice(model_and_store, tmp_path):
    model, tok, store = model_and_store
    method = kvc.SnapKV(budget=48, window=8)
    expected = kvc.generate(model, tok, QUESTIONS[1], past=store, method=method, max_new_tokens=8).token_ids
    store.save(tmp_path / "doc.kvc")
    loaded = kvc.load(tmp_path / "doc.kvc", model, tok)
    assert kvc.generate(model, tok, QUESTIONS[1], past=loaded, method=method, max_new_tokens=8).token_ids == expected
    loaded.save(tmp_path / "again.kvc")
    again = kvc.load(tmp_path / "again.kvc", model, tok)
    assert kvc.generate(model, tok, QUESTIONS[1], past=again, method=method, max_new_tokens=8).token_ids == expected


def test_a_thinned_store_answers_from_fewer_bytes():
    model, tok = tiny_model(), char_tokenizer()
    whole = kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV())
    thinned = kvc.compress(model, tok, DOCUMENT, method=kvc.KVzip(ratio=0.5, layers="uniform"), query_window=64)
    assert thinned.stats["kv_bytes_kept"] < 0.55 * whole.stats["kv_bytes_kept"]
    method = kvc.SnapKV(budget=48, window=8)
    answer = kvc.generate(model, tok, QUESTIONS[0], past=thinned, method=method, max_new_tokens=8)
    assert len(answer.token_ids[0]) > 0 and answer.stats["context_bytes"] < whole.stats["device_bytes"]
    context = thinned.stats["prompt_tokens"]
    prompt = kvc.generate(model, tok, joined(QUESTIONS[0]), method=kvc.FullKV(), max_new_tokens=1).stats[
        "prompt_tokens"
    ]
    # the joined prompt's positions: a head keeps only what the store kept, or the question
    for chosen, stored in zip(kept(answer), kept(thinned)):
        assert int(chosen.max()) < prompt
        for head in range(chosen.shape[1]):
            from_context = {p for p in chosen[0, head].tolist() if 0 <= p < context}
            assert from_context <= set(stored[0, head].tolist())


def test_stats_say_which_tier_holds_what(model_and_store):
    model, tok, store = model_and_store
    answer = kvc.generate(
        model, tok, QUESTIONS[0], past=store, method=kvc.SnapKV(budget=48, window=8), max_new_tokens=4
    )
    assert answer.stats["context_on"] == "cpu" and answer.stats["context_bytes"] == store.stats["device_bytes"]
    assert answer.stats["device_bytes"] < store.stats["device_bytes"] / 3
    # the first token apart
    assert answer.stats["ttft_s"] == answer.stats["prefill_s"] > 0 and answer.stats["decode_ms_per_token"] > 0


def test_what_cannot_be_asked_per_question_is_refused_in_one_line(model_and_store):
    model, tok, store = model_and_store
    with pytest.raises(kvc.InvalidParameterError, match=r"kvzip\(.*observation pass.*question-aware method"):
        kvc.generate(model, tok, "q?", past=store, method=kvc.KVzip(budget=48))
    packed = kvc.compress(model, tok, DOCUMENT, method=kvc.KVzip(budget=48))
    with pytest.raises(kvc.InvalidParameterError, match=r"compressed with kvzip\(budget=48.*method=kvc.FullKV\(\)"):
        kvc.generate(model, tok, "q?", past=packed, method=kvc.SnapKV(budget=32, window=8))
    # a conversation begun without a stored context has none to compress a follow-up over
    answered = kvc.generate(model, tok, DOCUMENT, max_new_tokens=2)
    with pytest.raises(
        kvc.InvalidParameterError, match="not one waiting for its question; continue it with method=None"
    ):
        kvc.generate(model, tok, "again?", past=answered, method=kvc.SnapKV(budget=32, window=8))
    few = kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV(), query_window=4)
    with pytest.raises(
        ValueError, match=r"every query of the context, and the stored context kept its last 4.*query_window=None"
    ):
        kvc.generate(model, tok, "q?", past=few, method=kvc.H2O(budget=48))
    with pytest.raises(ValueError, match=r"the last 32 queries, and the stored context kept its last 4"):
        kvc.generate(model, tok, "q?", past=few, method=kvc.SnapKV(budget=48))
    with pytest.raises(kvc.InvalidParameterError, match="3 entries for a batch of 2"):
        kvc.generate(
            model,
            tok,
            ["a?", "b?", "c?"],
            past=kvc.compress(model, tok, [DOCUMENT, DOCUMENT], method=kvc.FullKV()),
            method=kvc.SnapKV(budget=48, window=8),
        )
    with pytest.raises(kvc.InvalidParameterError, match="query_window='x' is invalid"):
        kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV(), query_window="x")


def test_the_command_line_asks_a_stored_file_per_question(tmp_path):
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (tmp_path / "doc.txt").write_text(DOCUMENT[0]["content"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")]))}

    def run(*args: object) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvcompress", *map(str, args)], capture_output=True, text=True, env=env
        )

    model, tok = kvc.load_model(str(folder))
    # as `kvcompress compress --method full` writes it
    kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV()).save(tmp_path / "doc.kvc")
    asked = run(
        "generate",
        "--model",
        folder,
        "--past",
        tmp_path / "doc.kvc",
        "--method",
        "snapkv",
        "--budget",
        "48",
        "--window",
        "8",
        "--prompt",
        QUESTIONS[0],
        "--max-new-tokens",
        "6",
        "--json",
    )
    assert asked.returncode == 0, asked.stderr
    expected = kvc.generate(model, tok, joined(QUESTIONS[0]), method=kvc.SnapKV(budget=48, window=8), max_new_tokens=6)
    answer = json.loads(asked.stdout)
    assert (
        answer["text"] == expected.text
        and answer["method"] == expected.stats["method"]
        and answer["context_on"] == "cpu"
    )
    assert answer["ttft_s"] > 0 and "decode_ms_per_token" in answer


def test_decoding_after_a_question_over_a_store_is_the_question_aware_step(model_and_store):
    """Once the question is compressed, nothing of the store is read: the same ops per step, no host read,
    and the compiled step gives the eager tokens."""
    from kvcompress.bench.audit import audit_step
    from kvcompress.generation.decode import DecodeState, greedy_step

    model, tok, store = model_and_store
    method = kvc.SnapKV(budget=48, window=8)
    audits = []
    with torch.inference_mode():
        for result in (
            kvc.generate(model, tok, QUESTIONS[0], past=store, method=method, max_new_tokens=2),
            kvc.generate(model, tok, joined(QUESTIONS[0]), method=method, max_new_tokens=2),
        ):
            logits = torch.zeros(1, model.config.vocab_size)
            logits[0, 40] = 1.0
            state = DecodeState.start(logits, result.next_position, 4, {2})
            result.cache.reserve(3)
            greedy_step(model, result.cache, state)
            audits.append(audit_step(lambda cache=result.cache, state=state: greedy_step(model, cache, state)))
    assert not audits[0].host_reads and audits[0].total == audits[1].total
    eager = kvc.generate(model, tok, QUESTIONS[1], past=store, method=method, max_new_tokens=10)
    compiled = kvc.generate(
        model, tok, QUESTIONS[1], past=store, method=method, max_new_tokens=10, compile=kvc.Compile(backend="eager")
    )
    assert compiled.token_ids == eager.token_ids


def test_a_thinned_stores_heads_take_their_tokens_word_spans():
    """Each head of a thinned context holds other tokens: its slots' spans are the joined prompt's at those tokens."""
    from kvcompress.cache.intake import OverStored, StoredPrompt
    from kvcompress.storage.dense import DenseSlots

    positions = torch.tensor([[[0, 2, 5], [1, 3, 4]]])  # two heads, three of six context tokens each
    keys = torch.zeros(1, 2, 3, 4)
    stored = StoredPrompt(keys, keys, None, positions, torch.tensor([6]), None, None)
    intake = OverStored(stored, pads=[1], spans=None)  # a 3-slot question, 1 padding
    spans = torch.tensor([[0, 0, 1, 1, 2, 3, 3, 4]])  # the joined prompt's 6 + 2 tokens
    intake.take(DenseSlots(), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    joined = intake.joined_positions(3)
    assert joined.tolist() == [[[-1, 0, 2, 5, 6, 7], [-1, 1, 3, 4, 6, 7]]]
    per_head = intake.joined_spans(spans, joined, 3)
    assert per_head[0, :, 1:].tolist() == [[0, 1, 3, 3, 4], [0, 1, 2, 3, 4]] and per_head[0, 0, 0] >= spans.shape[-1]


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="a GPU: the store in host memory, each layer copied to the device per question",
)
def test_on_a_gpu_the_store_lives_in_host_memory_and_answers_as_the_joined_prompt():
    model, tok = tiny_model().cuda(), char_tokenizer()
    store = kvc.compress(model, tok, DOCUMENT, method=kvc.FullKV())
    assert store.cache.device_of().type == "cpu" and store.cache.layers[0].keys.is_pinned()
    method = kvc.SnapKV(budget=48, window=8)
    asked = kvc.generate(model, tok, QUESTIONS[0], past=store, method=method, max_new_tokens=8)
    assert asked.stats["context_on"] == "cpu" and asked.cache.device_of().type == "cuda"
    assert asked.token_ids == kvc.generate(model, tok, joined(QUESTIONS[0]), method=method, max_new_tokens=8).token_ids
    # the stored full cache continued: moved to the device
    continued = kvc.generate(model, tok, QUESTIONS[0], past=store, max_new_tokens=8)
    assert (
        continued.token_ids
        == kvc.generate(model, tok, joined(QUESTIONS[0]), method=kvc.FullKV(), max_new_tokens=8).token_ids
    )
