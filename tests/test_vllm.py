"""kvcompress inside vLLM's CPU build (runs only where vLLM is installed: `make vllm`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress import demo, serving, vllm_plugin  # noqa: E402
from kvcompress.models import default_model_dir  # noqa: E402

pytestmark = pytest.mark.skipif(not (default_model_dir() / "model.safetensors").exists(), reason="embedded model not fetched")
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "block_size": 32, "max_num_batched_tokens": 2048}


@pytest.fixture(scope="module")
def library():
    return kvc.load_model()


@pytest.fixture(scope="module")
def engine():
    return vllm.LLM(model=str(default_model_dir()), **ENGINE, **serving.engine_options(kvc.SnapKV(budget=256)))


def chat(tokenizer, tokens: int, depth: float) -> list[dict]:
    return [{"role": "user", "content": f"Read this document.\n\n{demo.build_document(tokenizer, tokens, depth)}\n\n{demo.QUESTION}"}]


def layer_of(name: str) -> int:
    return int(name.split("layers.")[1].split(".")[0])


def test_snapkv_in_vllm_keeps_what_kvcompress_keeps_and_frees_blocks(engine, library):
    model, tokenizer = library
    messages = chat(tokenizer, 1200, 0.3)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    vllm_plugin.KEPT_POSITIONS.clear()
    served = engine.generate([prompt], vllm.SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    ours = kvc.generate(model, tokenizer, messages, method=kvc.SnapKV(budget=256), max_new_tokens=16)
    assert served.outputs[0].text.strip() == ours.text.strip()
    (kept,) = vllm_plugin.KEPT_POSITIONS.values()
    for name, positions in kept.items():
        assert torch.equal(positions, ours.cache.kept_positions(layer_of(name))[0]), name
    blocks = engine.llm_engine.engine_core.engine_core.scheduler.blocks_before_after
    before, after = next(v for k, v in blocks.items() if k.split("-")[0] == served.request_id)  # vLLM suffixes its own ids
    assert before == -(-len(served.prompt_token_ids) // 32) and after == -(-(256 + 16) // 32)  # the prompt's blocks, then what SnapKV keeps


def test_each_request_of_a_batch_gets_its_own_method_and_its_alone_answer(engine, library):
    """One batch: prompts of very different lengths, each with its own method (or the engine's, or none);
    each answers as kvcompress.generate answers it alone, and keeps the positions kvcompress keeps."""
    model, tokenizer = library
    cases = [(1500, 0.6, None), (300, 0.5, {"method": "streamingllm", "budget": 64}), (1000, 0.2, {"method": "h2o", "budget": 192}),
             (700, 0.8, {"method": "full"}), (1200, 0.3, {"method": "snapkv", "budget": 128, "window": 16})]
    conversations = [chat(tokenizer, tokens, depth) for tokens, depth, _ in cases]
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    params = [vllm.SamplingParams(max_tokens=12, temperature=0, extra_args=None if s is None else {"kvcompress": s}) for *_, s in cases]
    vllm_plugin.KEPT_POSITIONS.clear()
    served = engine.generate(prompts, params, use_tqdm=False)
    kept = list(vllm_plugin.KEPT_POSITIONS.values())
    assert len(kept) == 4  # every request compressed but the one that asked for its full cache
    for (tokens, _, settings), messages, out in zip(cases, conversations, served):
        method = serving.method_of(settings, default=kvc.SnapKV(budget=256))
        ours = kvc.generate(model, tokenizer, messages, method=method, max_new_tokens=12)
        assert out.outputs[0].text == ours.text, (tokens, settings)
        if method.name != "full":
            assert any(all(torch.equal(p, ours.cache.kept_positions(layer_of(n))[0]) for n, p in layers.items()) for layers in kept), settings


def test_a_request_with_invalid_settings_is_refused_by_name(engine):
    with pytest.raises(Exception, match=r"kvcompress: SnapKV: window=0 is invalid"):
        engine.generate(["hello"], vllm.SamplingParams(max_tokens=2, extra_args={"kvcompress": {"method": "snapkv", "window": 0}}), use_tqdm=False)
    with pytest.raises(Exception, match=r"method='kvzip' cannot be served by vLLM: it scores from an observation pass"):
        engine.generate(["hello"], vllm.SamplingParams(max_tokens=2, extra_args={"kvcompress": {"method": "kvzip"}}), use_tqdm=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_kvcompress_serve_answers_the_openai_client_as_the_library_does(library, tmp_path):
    """`kvcompress serve` on 127.0.0.1: chat completions, streaming, requests at once with their own
    methods, a refused setting (HTTP 400, the server serving on), a client that disconnects mid-answer
    (its blocks back in the pool), then SIGINT stops it cleanly."""
    openai = pytest.importorskip("openai")
    model, tokenizer = library
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    server = subprocess.Popen([sys.executable, "-m", "kvcompress", "serve", "--budget", "256", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "2048", "--enforce-eager", "--block-size", "32"], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while not healthy(base):
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        name = client.models.list().data[0].id
        messages = chat(tokenizer, 1200, 0.3)
        ours = kvc.generate(model, tokenizer, messages, method=kvc.SnapKV(budget=256), max_new_tokens=16).text
        answer = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0)
        assert answer.choices[0].message.content == ours
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == ours

        settings = [{"method": "streamingllm", "budget": 128}, {"method": "full"}, {"method": "snapkv", "budget": 64}]
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            reply = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0, extra_body={"kvcompress": settings[i]})
            answers[i] = reply.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(settings))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i, setting in enumerate(settings):
            alone = kvc.generate(model, tokenizer, messages, method=serving.method_of(setting), max_new_tokens=16).text
            assert answers[i] == alone, setting

        with pytest.raises(openai.BadRequestError, match=r"kvcompress: SnapKV: budget=-3 is invalid; it must be an integer >= 1"):
            client.chat.completions.create(model=name, messages=messages, max_tokens=4, extra_body={"kvcompress": {"method": "snapkv", "budget": -3}})
        with pytest.raises(openai.BadRequestError, match=r"kvcompress.method='nope' is unknown; valid: full, snapkv, streamingllm, h2o"):
            client.chat.completions.create(model=name, messages=messages, max_tokens=4, extra_body={"kvcompress": {"method": "nope"}})

        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=400, temperature=0, stream=True)
        for _, _chunk in zip(range(3), stream):
            pass
        stream.close()  # the client disconnects mid-answer
        deadline = time.monotonic() + 30
        while metric(base, "vllm:num_requests_running") or metric(base, "vllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "an aborted request kept its KV blocks"
            time.sleep(0.5)
        assert client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0).choices[0].message.content == ours
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=60)
        finally:
            server.kill()
            log.close()
    output = (tmp_path / "serve.log").read_text()
    assert code == 0 and "Traceback" not in output, output[-3000:]


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def metric(base: str, name: str) -> float:
    """A gauge from vLLM's Prometheus endpoint (summed over its labels)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{") or line.startswith(name + " "))
