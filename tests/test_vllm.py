"""kvcompress inside vLLM's CPU build (runs only where vLLM is installed: `make vllm`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import threading
from unittest import mock

import pytest

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress import demo  # noqa: E402
from kvcompress.generation.conversation import context_ids  # noqa: E402
from kvcompress.integrations.transformers.models import default_model_dir  # noqa: E402
from kvcompress.serving import settings as serving  # noqa: E402
from kvcompress.serving import vllm_api, vllm_paged, vllm_plugin, vllm_requests, vllm_worker  # noqa: E402

from .served import Server, chat  # noqa: E402

pytestmark = pytest.mark.skipif(not (default_model_dir() / "model.safetensors").exists(), reason="no embedded model")
ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "block_size": 32,
    "max_num_batched_tokens": 2048,
}
METHOD = kvc.SnapKV(budget=256)  # the engines' own method


@pytest.fixture(scope="module")
def library():
    return kvc.load_model()


@pytest.fixture(scope="module")
def engine():
    return vllm.LLM(model=str(default_model_dir()), **ENGINE, **serving.engine_options(METHOD))


def test_snapkv_in_vllm_keeps_what_kvcompress_keeps_and_frees_blocks(engine, library):
    model, tokenizer = library
    messages = chat(tokenizer, 1200, 0.3)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    vllm_worker.KEPT_POSITIONS.clear()
    served = engine.generate([prompt], vllm.SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    ours = kvc.generate(model, tokenizer, messages, method=kvc.SnapKV(budget=256), max_new_tokens=16)
    assert served.outputs[0].text.strip() == ours.text.strip()
    (kept,) = vllm_worker.KEPT_POSITIONS.values()
    for name, positions in kept.items():
        assert torch.equal(positions, ours.cache.kept_positions(vllm_worker.layer_index(name))[0]), name
    blocks = engine.llm_engine.engine_core.engine_core.scheduler.blocks_before_after
    before, after = next(v for k, v in blocks.items() if k.split("-")[0] == served.request_id)  # vLLM suffixes its ids
    assert before == -(-len(served.prompt_token_ids) // 32)  # the prompt's blocks
    assert after == -(-(256 + 16) // 32)  # then what SnapKV keeps and the room for every token


def test_each_request_of_a_batch_gets_its_own_method_and_its_alone_answer(engine, library):
    """One batch: prompts of very different lengths, each with its own method (or the engine's, or none);
    each answers as kvcompress.generate answers it alone, and keeps the positions kvcompress keeps."""
    cases = [
        (1500, 0.6, None),
        (300, 0.5, {"method": "streamingllm", "budget": 64}),
        (1000, 0.2, {"method": "h2o", "budget": 192}),
        (700, 0.8, {"method": "full"}),
        (1200, 0.3, {"method": "snapkv", "budget": 128, "window": 16}),
        (800, 0.4, {"method": "expected", "budget": 128}),
    ]
    assert len(served_alike(engine, library, cases)) == 5  # every request compressed but the one keeping its full cache


QUESTIONS = [
    (demo.QUESTION, None),
    ("What colour is the door of the east wing?", {"method": "snapkv", "budget": 128}),
    ("Summarise the document in one sentence.", {"method": "streamingllm", "budget": 96}),
    (demo.QUESTION, {"method": "snapkv", "budget": 192, "window": 16}),
    ("Which room is in the east wing?", {"method": "h2o", "budget": 160}),
]


def test_questions_over_one_document_prefill_their_own_tokens_and_keep_what_the_library_keeps(engine, library):
    """vLLM's prefix caching on: questions over one document, one after another, each with its own method. Each
    later one prefills only the tokens after the cached document less what its method reads (SnapKV's window, none of
    it for H2O, which reads every query), keeps exactly the positions the library keeps asking the same question of
    the stored document (``generate(question, past=context, method=M)``, with SnapKV's last ``window`` tokens voting:
    a request is one rendered prompt, nothing in it says where its question begins, so ``question_window`` cannot
    apply), and answers with its tokens; the document's blocks stay cached for the next question while each
    request's compressed blocks are its own."""
    model, tokenizer = library
    opening = f"Read this report.\n\n{demo.build_document(tokenizer, 1200, 0.4)}"  # a prefix no other test sends
    context = kvc.compress(model, tokenizer, [{"role": "user", "content": opening}], query_window=None)  # (H2O's)
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    sent: list[list[int]] = []
    for i, (question, settings) in enumerate(QUESTIONS):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{opening}\n\n{question}"}], tokenize=False, add_generation_prompt=True
        )
        vllm_worker.KEPT_POSITIONS.clear()
        served = engine.generate([prompt], sampling([(settings,)]), use_tqdm=False)[0]
        method = serving.method_of(settings, default=METHOD)
        as_served = dataclasses.replace(method, question_window=False) if hasattr(method, "question_window") else method
        ours = kvc.generate(model, tokenizer, question, past=context, method=as_served, max_new_tokens=12)
        assert served.outputs[0].text == ours.text, settings
        assert same_positions(next(iter(vllm_worker.KEPT_POSITIONS.values())), ours.cache), settings
        hit = next(v for k, v in scheduler.hits.items() if k.split("-")[0] == served.request_id)
        prompt_tokens, needed = len(served.prompt_token_ids), method.queries_needed()
        if i == 0 or needed is None:  # the document's first request (the chat template's first block aside); H2O
            assert hit <= 32 * (i == 0), settings  # scores with every prompt query
        else:  # the cached document up to the method's window, ending inside a block where the window does
            assert hit == min(prompt_tokens - needed, cached_blocks(served.prompt_token_ids, sent)), settings
        sent.append(list(served.prompt_token_ids))


def test_a_question_that_says_where_it_begins_votes_with_its_own_tokens(engine, library):
    """A request naming where its question begins (``question_start``: here the stored document's end): each keeps
    exactly the positions the library keeps asking the same question of the stored document with its default
    ``question_window`` (the question's own tokens vote), answers with its tokens, and prefills from where plain
    vLLM's prefix cache ends (no document block recomputed for SnapKV's window)."""
    model, tokenizer = library
    opening = f"Read this memo.\n\n{demo.build_document(tokenizer, 1100, 0.5)}"  # a prefix no other test sends
    context = kvc.compress(model, tokenizer, [{"role": "user", "content": opening}], query_window=None)  # (H2O's)
    start = len(context_ids(tokenizer, context.rows[0]))
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    sent: list[list[int]] = []
    for i, (question, settings) in enumerate(QUESTIONS):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{opening}\n\n{question}"}], tokenize=False, add_generation_prompt=True
        )
        vllm_worker.KEPT_POSITIONS.clear()
        served = engine.generate(
            [prompt], sampling([({**(settings or {}), "question_start": start},)]), use_tqdm=False
        )[0]
        method = serving.method_of(settings, default=METHOD)
        ours = kvc.generate(model, tokenizer, question, past=context, method=method, max_new_tokens=12)
        assert served.outputs[0].text == ours.text, settings
        assert same_positions(next(iter(vllm_worker.KEPT_POSITIONS.values())), ours.cache), settings
        hit = next(v for k, v in scheduler.hits.items() if k.split("-")[0] == served.request_id)
        prompt_tokens = len(served.prompt_token_ids)
        needed = method.queries_needed(prompt_tokens - start)
        if i == 0 or needed is None:
            assert hit <= 32 * (i == 0), settings
        else:
            assert hit == min(prompt_tokens - needed, cached_blocks(served.prompt_token_ids, sent)), settings
            if method.name == "snapkv":  # the question alone votes (its last window tokens): all before them cached
                assert prompt_tokens - needed == max(start, prompt_tokens - method.window), settings
        sent.append(list(served.prompt_token_ids))


def cached_blocks(prompt: list[int], sent: list[list[int]]) -> int:
    """The tokens of ``prompt`` vLLM's prefix cache holds after ``sent``: the whole blocks it shares with one."""
    shared = max((len(os.path.commonprefix([prompt, earlier])) for earlier in sent), default=0)
    return min(shared, len(prompt) - 1) // 32 * 32


def test_a_repeated_request_keeps_what_it_kept_before_over_its_whole_prefix_hit(engine, library):
    """The same prompt, settings and question start again (a retry; a question asked again of a shared document):
    prefilled from where plain vLLM's prefix cache ends (nothing recomputed for SnapKV's votes), it keeps exactly what
    the first kept, which is what the library keeps, and answers the same; other settings are scored anew."""
    model, tokenizer = library
    opening = f"Read this letter.\n\n{demo.build_document(tokenizer, 900, 0.5)}"  # a prefix no other test sends
    messages = [{"role": "user", "content": f"{opening}\n\n{demo.QUESTION}"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    runs = []
    for settings in (None, None, {"budget": 192}, None):
        vllm_worker.KEPT_POSITIONS.clear()
        served = engine.generate([prompt], sampling([(settings,)]), use_tqdm=False)[0]
        hit = next(v for k, v in scheduler.hits.items() if k.split("-")[0] == served.request_id)
        runs.append((served.outputs[0].text, next(iter(vllm_worker.KEPT_POSITIONS.values())), hit))
    (first, kept, fresh), (again, kept_again, whole), (answer, kept_other, other), (third, kept_third, _) = runs
    ours = kvc.generate(model, tokenizer, messages, method=METHOD, max_new_tokens=12)
    assert first == again == third == ours.text
    assert same_positions(kept, ours.cache) and same_positions(kept_again, ours.cache)
    assert same_positions(kept_third, ours.cache)
    theirs = kvc.generate(model, tokenizer, messages, method=kvc.SnapKV(budget=192), max_new_tokens=12)
    assert answer == theirs.text and same_positions(kept_other, theirs.cache)  # (its hit inside a block)
    prompt_tokens = len(served.prompt_token_ids)
    assert fresh <= 32  # the first: nothing cached yet (the chat template's first block aside)
    assert whole == (prompt_tokens - 1) // 32 * 32  # again: every whole block the prefix cache holds
    assert other == prompt_tokens - METHOD.window < whole  # another budget: its window's queries computed


def test_the_workers_hold_the_choices_the_scheduler_recalls_until_told_to_let_go(engine):
    """The scheduler's ledger holds the most recently used choices, never lets one go while a request is prefilled
    over it, and tells the workers each one it let go once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    ledger = vllm_requests.Recalled(capacity=2)
    ledger.recorded("a")
    ledger.recorded("b")
    assert ledger.recall("r1", "a") and not ledger.recall("r2", "c") and not ledger.recall("r3", None)
    ledger.recorded("c")  # over capacity: b, the least recently used, goes; a is in use
    assert list(ledger.held) == ["a", "c"] and ledger.tell() == ["b"] and ledger.tell() == []
    ledger.recorded("d")
    assert list(ledger.held) == ["a", "d"] and ledger.tell() == ["c"]
    ledger.done(prefilling=set())  # r1's prompt done: a may go
    ledger.recorded("e")
    assert list(ledger.held) == ["d", "e"] and ledger.tell() == ["a"]
    worker = vllm_plugin.KVCompressConnector(engine.llm_engine.vllm_config, KVConnectorRole.WORKER)
    held = dict(vllm_worker.CHOICES)  # (the engine's own, kept for the tests that follow)
    vllm_worker.CHOICES.update({"a": {}, "d": {}})
    try:
        worker.bind_connector_metadata(vllm_requests.StepMethods(requests={}, live=set(), forget=["a", "b"]))
        assert set(vllm_worker.CHOICES) == {*held, "d"}
    finally:
        vllm_worker.CHOICES.clear()
        vllm_worker.CHOICES.update(held)


def test_the_api_servers_middleware_tells_a_chat_where_its_question_begins(monkeypatch):
    """``RequestSettings`` in the API server: a chat completion gets where its conversation after the system message
    begins (``settings.chat_question_start``) in its ``vllm_xargs``; a start a request names is kept; one past its
    prompt is an HTTP 400 naming the field; a request whose method reads no start gets none."""
    import asyncio

    from transformers import AutoTokenizer

    monkeypatch.setenv(
        serving.ENGINE_ENV, json.dumps({**serving.engine_settings(METHOD), "model": str(default_model_dir())})
    )
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    messages = [{"role": "system", "content": "The code is 4817. " * 30}, {"role": "user", "content": "The code?"}]

    def sent(path: str, body: dict) -> tuple[dict | None, list]:
        seen, replies = [], []

        async def app(scope, receive, send):
            seen.append(json.loads((await receive())["body"]))

        async def receive():
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        async def send(message):
            replies.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        asyncio.run(vllm_api.RequestSettings(app)(scope, receive, send))
        return (seen[0] if seen else None), replies

    def xargs(forwarded: dict) -> dict:
        return json.loads(forwarded.get("vllm_xargs", {}).get("kvcompress", "{}"))

    start = serving.chat_question_start(tokenizer, messages, add_generation_prompt=True)
    assert xargs(sent("/v1/chat/completions", {"messages": messages})[0]) == {"question_start": start}
    named = sent("/v1/chat/completions", {"messages": messages, "kvcompress": {"budget": 64, "question_start": 3}})[0]
    assert xargs(named)["question_start"] == 3 and xargs(named)["budget"] == 64
    assert "question_start" not in xargs(
        sent("/v1/chat/completions", {"messages": messages, "kvcompress": {"method": "h2o", "budget": 64}})[0]
    )  # (H2O reads every query)
    assert sent("/v1/completions", {"prompt": "hello there"})[0] == {"prompt": "hello there"}  # (nothing to add)
    forwarded, replies = sent("/v1/completions", {"prompt": "hello there", "kvcompress": {"question_start": 9}})
    assert forwarded is None and replies[0]["status"] == 400
    tokens = len(tokenizer("hello there")["input_ids"])
    refusal = f"kvcompress.question_start=9 is invalid for this prompt of {tokens} tokens; valid: 0 to {tokens - 1}"
    assert refusal in replies[1]["body"].decode()


def test_a_prompt_is_read_back_from_vllms_paged_cache_whatever_its_layout():
    """The kernel's own write of random keys and values into scattered blocks, read back by the plugin: every key
    (transposed, whole blocks at a time or element by element) and the values at chosen positions, exact."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for dtype, heads, size in ((torch.float32, 3, 64), (torch.bfloat16, 2, 128)):
        isa = _get_attn_isa(dtype, 32, size)
        cache = torch.zeros(9, heads, 32, 2 * size, dtype=dtype)
        key_cache, value_cache = cache.view(9, heads, 64, size).chunk(2, dim=2)
        keys, values = torch.randn(2, 70, heads, size).to(dtype)
        blocks = torch.tensor([7, 2, 5], dtype=torch.int32)
        slots = blocks[torch.arange(70) // 32].long() * 32 + torch.arange(70) % 32
        ops.cpu_attn_reshape_and_cache(
            keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
        keys_t = keys.permute(1, 2, 0)  # [heads, size, tokens], as the scorer reads them
        assert torch.equal(vllm_paged.read_keys(cache, blocks, 70, isa), keys_t), (dtype, isa)
        assert torch.equal(vllm_paged.read_keys(cache, blocks, 45, isa), keys_t[..., :45]), (dtype, isa)
        assert vllm_paged.paged_layout(heads, 32, size, dtype, isa) is not None  # (read whole blocks at a time)
        positions = torch.randint(0, 70, (heads, 20))  # each head its own tokens (a compressed prompt's kept values)
        for part, stored in enumerate((keys, values)):
            expected = stored.transpose(0, 1)[torch.arange(heads)[:, None], positions]
            assert torch.equal(vllm_paged.read_at(cache, blocks, positions, isa, part), expected), (dtype, isa)
        with mock.patch.object(vllm_paged, "paged_layout", return_value=None):  # a layout read element by element
            assert torch.equal(vllm_paged.read_keys(cache, blocks, 70, isa), keys_t), (dtype, isa)
            for part, stored in enumerate((keys, values)):
                expected = stored.transpose(0, 1)[torch.arange(heads)[:, None], positions]
                assert torch.equal(vllm_paged.read_at(cache, blocks, positions, isa, part), expected), (dtype, isa)


def served_alike(llm, library, cases: list[tuple]) -> list[dict[str, torch.Tensor]]:
    """Serve ``cases`` (prompt tokens, fact depth, settings) in one batch: each answers as kvcompress.generate answers
    it alone, and a compressed one keeps the positions kvcompress keeps; returns what each compressed request kept."""
    model, tokenizer = library
    conversations = [chat(tokenizer, tokens, depth) for tokens, depth, _ in cases]
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    vllm_worker.KEPT_POSITIONS.clear()
    served = llm.generate(prompts, sampling(cases), use_tqdm=False)
    kept = list(vllm_worker.KEPT_POSITIONS.values())
    for (tokens, _, settings), messages, out in zip(cases, conversations, served):
        method = serving.method_of(settings, default=METHOD)
        ours = kvc.generate(model, tokenizer, messages, method=method, max_new_tokens=12)
        assert out.outputs[0].text == ours.text, (tokens, settings)
        if method.name != "full":
            assert any(same_positions(layers, ours.cache) for layers in kept), settings
    return kept


def sampling(cases: list[tuple]) -> list:
    """Greedy sampling parameters, each case's ``kvcompress`` settings (its last entry) in its extra arguments."""
    return [
        vllm.SamplingParams(max_tokens=12, temperature=0, extra_args=None if s is None else {"kvcompress": s})
        for *_, s in cases
    ]


def same_positions(layers: dict[str, torch.Tensor], cache: kvc.KVCompressCache) -> bool:
    """The positions vLLM kept in every layer (by name) are the ones ``cache`` keeps."""
    return all(
        torch.equal(positions, cache.kept_positions(vllm_worker.layer_index(name))[0])
        for name, positions in layers.items()
    )


FP8_REQUESTS = [
    (None, 0.3),
    ({"method": "full"}, 0.5),
    ({"method": "snapkv", "budget": 64}, 0.7),
    ({"method": "streamingllm", "budget": 128}, 0.2),
    ({"method": "h2o", "budget": 192}, 0.6),
    ({"method": "expected", "budget": 256}, 0.4),
]


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU build holds an fp8 pool only with AVX-512 or AMX",
)
def test_an_fp8_pool_answers_each_request_as_the_library_codes_it(engine, library):
    """--kv-cache-dtype fp8, one engine prefilling 512 tokens a step (each prompt in three chunks, every chunk
    attending the earlier ones as computed), a sequence of requests of their own methods: each keeps the library's
    positions, its first token is the library's (the prompt attends itself as computed), and it answers with the
    library's tokens for the same method with kv_bits=8, kv_format='fp8' (the pool holds each element's nearest
    e4m3 value, where the CPU build's own cast truncates) or leaves them only where the server's own top two
    tokens were a near tie (the two computations differ by ~1e-5 before rounding, which moves an element across
    an fp8 rounding boundary now and then: docs/vllm.md); the same pool bytes hold 4x the float32 pool's blocks."""
    model, tokenizer = library
    coded = vllm.LLM(
        model=str(default_model_dir()),
        **{**ENGINE, "max_num_batched_tokens": 512},
        enable_chunked_prefill=True,
        kv_cache_dtype="fp8",
        **serving.engine_options(METHOD),
    )
    same = 0
    for settings, depth in FP8_REQUESTS:
        messages = chat(tokenizer, 1200, depth)
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        vllm_worker.KEPT_POSITIONS.clear()
        params = vllm.SamplingParams(
            max_tokens=24, temperature=0, logprobs=2, extra_args={"kvcompress": settings} if settings else None
        )
        served = coded.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        method = dataclasses.replace(serving.method_of(settings, default=METHOD), kv_bits=8, kv_format="fp8")
        ours = kvc.generate(model, tokenizer, messages, method=method, max_new_tokens=24)
        for name, positions in next(iter(vllm_worker.KEPT_POSITIONS.values()), {}).items():
            assert torch.equal(positions, ours.cache.kept_positions(vllm_worker.layer_index(name))[0]), (settings, name)
        assert bool(vllm_worker.KEPT_POSITIONS) == (method.name != "full"), settings
        agreed = next((i for i, (a, b) in enumerate(zip(served.token_ids, ours.token_ids[0])) if a != b), None)
        if agreed is None:
            same += 1
            continue
        top_two = sorted((p.logprob for p in served.logprobs[agreed].values()), reverse=True)[:2]
        assert agreed > 0 and top_two[0] - top_two[1] < 0.25, (settings, agreed, top_two)
    assert same >= len(FP8_REQUESTS) - 2 and not vllm_worker.CHUNKS  # none held after
    blocks = [llm.llm_engine.vllm_config.cache_config.num_gpu_blocks for llm in (engine, coded)]
    del coded
    assert blocks[1] == 4 * blocks[0]


def test_prompts_prefilled_in_chunks_are_compressed_after_their_last_chunk(library):
    """vLLM's default, chunked prefill: prompts longer than a step's token budget (512 here) compress
    too, each method keeping exactly what kvcompress keeps from the whole prompt, in a batch beside others."""
    chunked = vllm.LLM(
        model=str(default_model_dir()),
        **{**ENGINE, "max_num_batched_tokens": 512},
        enable_chunked_prefill=True,
        **serving.engine_options(METHOD),
    )
    cases = [
        (1200, 0.3, None),
        (900, 0.6, {"method": "h2o", "budget": 160}),
        (1400, 0.5, {"method": "streamingllm", "budget": 96}),
        (200, 0.5, {"method": "snapkv", "budget": 64, "window": 8}),
        (1100, 0.7, {"method": "expected", "budget": 200}),
    ]
    assert len(served_alike(chunked, library, cases)) == len(cases) and not vllm_worker.CHUNKS  # none held after
    # other budgets: each prompt now finds its blocks in the prefix cache, read back at its last chunk (H2O and
    # ExpectedAttention, which score with every query, take no hit)
    hits = chunked.llm_engine.engine_core.engine_core.scheduler.hits
    rebudgeted = [(*case[:2], {**(case[2] or {}), "budget": (case[2] or {}).get("budget", 256) + 32}) for case in cases]
    before = set(hits)
    assert len(served_alike(chunked, library, rebudgeted)) == len(cases) and not vllm_worker.CHUNKS
    assert sorted(hits[request] > 0 for request in set(hits) - before) == [False] * 2 + [True] * 3
    # the first requests again: each keeps what it kept, over its whole prefix-cache hit, nothing scored
    before = set(hits)
    assert len(served_alike(chunked, library, cases)) == len(cases) and not vllm_worker.CHUNKS
    assert all(hits[request] > 0 for request in set(hits) - before)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_compressed_request_preempted_by_vllm_finishes_with_the_same_tokens(engine, library, chunked):
    """A pool too small for two requests' decoding: vLLM preempts the compressed one (the lower priority), recomputes
    it once the other ends (in one step, or chunked so that its prompt ends a chunk and what it had generated is the
    next), and it finishes with the tokens it gives unpreempted, as does the other."""
    _, tokenizer = library
    cases = [(900, 0.4, {"method": "full"}), (360, 0.5, {"method": "snapkv", "budget": 320})]
    chats = [chat(tokenizer, tokens, depth) for tokens, depth, _ in cases]
    chats[1][0]["content"] = chats[1][0]["content"].replace("Read this document.", "Study this memo.")  # no prefix
    # shared past the chat template's first block: each prompt holds blocks of its own
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    greedy = [
        vllm.SamplingParams(max_tokens=96, temperature=0, ignore_eos=True, extra_args={"kvcompress": s})
        for *_, s in cases
    ]
    lengths = [len(tokenizer(prompt).input_ids) for prompt in prompts]
    room = sum(-(-n // 32) for n in lengths) + 1  # both prompts at once (and vLLM's null block), little to decode in
    steps = {"enable_chunked_prefill": True, "max_num_batched_tokens": lengths[1] // 2} if chunked else {}
    tight = vllm.LLM(
        model=str(default_model_dir()),
        **{**ENGINE, "max_model_len": (room - 1) * 32, **steps},
        num_gpu_blocks_override=room,
        scheduling_policy="priority",
        disable_log_stats=False,
        **serving.engine_options(METHOD),
    )
    preempted = tight.generate(prompts, greedy, priority=[0, 1], use_tqdm=False)
    assert metric(tight, "vllm:num_preemptions") >= 1
    alone = engine.generate(prompts, greedy, use_tqdm=False)
    for case, ours, theirs in zip(cases, preempted, alone):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids, case


def metric(llm, name: str) -> float:
    """A counter or gauge of ``llm``'s metrics, summed over its labels."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def test_a_prompt_prefilled_in_chunks_keeps_them_while_it_holds_blocks(engine):
    """A worker drops a chunked prompt's held chunks when its request holds no blocks (ended or preempted), not when
    it merely skips a step (other requests taking the step's tokens): its last chunk scores the whole prompt."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    worker = vllm_plugin.KVCompressConnector(engine.llm_engine.vllm_config, KVConnectorRole.WORKER)
    held = (0, [(torch.zeros(4, 3, 64), torch.zeros(4, 3, 64), torch.zeros(4, 9, 64))])
    vllm_worker.CHUNKS.update({("a", "layers.0"): held, ("b", "layers.0"): held})
    try:
        worker.bind_connector_metadata(vllm_requests.StepMethods(requests={}, live={"a"}))
        assert set(vllm_worker.CHUNKS) == {("a", "layers.0")}  # a skipped this step, b ended
    finally:
        vllm_worker.CHUNKS.clear()


def test_rows_are_found_by_their_whole_block_rows_and_ties_refused():
    """A compressed request's freed prompt blocks stay in its worker row while others reuse them: a request is the
    row whose blocks, scheduled tokens and length are all its own; a tie left after elimination is refused."""
    info = functools.partial(vllm_requests.Scheduled, '{"method": "snapkv"}', 64, 63, 1, 64)
    table = torch.tensor([[5, 6, 7, 0], [5, 9, 0, 0], [5, 6, 7, 8]])
    step = {"x": info(row=[5, 9]), "y": info(row=[5, 6, 7, 8]), "z": info(row=[5, 6])}
    assert vllm_worker.rows_of(step, table, [1, 1, 1], [64, 64, 64]) == ["z", "x", "y"]  # z: the row left to it
    assert vllm_worker.rows_of({"x": info(row=[5, 9])}, table, [1, 1, 1], [64, 64, 64]) == [None, "x", None]
    with pytest.raises(RuntimeError, match="cannot be told apart"):
        vllm_worker.rows_of({"z": info(row=[5, 6])}, table, [1, 1, 1], [64, 64, 64])


def test_a_request_with_invalid_settings_is_refused_by_name(engine):
    for settings, message in (
        ({"method": "snapkv", "window": 0}, r"kvcompress: SnapKV: window=0 is invalid"),
        ({"method": "kvzip"}, r"method='kvzip' cannot be served by vLLM: it scores from an observation pass"),
        ({"question_start": 50}, r"kvcompress.question_start=50 is invalid for this prompt of \d+ tokens; valid: 0 to"),
    ):
        with pytest.raises(Exception, match=message):
            engine.generate(
                ["hello"], vllm.SamplingParams(max_tokens=2, extra_args={"kvcompress": settings}), use_tqdm=False
            )


def test_kvcompress_serve_answers_the_openai_client_as_the_library_does(library, tmp_path):
    """`kvcompress serve` on 127.0.0.1: chat completions, streaming, requests at once with their own
    methods, a refused setting (HTTP 400, the server serving on), a client that disconnects mid-answer
    (its blocks back in the pool), then SIGINT stops it cleanly."""
    openai = pytest.importorskip("openai")
    model, tokenizer = library
    server = Server(
        ["--budget", "256", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--block-size", "32"],
        tmp_path / "serve.log",
    )
    try:
        base = server.start(400).base
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
        name = client.models.list().data[0].id
        messages = chat(tokenizer, 1200, 0.3)
        ours = kvc.generate(model, tokenizer, messages, method=kvc.SnapKV(budget=256), max_new_tokens=16).text
        ask = functools.partial(client.chat.completions.create, model=name, messages=messages, temperature=0)
        assert ask(max_tokens=16).choices[0].message.content == ours
        assert "".join(chunk.choices[0].delta.content or "" for chunk in ask(max_tokens=16, stream=True)) == ours

        settings = [{"method": "streamingllm", "budget": 128}, {"method": "full"}, {"method": "snapkv", "budget": 64}]
        answers: dict[int, str] = {}

        def ask_with(i: int) -> None:
            answers[i] = ask(max_tokens=16, extra_body={"kvcompress": settings[i]}).choices[0].message.content

        threads = [threading.Thread(target=ask_with, args=(i,)) for i in range(len(settings))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i, setting in enumerate(settings):
            alone = kvc.generate(model, tokenizer, messages, method=serving.method_of(setting), max_new_tokens=16).text
            assert answers[i] == alone, setting

        for bad, message in (
            (
                {"method": "snapkv", "budget": -3},
                r"kvcompress: SnapKV: budget=-3 is invalid; it must be an integer >= 1",
            ),
            (
                {"method": "nope"},
                r"kvcompress.method='nope' is unknown; valid: full, snapkv, streamingllm, h2o, expected",
            ),
        ):
            with pytest.raises(openai.BadRequestError, match=message):
                ask(max_tokens=4, extra_body={"kvcompress": bad})

        stream = ask(max_tokens=400, stream=True)
        for _, _chunk in zip(range(3), stream):
            pass
        stream.close()  # the client disconnects mid-answer
        assert server.idle(), "an aborted request kept its KV blocks"
        assert ask(max_tokens=16).choices[0].message.content == ours  # the server serves on
    finally:
        code = server.stop()
    output = server.output()
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert "leaked" not in output, output[-3000:]  # issue 81.4: no teardown noise after a clean stop


def test_tensor_parallel_workers_each_keep_their_own_heads(tmp_path, monkeypatch):
    """--tensor-parallel-size 2: each worker holds one of a tiny model's two KV heads and keeps that
    head's tokens; the answer is the one worker's and the library's."""
    from .fixtures import CACHE, char_tokenizer, tiny_model

    folder = tmp_path / "tiny"
    model = tiny_model(hidden_size=256, head_dim=64, max_position_embeddings=2048)
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    ids = torch.randint(3, 128, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    method = kvc.SnapKV(budget=64, window=8, clustering="pool")
    cache = method.make_cache(model)
    with torch.no_grad():
        ours = model.generate(torch.tensor([ids]), **{CACHE: cache}, max_new_tokens=8, do_sample=False)[
            0, len(ids) :
        ].tolist()
        full = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    assert ours != full  # the answer shows whether the workers compressed
    answers = []
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (vLLM binds none on one NUMA node)
    for workers in (1, 2):
        llm = vllm.LLM(
            model=str(folder),
            **{**ENGINE, "max_model_len": 1024, "max_num_batched_tokens": 1024},
            tensor_parallel_size=workers,
            **serving.engine_options(method),
        )
        greedy = vllm.SamplingParams(max_tokens=8, temperature=0)
        answers.append(llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0])
        del llm
    assert answers[0].outputs[0].token_ids == answers[1].outputs[0].token_ids == ours


def test_a_method_reading_the_rotary_embedding_is_refused_for_a_model_without_one(tmp_path):
    """ExpectedAttention on a model without RoPE: `kvcompress serve` refuses it at start, and a server of another
    method refuses it per request (HTTP 400), before the engine, which would stop on it, sees the request."""
    import asyncio

    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_head=2, n_embd=32).save_pretrained(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "kvcompress", "serve", str(tmp_path), "--method", "expected"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    why = (
        "method='expected' scores with the model's rotary embedding, and model type 'gpt2': transformers has no "
        "single rotary class for it (no RoPE, or several)"
    )
    with pytest.raises(kvc.InvalidParameterError) as refusal:
        serving.scorable(kvc.ExpectedAttention(), GPT2Config(n_layer=1, n_head=2, n_embd=32))
    assert str(refusal.value) == f"kvcompress: {why}"
    # the last line (importing vLLM's CPU build prints one of its own before it), in the flags' words
    assert (
        done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"kvcompress: error: {in_cli(refusal.value)}"
    )
    assert in_cli(refusal.value).startswith("--method expected scores with")

    os.environ[serving.ENGINE_ENV] = json.dumps({**serving.engine_settings(METHOD), "model": str(tmp_path)})
    try:
        middleware = vllm_api.RequestSettings(app=None)
    finally:
        del os.environ[serving.ENGINE_ENV]
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps({"kvcompress": {"method": "expected"}}).encode()}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(middleware({"type": "http", "method": "POST", "headers": []}, receive, send))
    assert sent[0]["status"] == 400 and json.loads(sent[1]["body"])["error"]["message"] == f"kvcompress: {why}"


def in_cli(refusal: Exception) -> str:
    """A library refusal as `kvcompress serve` prints it: in its flags' words (its options: the server's and every
    method setting)."""
    from kvcompress.cli import in_flag_words
    from kvcompress.methods import METHODS, field_specs

    settings = {spec.name for method in METHODS.values() for spec in field_specs(method)}
    return in_flag_words(refusal, {"model", "method", "host", "port", *settings})


@pytest.mark.parametrize("family", ["qwen3", "phi3-partial-rotary", "gemma2"])
def test_a_family_is_served_as_the_library_compresses_it_or_refused_at_start(family, tmp_path):
    """A tiny model of the family (widened to vLLM's CPU head size), one engine of the full cache, each method a
    request of its own: every method the server takes answers with the library's tokens; a method it refuses on
    the family (Gemma 2's sliding-window layers) is refused by `kvcompress serve` at start, in one line."""
    from .fixtures import CACHE, char_tokenizer, family_model

    model = family_model(family, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    ids = torch.randint(3, 128, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    served, refused, ours = [], [], []
    for method in (kvc.FullKV(), kvc.SnapKV(budget=64, window=8, clustering="pool"), kvc.ExpectedAttention(budget=64)):
        try:
            served.append(serving.scorable(method, model.config))
        except kvc.InvalidParameterError as refusal:
            refused.append((method, refusal))
            continue
        with torch.no_grad():  # before vLLM loads the model (its transformers backend decorates transformers' classes)
            ours.append(
                model.generate(
                    torch.tensor([ids]),
                    **{CACHE: method.make_cache(model, char_tokenizer())},
                    max_new_tokens=8,
                    do_sample=False,
                )[0, len(ids) :].tolist()
            )
    llm = vllm.LLM(
        model=str(tmp_path),
        **{**ENGINE, "max_model_len": 1024, "max_num_batched_tokens": 1024},
        **serving.engine_options(kvc.FullKV()),
    )
    params = [
        vllm.SamplingParams(max_tokens=8, temperature=0, extra_args={"kvcompress": {"method": m.name, **m.settings()}})
        for m in served
    ]
    answers = llm.generate([{"prompt_token_ids": ids}] * len(served), params, use_tqdm=False)
    del llm
    for method, answer, tokens in zip(served, answers, ours):
        assert list(answer.outputs[0].token_ids) == tokens, method.name
    assert (family == "gemma2") == bool(refused) and len(served) + len(refused) == 3
    for method, why in refused[:1]:
        done = subprocess.run(
            [sys.executable, "-m", "kvcompress", "serve", str(tmp_path), "--method", method.name],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"kvcompress: error: {in_cli(why)}"]
