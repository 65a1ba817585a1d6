"""kvcompress's SnapKV inside vLLM's CPU build (runs only where vLLM is installed: `make vllm`)."""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress import demo, vllm_plugin  # noqa: E402
from kvcompress.models import default_model_dir  # noqa: E402

pytestmark = pytest.mark.skipif(not (default_model_dir() / "model.safetensors").exists(), reason="embedded model not fetched")


def test_snapkv_in_vllm_keeps_what_kvcompress_keeps_and_frees_blocks():
    llm = vllm.LLM(model=str(default_model_dir()), dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32,
                   enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=2048, scheduler_cls="kvcompress.vllm_plugin.SnapKVScheduler",
                   additional_config={"kvcompress": {"budget": 256}})
    model, tokenizer = kvc.load_model()
    messages = [{"role": "user", "content": f"Read this document.\n\n{demo.build_document(tokenizer, 1200, 0.3)}\n\n{demo.QUESTION}"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    vllm_plugin.KEPT_POSITIONS.clear()
    served = llm.generate([prompt], vllm.SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    ours = kvc.generate(model, tokenizer, messages, method=kvc.SnapKV(budget=256), max_new_tokens=16)
    assert served.outputs[0].text.strip() == ours.text.strip()
    (kept,) = vllm_plugin.KEPT_POSITIONS.values()
    for name, positions in kept.items():
        layer = int(name.split("layers.")[1].split(".")[0])
        assert torch.equal(positions, ours.cache.kept_positions(layer)[0]), name
    blocks = llm.llm_engine.engine_core.engine_core.scheduler.blocks_before_after
    before, after = next(v for k, v in blocks.items() if k.split('-')[0] == served.request_id)  # vLLM suffixes its own ids
    prompt_tokens = len(served.prompt_token_ids)
    assert before == -(-prompt_tokens // 32) and after == -(-(256 + 16) // 32)  # the prompt's blocks, then only what SnapKV keeps
