"""What serving through vLLM needs without vLLM: servable methods, a request's settings, the server's command line."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import types

import pytest
import torch

import kvcompress as kvc
from kvcompress.integrations.transformers.attach import layer_windows
from kvcompress.integrations.transformers.models import default_model_dir
from kvcompress.methods.eviction import EvictionPolicy
from kvcompress.methods.fields import InvalidParameterError
from kvcompress.serving import launch
from kvcompress.serving import settings as serving

from .fixtures import FAMILIES, char_tokenizer, family_model, prefilled_cache, random_text, tiny_model


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "snapkv", "budget": -3}, r"^kvcompress: SnapKV: budget=-3 is invalid; it must be an integer >= 1"),
        (
            {"method": "nope"},
            r"^kvcompress.method='nope' is unknown; valid: full, snapkv, streamingllm, h2o, expected$",
        ),
        ({"method": 7}, r"^kvcompress.method=7 is invalid; valid: full, snapkv, streamingllm, h2o, expected$"),
        ({"method": "snapkv", "windows": 8}, r"^kvcompress: method 'snapkv' does not take windows; served: .*window"),
        (
            {"method": "kvzip"},
            r"method='kvzip' cannot be served by vLLM: it scores from an observation pass .*; servable: full, snapkv",
        ),
        (
            {"method": "snapkv", "heads": "adaptive"},
            r"SnapKV: heads='adaptive' cannot be served by vLLM .*; valid: 'uniform'",
        ),
        ({"method": "h2o", "evict_during_decoding": True}, r"H2O: evict_during_decoding=True cannot be served by vLLM"),
        (
            {"method": "snapkv", "decode_budget": 512},
            r"SnapKV: decode_budget=512 cannot be served by vLLM: kvcompress.s plugin selects ",
        ),
        (
            {"method": "snapkv", "kv_bytes": 0.015625},
            r"^kvcompress: SnapKV: kv_bytes=0\.015625 cannot be served by vLLM \(its pool holds every request in one "
            r"dtype, "
            r"the same count per KV head and layer\); valid: budget or ratio$",
        ),
        ("snapkv", r"^kvcompress must be an object such as \{\"method\": \"snapkv\", \"budget\": 256\}; got 'snapkv'$"),
    ],
)
def test_a_requests_bad_settings_are_refused_naming_the_field(settings, message):
    with pytest.raises(InvalidParameterError, match=message):
        serving.method_of(settings, default=kvc.SnapKV())


def test_an_unknown_field_lists_only_the_fields_a_request_can_set():
    """Issue 68.9: the 400 for an unknown field never offers a field the server refuses."""
    with pytest.raises(InvalidParameterError) as refused:
        serving.method_of({"method": "snapkv", "budgte": 64})
    assert "budget" in str(refused.value) and "decode_budget" not in str(refused.value)
    assert not any(field in str(refused.value) for field in serving.NOT_SERVED)


def test_an_fp8_pool_takes_the_settings_that_say_what_it_stores():
    """Issue 68.9: on a server started with --kv-cache-dtype fp8, kv_bits=8 with kv_format='fp8' is what the pool
    stores (taken, the pool writing the codes); other bits are refused naming both valid forms; elsewhere fp8 is
    refused naming the flag that gives it."""
    fp8 = {"kv_bits": 8, "kv_format": "fp8"}
    assert serving.method_of(fp8, kvc.SnapKV(budget=64), "fp8") == kvc.SnapKV()  # (its fields, not the engine's)
    assert serving.method_of({"method": "h2o", **fp8}, None, "fp8_e4m3") == kvc.H2O()
    with pytest.raises(InvalidParameterError, match=r"pool is fp8: .*valid: 16, or kv_bits=8 with kv_format='fp8'"):
        serving.method_of({"kv_bits": 4}, kvc.SnapKV(), "fp8")
    with pytest.raises(
        InvalidParameterError,
        match=r"kv_bits=8 cannot be served per request \(with kv_format='fp8': .*--kv-cache-dtype fp8"
        r".*valid: 16\)$",
    ):
        serving.method_of(fp8, kvc.SnapKV())


def test_a_requests_settings_name_its_method_or_take_the_engines():
    engine = kvc.SnapKV(budget=512)
    assert serving.method_of(None, default=engine) is engine
    assert serving.method_of({}, default=engine) is engine  # an empty object names nothing: not SnapKV's defaults
    # the engine's method, its own budget
    assert serving.method_of({"budget": 128}, default=engine) == kvc.SnapKV(budget=128)
    assert serving.method_of({"method": "streamingllm", "budget": 64}) == kvc.StreamingLLM(budget=64)
    assert serving.method_of({"method": "full"}) == kvc.FullKV()


def test_the_server_command_line_carries_the_plugin_and_the_engines_method():
    argv = launch.serve_argv("/models/m", kvc.H2O(budget=300), "127.0.0.1", 8123, ["--max-model-len", "4096"])
    flags = {
        flag: argv[i + 1]
        for i, flag in enumerate(argv[:-1])
        if flag.startswith("--") and not argv[i + 1].startswith("--")
    }
    assert flags["--model"] == "/models/m" and flags["--port"] == "8123" and flags["--max-model-len"] == "4096"
    assert flags["--scheduler-cls"] == serving.SCHEDULER and flags["--middleware"] == serving.MIDDLEWARE
    assert json.loads(flags["--kv-transfer-config"]) == serving.CONNECTOR
    assert serving.method_of(json.loads(flags["--additional-config"])["kvcompress"]) == kvc.H2O(budget=300)
    # vLLM's defaults stay: chunked prefill and prefix caching compress too
    assert not {"--no-enable-prefix-caching", "--no-enable-chunked-prefill"} & set(argv)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcompress", *args], capture_output=True, text=True, timeout=120)


def test_kvcompress_serve_refuses_what_it_cannot_serve_before_starting_anything():
    done = cli("serve", "--method", "kvzip")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "kvcompress: error: --method kvzip cannot be served by vLLM: it scores from an observation pass (the model "
        "repeating the prompt) "
        "that vLLM does not run; servable: full, snapkv, streamingllm, h2o, expected"
    ]
    done = cli("serve", "--budget", "0")
    assert done.returncode == 2 and "SnapKV: --budget 0 is invalid; it must be an integer >= 1" in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_kvcompress_serve_without_vllm_says_how_to_get_it():
    done = cli("serve", "--budget", "256")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "kvcompress: error: kvcompress serve runs vLLM's server, and vLLM is not installed here: `make vllm` builds "
        ".venv-vllm with "
        "vLLM's CPU build; then run .venv-vllm/bin/kvcompress serve"
    ]


def test_the_server_drops_only_the_engine_dead_error_of_its_own_stop():
    """vLLM's API server, stopping, may log its stopped engine as dead (a traceback, though nothing failed):
    `kvcompress serve` drops that record after the stop is triggered, and keeps every other error."""

    class EngineDeadError(Exception):  # the name vLLM's error has; vLLM itself is not installed here
        pass

    def record(logger: str, message: str, error: Exception | None = None) -> logging.LogRecord:
        exc_info = (type(error), error, None) if error else None
        return logging.LogRecord(logger, logging.ERROR, __file__, 1, message, None, exc_info)

    quiet = launch.QuietStop()
    launcher, engine = launch.QuietStop.LOGGERS
    dead = record(engine, "AsyncLLM output_handler failed.", EngineDeadError())
    assert quiet.filter(dead)  # before a stop: the engine did die, and says so
    assert quiet.filter(record(launcher, "[shutdown] API server: shutdown triggered"))
    assert not quiet.filter(dead)
    assert quiet.filter(record(engine, "AsyncLLM output_handler failed.", RuntimeError("boom")))  # another error


def test_a_method_reading_the_rotary_embedding_needs_a_model_with_one():
    from transformers import GPT2Config, LlamaConfig

    assert serving.scorable(kvc.ExpectedAttention(), LlamaConfig()).name == "expected"
    assert serving.scorable(kvc.SnapKV(), GPT2Config()).name == "snapkv"
    assert serving.scorable(kvc.ExpectedAttention(), None).name == "expected"  # unknown model: the workers check
    with pytest.raises(
        InvalidParameterError,
        match=r"^kvcompress: method='expected' scores with the model's rotary "
        r"embedding, and model type 'gpt2': transformers has no single rotary class for it \(no RoPE, or several\)$",
    ):
        serving.scorable(kvc.ExpectedAttention(), GPT2Config())


SERVED = [
    kvc.FullKV(),
    kvc.SnapKV(budget=32, window=8),
    kvc.StreamingLLM(budget=32),
    kvc.H2O(budget=32),
    kvc.ExpectedAttention(budget=32),
]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_server_serves_each_family_or_refuses_it_in_one_line(family):
    """What the server decides from a model's config alone, against what the library finds on the model itself:
    a method the library refuses on the family is refused by the server too; a compressing method on a model with
    sliding-window layers (as its attention modules use them) is refused; everything else is served."""
    model = family_model(family)
    sliding = [index for index, window in enumerate(layer_windows(model)) if window is not None]
    assert serving.sliding_layers(model.config) == sliding
    for method in SERVED:
        try:
            method.make_cache(model, char_tokenizer())
            library = None
        except kvc.UnsupportedModelError as refused:
            library = str(refused)
        try:
            serving.scorable(method, model.config)
            served = None
        except InvalidParameterError as refused:
            served = str(refused)
        compressing = method.name != "full"
        assert (served is not None) == (library is not None or (compressing and bool(sliding))), (
            method.name,
            library,
            served,
        )
        if served is not None:
            kind = model.config.get_text_config().model_type
            assert (
                "\n" not in served and served.startswith(f"kvcompress: method={method.name!r}") and repr(kind) in served
            )
            assert ("sliding-window layers" in served) == (compressing and bool(sliding)), served  # the first reason
    assert serving.scorable(kvc.FullKV(), model.config) == kvc.FullKV()  # every family is served its full cache


def test_the_vllm_family_table_is_the_servers_decisions():
    """docs/vllm.md's family table is scripts/vllm_families.py's rendering of docs/img/vllm_families.json; each
    refusal in it is the one `serving.scorable` makes from the family's config; every other cell served vLLM the
    library's tokens (or is vLLM's own refusal, never a difference)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("vllm_families", root / "scripts/vllm_families.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    table = json.loads((root / "docs/img/vllm_families.json").read_text())
    assert script.markdown(table) in (root / "docs/vllm.md").read_text() and set(table) == set(FAMILIES)
    for family, row in table.items():
        config = family_model(family, **script.WIDE).config
        for name, method in script.methods().items():
            try:
                serving.scorable(method, config)
                refusal = None
            except InvalidParameterError as refused:
                refusal = "refused: " + str(refused).split(": ", 1)[1]
            outcome = row[name]
            assert outcome == refusal if refusal else outcome == "same" or outcome.startswith("vLLM: "), (
                family,
                name,
                outcome,
            )


GIB = launch.GiB


def test_the_server_is_sized_to_the_memory_that_is_free():
    """vLLM's CPU build reserves 0.92 of the memory node by default and refuses to start (in its worker, a wall of
    tracebacks) where other processes hold memory; `kvcompress serve` reserves what is free but room for vLLM's
    other processes and 10% to spare."""
    total, free = int(14.21 * GIB), int(11.72 * GIB)  # the machine of issue 38
    flags = launch.memory_flags([], total, free, {})
    assert flags == ["--gpu-memory-utilization", "0.63"]
    reserved = 0.63 * total
    assert reserved <= free - launch.SERVER_PROCESSES and reserved >= 0.8 * (free - launch.SERVER_PROCESSES)
    assert launch.memory_flags([], 24 * GIB, 23 * GIB, {}) == ["--gpu-memory-utilization", "0.80"]
    assert launch.memory_flags([], 100 * GIB, 99 * GIB, {}) == ["--gpu-memory-utilization", "0.87"]


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (
            ["--gpu-memory-utilization", "0.92"],
            {},
            r"^--gpu-memory-utilization 0.92 reserves 13.1 GiB and 11.7 GiB of this machine's 14.2 GiB are free; "
            r"pass --gpu-memory-utilization 0.63, or --kv-cache-memory-bytes 4G, or leave both out$",
        ),
        (
            ["--kv-cache-memory-bytes=12G"],
            {},
            r"^--kv-cache-memory-bytes 12G asks for 12.0 GiB of KV cache and 11.7 GiB of this machine's 14.2 GiB are "
            r"free; "
            r"give at most --kv-cache-memory-bytes 10G, or leave it out to size it from the free memory$",
        ),
        (
            ["--kv-cache-memory-bytes", "4G"],
            {"VLLM_CPU_KVCACHE_SPACE": "16"},  # vLLM takes the environment's
            r"^VLLM_CPU_KVCACHE_SPACE=16 asks for 16.0 GiB of KV cache and 11.7 GiB of this machine's 14.2 GiB are "
            r"free; "
            r"set VLLM_CPU_KVCACHE_SPACE to at most 10, or leave it out to size it from the free memory$",
        ),
    ],
)
def test_a_reservation_that_cannot_fit_is_refused_in_one_line_saying_what_fits(flags, env, message):
    parse = lambda text: int(text.rstrip("G")) * GIB  # noqa: E731 (vLLM's reading of "12G", for this test)
    with pytest.raises(InvalidParameterError, match=message):
        launch.memory_flags(flags, int(14.21 * GIB), int(11.72 * GIB), env, parse)


def test_the_server_runs_in_the_librarys_precision_on_a_cpu_unless_told():
    assert launch.dtype_flags([], on_cpu=True) == ["--dtype", "float32"]
    assert launch.dtype_flags(["--dtype", "bfloat16"], on_cpu=True) == []
    assert launch.dtype_flags(["--dtype=auto"], on_cpu=True) == []
    assert launch.dtype_flags([], on_cpu=False) == []  # (a GPU: vLLM's own)


def test_a_reservation_that_fits_is_kept_as_given():
    for flags, env in (
        (["--gpu-memory-utilization", "0.5"], {}),
        (["--device-memory-utilization=0.5"], {}),
        (["--kv-cache-memory-bytes", "4G"], {}),
        ([], {"VLLM_CPU_KVCACHE_SPACE": "2"}),
    ):
        assert launch.memory_flags(flags, 14 * GIB, 12 * GIB, env, lambda text: 4 * GIB) == [], flags


def test_too_little_free_memory_is_refused_in_one_line():
    with pytest.raises(
        InvalidParameterError,
        match=r"^kvcompress serve needs about 2 GiB for the model and its KV cache "
        r"and 2.5 GiB of this machine's 16.0 GiB are free; pass --kv-cache-memory-bytes",
    ):
        launch.memory_flags([], 16 * GIB, int(2.5 * GIB), {})


@pytest.mark.parametrize("name", [name for name in serving.SERVABLE if name != "full"])
def test_a_workers_prompt_is_scored_as_the_library_scores_its_layer(name, monkeypatch):
    """The vLLM worker hands a method only ``PromptLayer`` (one request's keys, values, spans and rotary): each
    servable method scores it as it scores the library's own layer holding the same prompt."""
    method = kvc.method_from_name(name, budget=48)
    seen = scored_layers(monkeypatch)
    prefilled_cache(method, 90)
    assert len(seen) == 2  # each layer of the tiny model
    for layer, query, scaling, scores in seen:
        prompt = serving.PromptLayer(layer.keys, layer.values, layer.spans, layer.rotary)
        torch.testing.assert_close(method.layer_scores(prompt, query, scaling), scores, rtol=0, atol=0)


def scored_layers(monkeypatch) -> list[tuple]:
    """What the library's layers are scored from, recorded as they compress: each layer (a copy of what a method
    reads of it), its queries, scaling and scores."""
    seen = []
    library_scores = EvictionPolicy.prompt_scores

    def recording(policy, query, scaling):
        scores, layer = library_scores(policy, query, scaling), policy.layer
        read = types.SimpleNamespace(
            keys=layer.keys.clone(),
            values=layer.values.clone(),
            spans=layer.spans,
            rotary=layer.rotary,
            asked=layer.asked,
        )
        seen.append((read, query, scaling, scores))
        return scores

    monkeypatch.setattr(EvictionPolicy, "prompt_scores", recording)
    return seen


def test_a_workers_question_votes_with_its_own_tokens_as_over_a_stored_context(monkeypatch):
    """A request that says where its question begins: the worker's ``PromptLayer`` with those tokens (``asked``) and
    only their queries scores as the library's layer scores the same question over a stored context."""
    model, tokenizer = tiny_model(), char_tokenizer()
    store = kvc.compress(model, tokenizer, random_text(200, seed=4), method=kvc.FullKV())
    seen = scored_layers(monkeypatch)
    method = kvc.SnapKV(budget=48, window=24)
    kvc.generate(model, tokenizer, " and a question?", past=store, method=method, max_new_tokens=1)
    assert len(seen) == 2
    for layer, query, scaling, scores in seen:
        voters = method.queries_needed(int(layer.asked))
        assert 0 < voters == int(layer.asked) < 24  # (the question is shorter than the window: its tokens alone vote)
        prompt = serving.PromptLayer(layer.keys, layer.values, layer.spans, None, layer.asked)
        own = method.layer_scores(prompt, query[..., -voters:, :], scaling)
        torch.testing.assert_close(own, scores, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"question_start": -1}, r"^kvcompress.question_start=-1 is invalid; it must be an integer >= 0 \(the prompt "),
        ({"question_start": "12"}, r"^kvcompress.question_start='12' is invalid; it must be an integer >= 0"),
        ({"question_start": True}, r"^kvcompress.question_start=True is invalid"),
    ],
)
def test_a_bad_question_start_is_refused_naming_the_field(settings, message):
    with pytest.raises(InvalidParameterError, match=message):
        serving.question_start_of(settings)


def test_a_question_start_is_taken_out_of_the_settings_and_checked_against_the_prompt():
    assert serving.question_start_of({"method": "snapkv", "question_start": 7}) == ({"method": "snapkv"}, 7)
    assert serving.question_start_of({"budget": 64}) == ({"budget": 64}, None)
    assert serving.question_start_of(None) == (None, None)
    serving.check_question_start(9, 10)
    with pytest.raises(
        InvalidParameterError,
        match=r"^kvcompress.question_start=10 is invalid for this prompt of 10 "
        r"tokens; valid: 0 to 9 \(a question of at least one token\)$",
    ):
        serving.check_question_start(10, 10)


def content_start(tokens: list[int], content: list[int]) -> int:
    """Where ``content``'s tokens first appear in ``tokens`` (an independent reference for a message's start)."""
    return next(i for i in range(len(tokens)) if tokens[i : i + len(content)] == content)


@pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").exists(), reason="no embedded model")
def test_a_chats_question_starts_where_its_conversation_after_the_system_message_does():
    """The server's question start for a chat: the first token of the first message after the system messages, as
    the rendered prompt tokenizes it (found by the message's own tokens in the prompt's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    document, question = "The archive room's code is 4817. " * 20, "What is the code of the archive room?"

    def rendered(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    system = [{"role": "system", "content": document}, {"role": "user", "content": question}]
    joined = [{"role": "user", "content": f"{document}\n\n{question}"}]
    turns = [*system, {"role": "assistant", "content": "It is 4817."}, {"role": "user", "content": "Thanks. Why?"}]
    for messages, first in ((system, question), (joined, document), (turns, question)):
        tokens, start = rendered(messages), serving.chat_question_start(tokenizer, messages, add_generation_prompt=True)
        assert start == content_start(tokens, tokenizer(first, add_special_tokens=False)["input_ids"][:4])
    assert len(rendered(system)) - serving.chat_question_start(tokenizer, system, add_generation_prompt=True) < 32
    assert serving.chat_question_start(tokenizer, [{"role": "system", "content": document}]) is None
    parts = [{"role": "user", "content": [{"type": "text", "text": question}]}]
    assert serving.chat_question_start(tokenizer, parts) is None


@pytest.mark.parametrize(
    ("pool", "family", "message"),
    [
        (None, "gemma2", None),
        ("auto", "gpt-oss", None),
        ("fp8", "llama", None),
        ("fp8_e4m3", "qwen3", None),
        (
            "fp8",
            "gemma2",
            r"^--kv-cache-dtype fp8 cannot be served with kvcompress on model type 'gemma2': it has "
            r"sliding-window layers and soft-capped attention scores, which .*; valid: auto$",
        ),
        ("fp8", "gpt-oss", r"model type 'gpt_oss': it has sliding-window layers and learned attention sinks"),
        (
            "fp8_e5m2",
            "llama",
            r"^--kv-cache-dtype fp8_e5m2 cannot be served with kvcompress: kvcompress's fp8 is e4m3 "
            r"\(vLLM's fp8\); valid: auto, fp8, fp8_e4m3$",
        ),
        ("int8", "llama", r"^--kv-cache-dtype int8 cannot be served with kvcompress: .*; valid: auto, fp8, fp8_e4m3$"),
    ],
)
def test_a_servers_cache_dtype_is_served_or_refused_in_one_line(pool, family, message):
    config = family_model(family).config
    if message is None:
        serving.check_pool(pool, config)
    else:
        with pytest.raises(InvalidParameterError, match=message):
            serving.check_pool(pool, config)


def test_kvcompress_serve_refuses_a_cache_dtype_before_starting_anything():
    done = cli("serve", "--budget", "256", "--kv-cache-dtype", "fp8_e5m2")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "kvcompress: error: --kv-cache-dtype fp8_e5m2 cannot be served with kvcompress: kvcompress's fp8 is e4m3 "
        "(vLLM's fp8); valid: auto, fp8, fp8_e4m3"
    )


@pytest.mark.parametrize(
    ("method", "asked"),
    [
        (kvc.SnapKV(budget=40, window=12), [5, 12, 30]),
        (kvc.SnapKV(budget=40, window=12), None),
        (kvc.SnapKV(budget=40, window=12, clustering="pool", votes="sum", pooling="max"), [3, 9, 12]),
        (kvc.StreamingLLM(budget=40), None),
        (kvc.H2O(budget=40), None),
    ],
)
def test_a_steps_prompts_sharing_a_method_are_kept_as_each_alone(method, asked):
    """The worker chooses what the prompts a step finishes with one method keep together, right-aligned: each keeps
    what it keeps alone (prompts of different lengths, questions of different lengths), its keys and values partly
    read back from the pool, as the worker holds them."""
    from kvcompress.serving.scoring import Finishing, PromptKeys, PromptValues, kept_together

    torch.manual_seed(5)
    prompts = []
    for row, tokens in enumerate((90, 61, 75)):
        needed = method.queries_needed(None if asked is None else asked[row])
        queries = torch.randn(tokens if needed is None else needed, 4, 16)
        spans = torch.arange(tokens)[None] // 3 if method.needs_tokens() else None
        values, cached = torch.randn(tokens, 2, 16), 20 * row
        from_pool = PromptValues(
            cached, values[cached:], lambda at, v=values: v.transpose(0, 1)[torch.arange(2)[:, None], at]
        )
        keys = torch.randn(2, 16, tokens)  # [kv_heads, dim, tokens]: the first ``cached`` read back, as a worker does
        held = PromptKeys(cached, keys[..., cached:].permute(2, 0, 1), keys[..., :cached] if cached else None)
        assert torch.equal(held.joined(), keys.transpose(1, 2))
        prompts.append(Finishing(held, from_pool, queries, spans, None if asked is None else asked[row], 40))
        assert torch.equal(from_pool.whole(), values.transpose(0, 1))
    together = kept_together(method, prompts, 0.25, None)
    for prompt, kept in zip(prompts, together):
        (alone,) = kept_together(method, [prompt], 0.25, None)
        assert kept.shape == (2, 40) and torch.equal(kept, alone)


def test_a_workers_held_prefix_serves_the_questions_after_it_until_a_write_reaches_its_blocks():
    """``HeldPrefixes`` in a worker: a prefix-cache hit's keys are read back once, then every question over the same
    blocks, in later steps and several in one step, lays its own keys out in the held room when it is scored
    (nothing read, nothing copied) and reads its kept keys from its parts after the next one took the room; a question
    longer than the room gets more; a write into any of the blocks, and only such a write, has them read again; a
    prompt over a prefix the layer no longer holds, or one past its share of the pool, is joined in a new tensor, read
    once a step. Every prompt's keys are its prefix's then its own."""
    from kvcompress.serving.prompt_keys import POOL_SHARE, ROOM, HeldPrefixes
    from kvcompress.serving.scoring import PromptKeys

    document = torch.randn(3, 8, 64)  # [kv_heads, head_size, tokens]: 64 tokens in blocks 7 and 9 (32 each)
    reads: list[int] = []

    def read():
        reads.append(1)
        return document.clone()

    def prompts(held, *lengths, step=None, pool=1 << 30, blocks=(7, 9)):
        step = {} if step is None else step
        found = [held.prefix("layer.0", blocks, 64, read, step, pool) for _ in lengths]
        return [PromptKeys(64, torch.randn(n, 3, 8), *parts) for n, parts in zip(lengths, found)]

    def whole(keys):
        return torch.cat([document, keys.computed.permute(1, 2, 0)], dim=-1).transpose(1, 2)

    def scored(keys):  # (as the worker scores a step's prompts: each joined, then read, one after another)
        joined = keys.joined()
        torch.testing.assert_close(joined, whole(keys), rtol=0, atol=0)
        return joined

    held = HeldPrefixes()
    (first,) = prompts(held, 5)
    assert scored(first).data_ptr() == held.held["layer.0"].keys.data_ptr() and len(reads) == 1
    burst = prompts(held, 9, 4, ROOM + 10)
    views = [scored(keys) for keys in burst]
    assert len(reads) == 1 and views[0].data_ptr() == views[1].data_ptr()  # (the same room, one after another)
    positions = torch.tensor([[0, 63, 64, 66], [5, 40, 64, 67], [1, 2, 3, 65]])
    for keys in burst:  # kept keys read from the parts, whoever holds the room now
        torch.testing.assert_close(keys.at(positions), whole(keys)[torch.arange(3)[:, None], positions])
    held.forget("layer.0", torch.tensor([-1, 3 * 32 + 5]), 32)  # (a padding slot, and block 3: not one of its own)
    scored(*prompts(held, 2))
    assert len(reads) == 1
    held.forget("layer.0", torch.tensor([9 * 32 + 31]), 32)
    scored(*prompts(held, 2))
    assert len(reads) == 2
    step: dict = {}
    (other,) = prompts(held, 3, step=step)
    prompts(held, 3, step=step, blocks=(7, 10))  # another document in the same step: held in its place
    assert len(reads) == 3 and scored(other).data_ptr() != held.held["layer.0"].keys.data_ptr()
    small_pool = 3 * 8 * (64 + ROOM) * 4 * POOL_SHARE - 1
    step = {}
    for keys in prompts(held, 2, 6, step=step, pool=small_pool):
        scored(keys)
    assert len(reads) == 4 and "layer.0" not in held.held
