"""What a question over a stored context costs, against prefilling document and question afresh.

    python scripts/ask_bench.py --lengths 2000,4000 --budget 256 --out docs/img/stored_context_cpu
    python scripts/ask_bench.py --preset llama-3.1-8b --lengths 32768,131000 --budget 2048   # a GPU (gpu_check.sh ask)

Per length, on the embedded model (real weights, a needle in Paul Graham's essays; or ``--preset``, an
architecture with random weights and a byte tokenizer built here, for a GPU without the embedded model): the document is
stored once (``kvc.compress(method=FullKV())``, timed apart), then, round after round, the same
question is asked three ways in turn, so drift on a shared machine hits all alike:

* afresh: document and question prefilled together and compressed question-aware (``SnapKV``);
* stored: the question prefilled over the stored context and compressed with it (``past=context,
  method=SnapKV``): the same tokens kept, the document's prefill not paid again;
* full: the stored full cache continued as it is (a copy of it), for scale.

Reported per way (medians over rounds; ratios taken within a round): time to the first token
(prefill, compression and the first token's logits: ``prefill_s``), decoding ms per token, device
bytes while decoding and, for the stored context, its bytes and where they are; and the saved file's
size of the store, whole and thinned by KVzip (``--thinned``: ratios). Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.bench.device import machine
from kvcompress.bench.haystack import fill
from kvcompress.integrations.transformers.models import random_model

NEEDLE = "The vault code for the east wing is 4817."
QUESTION = "What is the vault code for the east wing? Answer with the code."


def file_bytes(context: kvc.Result) -> int:
    """The size of ``context`` saved as a .kvc file."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "context.kvc"
        context.save(path)
        return path.stat().st_size


def byte_tokenizer():
    """One token per byte (ids 3-258; 0-2 pad, BOS, EOS) and a plain chat template: text for a random-weight model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # only for --preset
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(["<pad>", "<s>", "</s>", *sorted(alphabet)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=template
    )


def ask(model, tok, document: str, context: kvc.Result, way: str, budget: int, tokens: int) -> kvc.Result:
    method = kvc.SnapKV(budget=budget)
    if way == "afresh":
        return kvc.generate(
            model,
            tok,
            [{"role": "user", "content": document + "\n\n" + QUESTION}],
            method=method,
            max_new_tokens=tokens,
        )
    if way == "stored":
        return kvc.generate(model, tok, QUESTION, past=context, method=method, max_new_tokens=tokens)
    return kvc.generate(model, tok, QUESTION, past=context.copy(), max_new_tokens=tokens)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset", help="an architecture preset with random weights (kvcompress.models), instead of the embedded model"
    )
    parser.add_argument("--lengths", default="2000,4000", help="document tokens, comma-separated")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per answer (decoding ms/token)")
    parser.add_argument(
        "--thinned",
        default="0.5,0.25",
        help="KVzip ratios (layers=uniform) of thinned stores whose file sizes are reported",
    )
    parser.add_argument(
        "--out", default="docs/img/stored_context_cpu", help="path without extension: .json and .png are written"
    )
    args = parser.parse_args()
    model, tok = (random_model(args.preset), byte_tokenizer()) if args.preset else kvc.load_model()
    ways = ("afresh", "stored", "full")
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        document = fill(tok, length, [(0.5, NEEDLE)], kind="essays")
        context = kvc.compress(model, tok, [{"role": "user", "content": document}], method=kvc.FullKV())
        runs: dict[str, list[kvc.Result]] = {way: [] for way in ways}
        for round_ in range(args.rounds + 1):  # the first round warms up and is not counted
            for way in ways if round_ % 2 == 0 else ways[::-1]:
                result = ask(model, tok, document, context, way, args.budget, args.tokens)
                if round_:
                    runs[way].append(result)
        ttft = {way: [r.stats["prefill_s"] for r in runs[way]] for way in ways}
        decode = {way: [r.stats["decode_ms_per_token"] for r in runs[way]] for way in ways}
        last = {way: runs[way][-1] for way in ways}
        row = {
            "length": length,
            "prompt_tokens": last["afresh"].stats["prompt_tokens"],
            "budget": args.budget,
            "store_s": context.stats["prefill_s"],
            "context_bytes": last["stored"].stats["context_bytes"],
            "context_on": last["stored"].stats["context_on"],
            "same_answer": last["stored"].token_ids == last["afresh"].token_ids,
            "answer": last["stored"].text,
        }
        for way in ways:
            row[f"{way}_ttft_s"] = statistics.median(ttft[way])
            row[f"{way}_decode_ms"] = statistics.median(decode[way])
            row[f"{way}_device_bytes"] = last[way].stats["device_bytes"]
        row["ttft_ratio"] = statistics.median(s / a for s, a in zip(ttft["stored"], ttft["afresh"]))
        row["decode_ratio"] = statistics.median(s / a for s, a in zip(decode["stored"], decode["afresh"]))
        row["file_bytes"] = {"full": file_bytes(context)}
        for ratio in (float(r) for r in args.thinned.split(",") if r):
            thinned = kvc.compress(
                model,
                tok,
                [{"role": "user", "content": document}],
                method=kvc.KVzip(ratio=ratio, layers="uniform"),
                query_window=64,
            )
            row["file_bytes"][f"kvzip ratio {ratio}"] = file_bytes(thinned)
        rows.append(row)
        print(
            f"{length} tokens: TTFT afresh {row['afresh_ttft_s']:.2f} s, stored {row['stored_ttft_s']:.2f} s "
            f"({row['ttft_ratio']:.3f}x); "
            f"decode {row['afresh_decode_ms']:.1f} vs {row['stored_decode_ms']:.1f} ms/token "
            f"({row['decode_ratio']:.3f}x); device "
            f"{row['afresh_device_bytes'] / 2**20:.2f} vs {row['stored_device_bytes'] / 2**20:.2f} MiB; store "
            f"{row['context_bytes'] / 2**20:.1f} MiB on {row['context_on']} (built in {row['store_s']:.2f} s); same "
            f"answer: {row['same_answer']}; "
            f"files: " + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in row["file_bytes"].items())
        )
    out = Path(args.out)
    out.with_suffix(".json").write_text(
        json.dumps({"machine": machine(model.device), "settings": vars(args), "rows": rows}, indent=1)
    )
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    lengths = [row["length"] for row in rows]
    for way, label in (
        ("afresh", "document + question prefilled, SnapKV"),
        ("stored", "question over the stored context, SnapKV"),
        ("full", "stored full cache continued"),
    ):
        axes[0].plot(lengths, [row[f"{way}_ttft_s"] for row in rows], marker="o", label=label)
        axes[1].plot(lengths, [row[f"{way}_decode_ms"] for row in rows], marker="o", label=label)
    axes[0].set(xlabel="document tokens", ylabel="time to first token (s)", title="per question")
    axes[1].set(xlabel="document tokens", ylabel="decoding ms / token", title="per question")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
