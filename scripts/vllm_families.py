"""Which model families `kvcompress serve` serves: every family of the suite's matrix, in vLLM's CPU build.

    .venv-vllm/bin/python scripts/vllm_families.py            # runs them, writes docs/img/vllm_families.json,
                                                              # prints the table
    .venv-vllm/bin/python scripts/vllm_families.py --table    # prints the table from the JSON (what docs/vllm.md shows)

Each family is the suite's tiny random-weight model (tests/fixtures.FAMILIES) widened to vLLM's CPU head size
(head_dim 64), saved with the character tokenizer, served by one engine whose method is the full cache; each method
the server takes comes as one request's own settings on a 600-token prompt, greedy, 8 tokens. A cell reads
``same`` (vLLM's tokens are the library's, ``kvcompress.generate`` with that method on that model), ``DIFFERS``,
``refused: <reason>`` (the server's one-line refusal, `serving.scorable`, before vLLM sees the request), or
``vLLM: <error>`` (vLLM itself does not run the architecture).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

RESULTS = ROOT / "docs/img/vllm_families.json"
ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 1024,
    "block_size": 32,
    "max_num_batched_tokens": 1024,
}
WIDE = {"hidden_size": 256, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPT_TOKENS, NEW_TOKENS = 600, 8


def methods() -> dict[str, object]:
    import kvcompress as kvc

    return {
        "full": kvc.FullKV(),
        "snapkv": kvc.SnapKV(budget=64, window=8, clustering="pool"),
        "streamingllm": kvc.StreamingLLM(budget=64),
        "h2o": kvc.H2O(budget=64),
        "expected": kvc.ExpectedAttention(budget=64),
    }


def run_family(family: str, folder: Path) -> dict[str, str]:
    """One family's row: its model saved to ``folder``, one engine, a request per method."""
    import torch
    import vllm

    import kvcompress as kvc
    from kvcompress.serving import settings as serving
    from tests.fixtures import char_tokenizer, family_model

    model = family_model(family, **WIDE)
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    ids = torch.randint(3, 128, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    row, asked, ours = {}, {}, {}
    for name, method in methods().items():
        try:
            serving.scorable(method, model.config)
        except kvc.InvalidParameterError as refused:
            row[name] = "refused: " + str(refused).split(": ", 1)[1]
            continue
        asked[name] = method
        # before vLLM loads the model: its transformers backend decorates transformers' class in place
        cache = method.make_cache(model, char_tokenizer())
        with torch.no_grad():
            ours[name] = model.generate(
                torch.tensor([ids]), **{cache.keyword: cache}, max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, PROMPT_TOKENS:].tolist()
    try:
        llm = vllm.LLM(model=str(folder), **ENGINE, **serving.engine_options(kvc.FullKV()))
        params = [
            vllm.SamplingParams(
                max_tokens=NEW_TOKENS, temperature=0, extra_args={"kvcompress": {"method": m.name, **m.settings()}}
            )
            for m in asked.values()
        ]
        served = llm.generate([{"prompt_token_ids": ids}] * len(asked), params, use_tqdm=False)
        del llm
    except Exception as error:  # noqa: BLE001 - vLLM's own refusal of the architecture, recorded as it says it
        failed = f"vLLM: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return {name: row.get(name, failed) for name in methods()}
    for name, out in zip(asked, served):
        row[name] = "same" if list(out.outputs[0].token_ids) == ours[name] else "DIFFERS"
    return {name: row[name] for name in methods()}


def markdown(table: dict[str, dict[str, str]]) -> str:
    """A row per family, a column per method: ``yes`` (served, the library's tokens), ``no (reason)``, or the error."""
    names = list(next(iter(table.values())))
    short = {"sliding-window": "sliding-window layers", "rotary": "RoPE it cannot invert"}

    def cell(outcome: str) -> str:
        if outcome == "same":
            return "yes"
        if outcome.startswith("refused: "):
            return "no (" + next((word for key, word in short.items() if key in outcome), outcome[9:]) + ")"
        if outcome.startswith("vLLM: "):  # vLLM's own refusal: its first sentence
            return "no (vLLM: " + outcome.split(": ", 2)[-1].split(". ")[0] + ")"
        return outcome

    lines = ["| family | " + " | ".join(names) + " |", "| --- |" + " :---: |" * len(names)]
    lines += [f"| {family} | " + " | ".join(cell(row[n]) for n in names) + " |" for family, row in table.items()]
    return "\n".join(lines)


def run_isolated(family: str, scratch: Path) -> dict[str, str]:
    """``run_family`` in a fresh process (as each family gets its own server): an engine that dies takes nothing
    else."""
    result = scratch / f"{family}.json"
    done = subprocess.run(
        [sys.executable, __file__, "--one", family, "--into", str(result)], capture_output=True, text=True
    )
    if done.returncode != 0 or not result.exists():
        last = next(
            (line for line in reversed(done.stderr.splitlines()) if "Error" in line), f"exit code {done.returncode}"
        )
        return {name: f"vLLM: {last.split(': ', 1)[-1][:160]}" for name in methods()}
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the table from the committed JSON, run nothing")
    parser.add_argument("--families", nargs="*", help="only these (default: every family of the suite)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a family's row in this process (run_isolated), into --into
    parser.add_argument("--into", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.one:
        with tempfile.TemporaryDirectory() as scratch:
            Path(args.into).write_text(json.dumps(run_family(args.one, Path(scratch) / args.one)))
        return
    if not args.table:
        from tests.fixtures import FAMILIES

        table = json.loads(RESULTS.read_text()) if args.families and RESULTS.exists() else {}
        with tempfile.TemporaryDirectory() as scratch:
            for family in args.families or FAMILIES:
                table[family] = run_isolated(family, Path(scratch))
                print(family, table[family], flush=True)
        RESULTS.write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
