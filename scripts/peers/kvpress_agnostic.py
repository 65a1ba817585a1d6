"""kvpress's presses on the samples of the question-agnostic track, their rows in the same results table.

kvpress pins transformers < 5.3 and kvcompress needs >= 5.17, so this script runs in two
environments, one step each (`make kvpress` runs all three on a small setting):

    .venv/bin/python scripts/peers/kvpress_agnostic.py samples --tasks niah,niah_multikey,niah_multivalue,qa_1 \
        --lengths 1000 --haystack essays --out runs/agnostic-1000/samples.jsonl           # kvcompress's venv
    .venv-kvpress/bin/python scripts/peers/kvpress_agnostic.py run --samples runs/agnostic-1000/samples.jsonl \
        --budgets 64,256 --out runs/agnostic-1000/kvpress_answers.jsonl                    # kvpress's venv
    .venv/bin/python scripts/peers/kvpress_agnostic.py score --samples runs/agnostic-1000/samples.jsonl \
        --answers runs/agnostic-1000/kvpress_answers.jsonl --results runs/agnostic-1000/results.jsonl
    .venv/bin/python scripts/tables.py retained runs/agnostic-1000/results.jsonl

``samples`` writes exactly the samples ``kvcompress bench accuracy --question-agnostic`` builds for the
same flags (the contexts, every question of each, the answers). ``run`` loads the same weights (the
embedded model's folder) into kvpress's pipeline and asks every question of a context compressed
once per press, as kvpress's evaluation does: the context alone is compressed, then each question
(``"\\n\\n" + question``, so the prompt is the track's joined prompt) is answered over it. A budget is
kept tokens per KV head: ``compression_ratio = 1 - budget / context tokens``. ``score`` scores the
answers with the track's own metric and appends them to the track's ``results.jsonl`` as rows
labelled ``kvpress-<press>@<budget>``, which ``scripts/tables.py retained`` lists beside kvcompress's.

``samples --shared-context`` writes ``kvcompress bench shared-context``'s contexts instead (the same seeds and
lengths, each fact's question; the question that refers to an earlier answer needs a conversation, which
kvpress's pipeline does not hold); ``run --fraction 0.0625`` gives each press 1/16 of each context's tokens as
that benchmark does; ``score --shared-context DIR`` scores every answer as that benchmark does (the code as a
whole number) into DIR's ``results.jsonl`` as multi-request rows ``kvpress-<press>`` and rewrites its summary and
PNG, so its table shows kvpress's presses beside kvcompress's methods.

``run --cache quanto:4`` answers over transformers' own ``QuantizedCache`` (its quanto backend, 4 bits; optimum-quanto
in kvpress's venv): with ``--presses none`` that is transformers' quantized full cache, labelled
``transformers-quanto4``; with a press, ``kvpress-<press>+quanto4@<budget>``. The bytes the cache holds after the
context's prefill are recorded and scored as the rows' ``device_bytes``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PRESSES = ("kvzip", "kvzip+", "expected", "snapkv", "none")
CACHES = ("dynamic", "quanto:4", "quanto:2")


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def shared_context_samples(tokenizer, args: argparse.Namespace) -> list[dict]:
    """``bench shared-context``'s contexts for these lengths and seeds, a question per fact."""
    from kvcompress.bench.shared_context import make_sample

    rows = []
    for length in [int(n) for n in _names(args.lengths)]:
        for seed in range(args.samples):
            sample = make_sample(tokenizer, length, seed, args.facts, args.haystack)
            rows.append(
                {
                    "id": f"shared-{length}-{seed}",
                    "task": "shared-context",
                    "length": length,
                    "seed": seed,
                    "depth": None,
                    "metric": "code",
                    "max_new_tokens": 16,
                    "context": sample.context,
                    "questions": [{"question": q, "answers": [code]} for q, code in sample.questions[:-1]],
                }
            )
    return rows


def track_samples(tokenizer, args: argparse.Namespace) -> list[dict]:
    """The question-agnostic track's samples for these flags."""
    from kvcompress.bench.accuracy import build_samples

    samples = build_samples(
        tokenizer,
        _names(args.tasks),
        [int(n) for n in _names(args.lengths)],
        [float(d) for d in _names(args.depths)],
        args.samples,
        args.seed,
        args.haystack,
    )
    return [
        {
            "id": sample.id,
            "task": sample.task,
            "length": sample.length,
            "depth": sample.depth,
            "metric": sample.metric,
            "max_new_tokens": sample.max_new_tokens,
            "context": sample.context,
            "questions": [{"question": t.question, "answers": t.answers} for t in sample.questions()],
        }
        for sample in samples
    ]


def write_samples(args: argparse.Namespace) -> None:
    """kvcompress's venv: the track's samples (or the shared-context benchmark's) for these flags, one JSON object
    per line."""
    import kvcompress as kvc

    _, tokenizer = kvc.load_model()
    rows = (shared_context_samples if args.shared_context else track_samples)(tokenizer, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} {'shared-context ' if args.shared_context else ''}samples to {args.out}")


def _press(name: str, ratio: float):
    """kvpress's press by name (``none``: no press, the whole context kept)."""
    from kvpress import ExpectedAttentionPress, KVzipPress, SnapKVPress

    if name == "none":
        return None
    return {
        "kvzip": lambda: KVzipPress(compression_ratio=ratio),
        "kvzip+": lambda: KVzipPress(compression_ratio=ratio, kvzip_plus_normalization=True),
        "expected": lambda: ExpectedAttentionPress(compression_ratio=ratio),
        "snapkv": lambda: SnapKVPress(compression_ratio=ratio),
    }[name]()


def _cache(spec: str, config):
    """A fresh cache for one context: ``dynamic`` (None: kvpress's default) or transformers' own
    ``QuantizedCache`` with its quanto backend at ``bits`` (``quanto:4``; its defaults otherwise: groups of 64,
    the last 128 tokens kept at full precision until they are quantized together)."""
    if spec == "dynamic":
        return None
    from transformers import QuantizedCache

    backend, bits = spec.split(":")
    return QuantizedCache(backend=backend, config=config, nbits=int(bits))


def _nbytes(tensor) -> int:
    """Bytes a tensor holds, a quantized tensor subclass (quanto's codes, scales and shifts) counted part by part."""
    if not hasattr(tensor, "__tensor_flatten__") or type(tensor).__name__ == "Tensor":
        return tensor.numel() * tensor.element_size()
    return sum(_nbytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])


def cache_bytes(cache) -> int | None:
    """Bytes a cache holds, codes and scales counted as stored (None: kvpress's own cache, not measured)."""
    import torch

    if cache is None:
        return None
    parts = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(
        _nbytes(getattr(layer, name))
        for layer in cache.layers
        for name in parts
        if isinstance(getattr(layer, name, None), torch.Tensor)
    )


def label(press: str, budget: int, cache: str) -> str:
    """A kvpress answer's label in the track's results: ``kvpress-snapkv@256``, ``kvpress-snapkv+quanto4@256``;
    no press over a quantized cache is transformers' own ``QuantizedCache``: ``transformers-quanto4``."""
    coded = "" if cache == "dynamic" else cache.replace(":", "")
    if press == "none":
        return f"transformers-{coded}" if coded else "kvpress-none"
    return f"kvpress-{press}{'+' + coded if coded else ''}@{budget}"


def _answers(pipe, sample: dict, press: str, ratio: float, cache: str) -> tuple[list[str], int | None]:
    """Every question of ``sample`` answered over its context compressed by ``press`` (kvpress's own evaluation:
    the context compressed once, each question after it), and the bytes the cache held for the context.

    Over a quantized cache each question gets its own pipeline call and a fresh cache: kvpress 0.5.5 trims the
    cache after an answer by slicing quanto's codes, which turns them into dense tensors and makes the next
    question's attention fail on a size mismatch (seen on the 4-question multikey samples). The bytes are read
    after the first forward (the context, compressed and coded), before any trim."""
    import torch

    groups = [sample["questions"]] if cache == "dynamic" else [[q] for q in sample["questions"]]
    answers, held = [], {}
    for questions in groups:
        stored = _cache(cache, pipe.model.config)
        hook = pipe.model.register_forward_hook(lambda *_: None if held else held.update(bytes=cache_bytes(stored)))
        with torch.inference_mode():
            said = pipe(
                sample["context"],
                questions=["\n\n" + q["question"] for q in questions],
                press=_press(press, ratio),
                cache=stored,
                max_new_tokens=sample["max_new_tokens"],
            )
        answers += said["answers"]
        hook.remove()
    return answers, held.get("bytes")


def run_presses(args: argparse.Namespace) -> None:
    """kvpress's venv: every question of every sample, per press and budget (over ``--cache``); resumes from
    ``--out``."""
    import kvpress  # registers the kv-press-text-generation pipeline
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    transformers.utils.logging.disable_progress_bar()
    model_dir = Path(args.model).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    samples = [json.loads(line) for line in open(args.samples) if line.strip()]
    out = Path(args.out)
    done = (
        {
            (r["sample"], r["press"], r["budget"], r.get("cache", "dynamic"))
            for r in map(json.loads, out.read_text().splitlines())
        }
        if out.exists()
        else set()
    )
    print(
        f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '?'}, transformers "
        f"{transformers.__version__}, torch {torch.__version__}"
    )
    for sample in samples:
        context_tokens = len(tokenizer.encode(sample["context"], add_special_tokens=False))
        for name in _names(args.presses):
            budgets = (
                [max(16, round(context_tokens * args.fraction))]
                if args.fraction
                else [int(b) for b in _names(args.budgets)]
            )
            for budget in [context_tokens] if name == "none" else budgets:
                if (sample["id"], name, budget, args.cache) in done:
                    continue
                ratio = max(0.0, 1 - budget / context_tokens)
                start = time.perf_counter()
                answers, held = _answers(pipe, sample, name, ratio, args.cache)
                row = {
                    "sample": sample["id"],
                    "press": name,
                    "budget": budget,
                    "cache": args.cache,
                    "compression_ratio": ratio,
                    "context_tokens": context_tokens,
                    "answers": answers,
                    "seconds": time.perf_counter() - start,
                    "cache_bytes": held,
                }
                with open(out, "a") as file:
                    file.write(json.dumps(row) + "\n")
                print(f"{sample['id']} {label(name, budget, args.cache)}: {row['seconds']:.1f} s", flush=True)


def score_shared_context(samples: dict, args: argparse.Namespace) -> None:
    """kvcompress's venv: kvpress's answers to the shared-context samples as multi-request rows of
    ``bench shared-context``'s journal in ``args.shared_context``; its summary and PNG rewritten."""
    from kvcompress.bench.shared_context import answered, journal_rows, write_summary

    out = Path(args.shared_context)
    journal = out / "results.jsonl"
    if not journal.exists():
        raise SystemExit(f"score: {journal} does not exist; run kvcompress bench shared-context --out {out} first")
    done = {(r["length"], r["seed"], r["method"]) for r in journal_rows(journal)}
    rows = []
    for answer in map(json.loads, open(args.answers)):
        sample, method = samples[answer["sample"]], f"kvpress-{answer['press']}"
        if (sample["length"], sample["seed"], method) in done:
            continue
        rows.append(
            {
                "length": sample["length"],
                "seed": sample["seed"],
                "method": method,
                "mode": "multi-request",
                "kind": "once",
                "tokens": answer["context_tokens"],
                "budget": answer["budget"],
                "scores": [answered(text, q["answers"][0]) for text, q in zip(answer["answers"], sample["questions"])],
                "answers": answer["answers"],
            }
        )
    with journal.open("a") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    write_summary(out)
    print(f"appended {len(rows)} rows to {journal}; rewrote its summary.json and shared_context.png")


def score_answers(args: argparse.Namespace) -> None:
    """kvcompress's venv: kvpress's answers scored as the track scores its own, appended to its results."""
    from kvcompress.bench.metrics import score

    samples = {s["id"]: s for s in map(json.loads, open(args.samples)) if s}
    if args.shared_context:
        score_shared_context(samples, args)
        return
    if not args.results:
        raise SystemExit("score: give --results (the track's results.jsonl) or --shared-context (a bench folder)")
    results = Path(args.results)
    labelled = (
        {(r["sample"], r["label"]) for r in map(json.loads, results.read_text().splitlines())}
        if results.exists()
        else set()
    )
    rows = []
    for answer in map(json.loads, open(args.answers)):
        sample = samples[answer["sample"]]
        named = label(answer["press"], answer["budget"], answer.get("cache", "dynamic"))
        if (sample["id"], named) in labelled:
            continue
        count = len(sample["questions"])
        for number, (question, prediction) in enumerate(zip(sample["questions"], answer["answers"]), start=1):
            rows.append(
                {
                    "sample": sample["id"],
                    "task": sample["task"],
                    "length": sample["length"],
                    "depth": sample["depth"],
                    "turn": number,
                    "turns": count,
                    "label": named,
                    "method": named.split("@")[0],
                    "budget": answer["budget"],
                    "score": score(prediction, question["answers"], sample["metric"]),
                    "prediction": prediction,
                    "answers": question["answers"],
                    "prompt_tokens": answer["context_tokens"],
                    "kv_kept_fraction": 1 - answer["compression_ratio"],
                    "device_fraction": 1 - answer["compression_ratio"],
                    "track": "agnostic",
                    **({"device_bytes": answer["cache_bytes"]} if answer.get("cache_bytes") else {}),
                }
            )
    with open(results, "a") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"appended {len(rows)} rows to {results}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    samples = sub.add_parser("samples", help="kvcompress's venv: write the track's samples")
    samples.add_argument("--tasks", default="niah,niah_multikey,niah_multivalue,qa_1")
    samples.add_argument("--lengths", default="1000")
    samples.add_argument("--depths", default="0.1,0.5,0.9")
    samples.add_argument("--samples", type=int, default=1)
    samples.add_argument("--seed", type=int, default=0)
    samples.add_argument("--haystack", default="essays")
    samples.add_argument("--shared-context", action="store_true", help="bench shared-context's contexts instead")
    samples.add_argument("--facts", type=int, default=5, help="with --shared-context: facts per context")
    samples.add_argument("--out", required=True)
    samples.set_defaults(run=write_samples)
    run = sub.add_parser("run", help="kvpress's venv: answer every question with each press")
    run.add_argument("--samples", required=True)
    run.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated: {', '.join(PRESSES)}")
    run.add_argument("--budgets", default="64,256", help="kept tokens per KV head")
    run.add_argument(
        "--fraction",
        type=float,
        default=None,
        help="instead of --budgets: this share of each context's tokens (bench shared-context's 1/16)",
    )
    run.add_argument(
        "--model",
        default="~/.cache/kvcompress/smollm2-135m-instruct",
        help="the embedded model's folder (kvcompress fetch-model)",
    )
    run.add_argument(
        "--cache",
        default="dynamic",
        choices=CACHES,
        help="transformers' QuantizedCache (optimum-quanto) under the presses, or kvpress's dynamic one",
    )
    run.add_argument("--out", required=True)
    run.set_defaults(run=run_presses)
    scored = sub.add_parser("score", help="kvcompress's venv: score kvpress's answers into the track's results")
    scored.add_argument("--samples", required=True)
    scored.add_argument("--answers", required=True)
    scored.add_argument("--results", help="the track's results.jsonl (not with --shared-context)")
    scored.add_argument("--shared-context", help="a bench shared-context folder: its journal gets the rows")
    scored.set_defaults(run=score_answers)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
