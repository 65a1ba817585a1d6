"""kvpress's DecodingPress on the continuations of scripts/long_answer_fidelity.py, scored alike: the same prompts
and the full cache's continuation fed one token at a time under the press, the log-probability of each next token
(the end token banned) against kvpress's own full-cache pass in the same venv, and the greedy agreement up to the
first divergence. Runs in kvpress's venv (transformers < 5.3; `make kvpress` builds it):

    .venv-kvpress/bin/python scripts/peers/kvpress_decoding.py --fidelity docs/img/long_answer_fidelity_2k.json \
        --bounds 1024 --out docs/img/long_answer_kvpress_2k.json

DecodingPress (kvpress 0.5.5, presses/generation) re-scores the whole cache every ``compression_interval``
decoding steps with a scorer press and keeps ``target_size`` tokens; its documentation lists the scorers that work
there (key norms, StreamingLLM, expected attention; not SnapKV's window). Positions are passed explicitly (each token's
true position), as a compressed cache is shorter than the sequence.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SCORERS = ("knorm", "streaming_llm", "expected_attention")


def scorer(name: str):
    from kvpress import ExpectedAttentionPress, KnormPress, StreamingLLMPress

    return {"knorm": KnormPress, "streaming_llm": StreamingLLMPress, "expected_attention": ExpectedAttentionPress}[
        name
    ]()


def read(model, prompt: list[int], continuation: list[int], eos: int, press=None) -> tuple[list[float], list[bool]]:
    """Log-probability of each next continuation token and whether the greedy choice was it."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache, logps, agree = DynamicCache(), [], []
    context = press(model) if press is not None else contextlib.nullcontext()
    with torch.inference_mode(), context:
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        for step, token in enumerate(continuation[:-1]):
            where = torch.tensor([len(prompt) + step])  # the token's true position (the cache may be shorter)
            logits = (
                model(
                    input_ids=torch.tensor([[token]]),
                    past_key_values=cache,
                    position_ids=where[None],
                    cache_position=where,
                    use_cache=True,
                )
                .logits[0, -1]
                .float()
            )
            logits[eos] = -float("inf")
            logp = logits.log_softmax(-1)
            logps.append(float(logp[continuation[step + 1]]))
            agree.append(int(logits.argmax()) == continuation[step + 1])
    return logps, agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fidelity", type=Path, required=True, help="scripts/long_answer_fidelity.py's JSON")
    parser.add_argument("--model", default="~/.cache/kvcompress/smollm2-135m-instruct")
    parser.add_argument("--bounds", default="1024")
    parser.add_argument("--scorers", default=",".join(SCORERS))
    parser.add_argument(
        "--every", type=int, default=64, help="DecodingPress's compression_interval (kvcompress's every)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists; give a new file")

    import torch
    import transformers
    from kvpress import DecodingPress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    folder = Path(args.model).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    data = json.loads(args.fidelity.read_text())
    prompts, continuations = data["full"]["prompt_ids"], data["full"]["token_ids"]
    eos = tokenizer.eos_token_id
    full = [read(model, p, c, eos)[0] for p, c in zip(prompts, continuations)]
    rows = []
    for bound in (int(b) for b in args.bounds.split(",")):
        for name in args.scorers.split(","):
            for index, (prompt, continuation) in enumerate(zip(prompts, continuations)):
                press = DecodingPress(base_press=scorer(name), compression_interval=args.every, target_size=bound)
                start = time.perf_counter()
                logps, agree = read(model, prompt, continuation, eos, press)
                gaps = [a - b for a, b in zip(full[index], logps)]
                agreed = next((i for i, same in enumerate(agree) if not same), len(agree))
                rows.append(
                    {
                        "method": f"kvpress DecodingPress({name})",
                        "bound": bound,
                        "prompt": index,
                        "ll_full": sum(full[index]) / len(full[index]),
                        "ll": sum(logps) / len(logps),
                        "gap": sum(gaps) / len(gaps),
                        "agreed_tokens": agreed,
                        "gap_curve": [sum(gaps[:n]) / n for n in range(256, len(gaps) + 1, 256)],
                        "decode_s": time.perf_counter() - start,
                    }
                )
                print(f"{name} {bound} row {index}: gap {rows[-1]['gap']:+.3f} agreed {agreed}", flush=True)
                args.out.write_text(
                    json.dumps({"kvpress_transformers": transformers.__version__, "rows": rows}, indent=1)
                )


if __name__ == "__main__":
    main()
