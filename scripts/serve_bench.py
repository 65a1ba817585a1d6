"""What serving compressed caches buys: `kvcompress serve` with a fixed KV pool, many concurrent
long-prompt requests, each setting chosen per request (the full cache, SnapKV, StreamingLLM).

    .venv-vllm/bin/python scripts/serve_bench.py          # 32 requests of ~2K tokens, 256 tokens each answer
    .venv-vllm/bin/python scripts/serve_bench.py --tokens 3900 --max-tokens 32 --pool-prompts 4   # prefill-bound
    .venv-vllm/bin/python scripts/serve_bench.py --requests 4 --tokens 1000 --pool-prompts 2   # quick (make vllm)

One server as a user starts it (vLLM's compiled graph and chunked prefill; the embedded model,
float32, block size 32, a pool of ``--pool-prompts`` uncompressed prompts and answers' blocks); for
each setting, every request is sent at once through the official ``openai`` client, streamed, each
answer ``--max-tokens`` long (``ignore_eos``, as vLLM's own serving benchmark does, so that decoding
is the same work in every setting): requests running at once (vLLM's own gauge, polled), output
tokens/s over the whole run, time to first token and per output token (p50/p99), and facts answered
(each request buries its own access code). Results: ``--out`` (JSON) and a PNG beside it; a table is
printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import torch
import transformers
import vllm

from kvcompress import demo
from kvcompress.integrations.transformers.models import default_model_dir
from kvcompress.serving import launch

SETTINGS = {
    "full": {"method": "full"},
    "snapkv 256": {"method": "snapkv", "budget": 256},
    "snapkv 512": {"method": "snapkv", "budget": 512},
    "streamingllm 512": {"method": "streamingllm", "budget": 512},
}
DEFAULT_SETTINGS = "full,snapkv 256,snapkv 512"
BLOCK = 32


def prompts(count: int, tokens: int, seed: int) -> list[tuple[list[dict], str]]:
    """``count`` chats of about ``tokens`` tokens, each with its own access code buried at its own depth."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    rng = random.Random(seed)
    chats = []
    for i in range(count):
        code = str(rng.randrange(1000, 10000))
        document = demo.build_document(tokenizer, tokens, (i + 0.5) / count).replace(demo.ANSWER, code)
        chats.append(([{"role": "user", "content": f"Read this document.\n\n{document}\n\n{demo.QUESTION}"}], code))
    return chats


def start_server(port: int, pool_blocks: int, max_len: int, requests: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "kvcompress",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        str(max_len),
        "--num-gpu-blocks-override",
        str(pool_blocks),
        "--max-num-seqs",
        str(requests),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    return launched(command, env, port, log)


def launched(command: list[str], env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    """A server process started with ``command``, once it answers its health check on ``port`` (its output in
    ``log``)."""
    server = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while not launch.ready(f"http://127.0.0.1:{port}"):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start; its log: {log}")
        time.sleep(2)
    return server


async def one(client: openai.AsyncOpenAI, model: str, messages: list[dict], settings: dict, max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, text = [], ""
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kvcompress": settings, "ignore_eos": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    tpot = (end - stamps[0]) / (tokens - 1) if stamps and tokens > 1 else None
    return {"ttft": stamps[0] - start if stamps else None, "tpot": tpot, "tokens": tokens, "text": text}


async def run_setting(base: str, model: str, chats: list, settings: dict, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", timeout=3600)
    peak, done = 0.0, False

    async def watch() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, await asyncio.to_thread(launch.gauge, base, "vllm:num_requests_running"))
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    results = await asyncio.gather(*(one(client, model, messages, settings, max_tokens) for messages, _ in chats))
    wall = time.perf_counter() - start
    done = True
    await watcher
    await client.close()
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    tpot = sorted(r["tpot"] for r in results if r["tpot"] is not None)
    tokens = sum(r["tokens"] for r in results)
    return {
        "settings": settings,
        "requests": len(chats),
        "peak_running": int(peak),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "tpot_p50_s": quantile(tpot, 0.5),
        "tpot_p99_s": quantile(tpot, 0.99),
        "facts": sum(code in r["text"] for r, (_, code) in zip(results, chats)),
    }


def quantile(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else None


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["name"] for row in rows]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [
        ("peak_running", "requests running at once"),
        ("output_tokens_per_s", "output tokens/s"),
        ("ttft_p50_s", "time to first token, p50 (s)"),
        ("facts", "facts answered"),
    ]
    for ax, (key, title) in zip(axes, panels):
        ax.bar(names, [row[key] or 0 for row in rows], color=["#888"] + ["#2a7"] * (len(rows) - 1))
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1900, help="document tokens per prompt (the chat adds ~90)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens of each answer (EOS ignored)")
    parser.add_argument(
        "--pool-prompts", type=int, default=2, help="the KV pool holds this many uncompressed prompts and their answers"
    )
    parser.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--out", default="runs/serve_bench/serve_bench.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chats = prompts(args.requests, args.tokens, args.seed)
    max_len = args.tokens + 512
    pool_blocks = args.pool_prompts * -(-(args.tokens + 150 + args.max_tokens) // BLOCK)
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"starting the server ({pool_blocks} KV blocks of {BLOCK} tokens) ...", flush=True)
    server = start_server(port, pool_blocks, max_len, args.requests, out.with_suffix(".server.log"))
    rows = []
    try:
        model = json.loads(urllib.request.urlopen(f"{base}/v1/models").read())["data"][0]["id"]
        for name in args.settings.split(","):
            print(f"{name}: {args.requests} requests at once ...", flush=True)
            row = {"name": name, **asyncio.run(run_setting(base, model, chats, SETTINGS[name], args.max_tokens))}
            rows.append(row)
            print(
                f"  {row['peak_running']} running at once, {row['output_tokens_per_s']:.1f} output tokens/s, "
                f"TTFT p50 {row['ttft_p50_s']:.1f} s, {row['facts']}/{row['requests']} facts",
                flush=True,
            )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpu_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": vllm.__version__,
        },
        "settings": {
            **vars(args),
            "pool_blocks": pool_blocks,
            "block_size": BLOCK,
            "model": "embedded SmolLM2-135M-Instruct, float32",
        },
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2))
    plot(rows, out.with_suffix(".png"))
    full = rows[0] if rows and rows[0]["name"] == "full" else None
    print("\n| setting | running at once | output tokens/s | TTFT p50 / p99 (s) | per token p50 / p99 (s) | facts |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        ratio = ""
        if full and row is not full:
            ratio = f" ({row['peak_running'] / full['peak_running']:.1f}x, "
            ratio += f"{row['output_tokens_per_s'] / full['output_tokens_per_s']:.1f}x)"
        print(
            f"| {row['name']}{ratio} | {row['peak_running']} | {row['output_tokens_per_s']:.1f} | "
            f"{row['ttft_p50_s']:.1f} / {row['ttft_p99_s']:.1f} | {row['tpot_p50_s']:.3f} / {row['tpot_p99_s']:.3f} | "
            f"{row['facts']}/{row['requests']} |"
        )
    print(f"\nwritten: {out}, {out.with_suffix('.png')}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
