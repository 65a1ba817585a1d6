"""The accuracy runner: tasks x methods x budgets x lengths, resumable, with a summary and plots.

Each sample is prefilled once with the full cache (``kvcompress.prefill``) and every method's cache
is derived from that prefill, so the matrix costs one prefill per sample, not one per method. The
full cache's own greedy answer is the reference for fidelity: each method is teacher-forced along
it and compared with the full cache step by step (top-1 agreement, KL divergence).

The question-agnostic track (``question_agnostic=True``) is the compress-once, ask-many setting:
each method compresses the context alone (``compress``), and every question the sample has (its
turns and probes) is then asked, uncompressed, of its own copy of that compressed context; or, for a
spec ``METHOD/STORE`` (e.g. ``snapkv/full``), the context is stored once with STORE and every
question is prefilled over it and compressed with METHOD (``generate(question, past=context, method=...)``).

Every finished (sample, method) pair is appended to ``results.jsonl`` at once; a rerun with the
same output folder skips what is there, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..generation.conversation import as_asked, user_prompt
from ..generation.generate import QUERY_WINDOW, Result, compress, generate, prefill, teacher_forced_logprobs
from ..methods import BudgetMethod, FullKV, Method, method_class, method_from_spec, sets_budget
from .agreement import FullAnswers, agreement
from .metrics import fidelity, score, string_match_any
from .summary import summarize, write_summary
from .tasks import DEPTH_GRID_TASKS, HAYSTACK_TASKS, TASKS, Sample, Turn

PRESETS: dict[str, dict] = {
    "quick": {
        "tasks": ["niah", "passkey", "lines", "niah_multikey", "vt", "multiturn"],
        "methods": ["full", "snapkv", "streamingllm", "shadowkv"],
        "budgets": [128, 256],
        "lengths": [1000, 2000],
        "depths": [0.1, 0.5, 0.9],
        "samples": 1,
    },
    # The needle set: a plain fact in prose, a pass key in filler, and questions over several turns.
    "needles": {
        "tasks": ["fact", "passkey", "multiturn"],
        "methods": ["full", "snapkv", "shadowkv"],
        "budgets": [256],
        "lengths": [2000, 4000],
        "depths": [0.1, 0.3, 0.5, 0.7, 0.9],
        "samples": 1,
    },
    "full": {
        "tasks": list(TASKS),
        "methods": ["full", "snapkv", "streamingllm", "shadowkv"],
        "budgets": [128, 256, 512, 1024],
        "lengths": [1000, 2000, 4000, 8000],
        "depths": [0.0, 0.25, 0.5, 0.75, 1.0],
        "samples": 3,
    },
}


# Method stats recorded with every result when the method reports them (bytes are measured from the tensors).
STAT_FIELDS = (
    "device_bytes",
    "kv_bytes_full",
    "offloaded_bytes",
    "chunk_hit_rate",
    "fetched_bytes_per_step",
    "selected_tokens_per_step",
    "decode_ms_per_token",
)


@dataclass(frozen=True)
class Config:
    """One column of the matrix: a method spec at a budget (``budget`` None: the spec fixes it, or
    the method has none, like the full cache); with ``store``, the method compresses each question
    over the context stored once with ``store`` (question-agnostic track)."""

    label: str
    method_name: str
    budget: int | None
    method: Method
    store: Method | None = None


def method_configs(specs: list[str], budgets: list[int]) -> list[Config]:
    """Each method spec (``name[:field=value...]``, e.g. ``snapkv:window=16``; ``METHOD/STORE``: METHOD
    per question over a context stored with STORE, e.g. ``snapkv/full``) at every budget, or once when it
    has no budget or sets its own. The full cache comes first: it is the reference."""
    configs = []
    for spec in specs:
        asked, _, stored = spec.partition("/")
        store = method_from_spec(stored) if stored else None
        cls = method_class(asked.split(":")[0])
        fixed = not issubclass(cls, BudgetMethod) or sets_budget(asked)
        if fixed:
            method = method_from_spec(asked)
            configs.append(Config(spec, cls.name, getattr(method, "budget", None), method, store))
        else:
            configs += [
                Config(f"{spec}@{budget}", cls.name, budget, method_from_spec(asked, budget=budget), store)
                for budget in budgets
            ]
    return sorted(configs, key=lambda c: c.label != "full")


def build_samples(
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    lengths: list[int],
    depths: list[float],
    samples: int,
    seed: int,
    haystack: str | None = None,
) -> list[Sample]:
    """Depth-grid tasks get every depth; the others one seeded depth per sample. ``haystack``
    ("prose" or "repeat") overrides each haystack task's default (passkey: repeat, others: prose)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; valid: {', '.join(TASKS)}")
    built = []
    for task in tasks:
        for length in lengths:
            for i in range(samples):
                grid = depths if task in DEPTH_GRID_TASKS else [random.Random(f"{seed}-{task}-{length}-{i}").random()]
                options = {"haystack": haystack} if haystack and task in HAYSTACK_TASKS else {}
                built += [TASKS[task](tokenizer, length, depth, seed + i, **options) for depth in grid]
    return built


def _resume(path: Path, track: str) -> set[tuple[str, str]]:
    """The (sample, config) pairs already complete in ``path``. Lines an interrupt left behind (a
    cut-off last line, a pair missing some of its turns) are removed so they are run again. Results
    of the other track (question-aware or -agnostic) are refused, not mixed in."""
    if not path.exists():
        return set()
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    complete = True
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            complete = False
            continue
        if record.get("track", "aware") != track:
            raise ValueError(
                f"{path} holds question-{record.get('track', 'aware')} results; this is a question-{track} run: give "
                "it another output folder"
            )
        groups[record["sample"], record["label"]].append(line)
    done = {key: lines for key, lines in groups.items() if len(lines) == json.loads(lines[0])["turns"]}
    if not complete or len(done) != len(groups):
        path.write_text("".join(line + "\n" for lines in done.values() for line in lines))
    return set(done)


def _turns(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sample: Sample, first: Result) -> list[Result]:
    results = [first]
    for turn in sample.turns[1:]:
        results.append(
            generate(
                model,
                tokenizer,
                as_asked(tokenizer, turn.question),
                past=results[-1],
                max_new_tokens=sample.max_new_tokens,
            )
        )
    return results


def _record(sample: Sample, config: Config, number: int, count: int, turn: Turn, result: Result, first: Result) -> dict:
    """One scored answer: the sample, the config, the answer and the first answer's cache stats."""
    answer = cast(str, result.text)  # (one prompt: one answer)
    return {
        "sample": sample.id,
        "task": sample.task,
        "length": sample.length,
        "depth": sample.depth,
        "turn": number,
        "turns": count,
        "label": config.label,
        "method": config.method_name,
        "budget": config.budget,
        "score": score(answer, turn.answers, sample.metric),
        "prediction": answer,
        "answers": turn.answers,
        "prompt_tokens": first.stats["prompt_tokens"],
        "kv_kept_fraction": first.stats["kv_kept_fraction"],
        "device_fraction": first.stats["device_fraction"],
        **{k: first.stats[k] for k in STAT_FIELDS if first.stats.get(k) is not None},
        **({"string_match": string_match_any(answer, turn.answers)} if sample.metric == "f1" else {}),
    }


def _aware_records(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sample: Sample,
    configs: list[Config],
    window: int | None,
) -> Iterator[list[dict]]:
    """Question-aware: one prefill of context and question; each config's cache derived from it,
    teacher-forced along the full cache's answer (fidelity), then the follow-up turns."""
    record = prefill(model, tokenizer, sample.prompt(tokenizer), query_window=window)
    reference = generate(model, tokenizer, method=FullKV(), prefill=record, max_new_tokens=sample.max_new_tokens)
    answer_tokens = reference.token_ids[0] or [tokenizer.eos_token_id]
    reference_logprobs = teacher_forced_logprobs(model, record, FullKV(), answer_tokens)
    for config in configs:
        first = (
            reference
            if config.label == "full"
            else generate(model, tokenizer, method=config.method, prefill=record, max_new_tokens=sample.max_new_tokens)
        )
        agreement = fidelity(reference_logprobs, teacher_forced_logprobs(model, record, config.method, answer_tokens))
        results = _turns(model, tokenizer, sample, first)
        lines = [
            _record(sample, config, i, len(sample.turns), turn, result, first)
            for i, (turn, result) in enumerate(zip(sample.turns, results), start=1)
        ]
        lines[0].update(agreement)
        yield lines


def _agnostic_records(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sample: Sample, configs: list[Config]
) -> Iterator[list[dict]]:
    """Question-agnostic: each config compresses the context alone; every question is asked of its own
    copy. A config with a store: the context stored once per store (shared by the configs that name it),
    each question compressed over it with the config's method (each answer's own stats recorded)."""
    questions = sample.questions()
    asked = [as_asked(tokenizer, turn.question) for turn in questions]
    stores: dict[str, Result] = {}  # by the store's description
    document = user_prompt(tokenizer, sample.context)
    full: FullAnswers | None = None  # the full cache's answers, over the context stored whole
    for config in configs:
        if config.store is not None:  # each question compressed over the stored context by the config's method
            needs_all = any(c.store == config.store and c.method.queries_needed() is None for c in configs)
            key = config.store.describe()
            if key not in stores:
                stores[key] = compress(
                    model, tokenizer, document, method=config.store, query_window=None if needs_all else QUERY_WINDOW
                )
            context, method = stores[key], config.method
        else:  # the context compressed alone, each question asked of its own copy
            context, method = compress(model, tokenizer, document, method=config.method), None
        results = [
            generate(
                model,
                tokenizer,
                question,
                past=context if method else context.copy(),
                method=method,
                max_new_tokens=sample.max_new_tokens,
            )
            for question in asked
        ]
        lines = [
            _record(sample, config, i, len(questions), turn, result, result if method else context)
            for i, (turn, result) in enumerate(zip(questions, results), start=1)
        ]
        if config.store is not None:
            for line, result in zip(lines, results):
                line.update(store=key, context_bytes=result.stats["context_bytes"], prefill_s=result.stats["prefill_s"])
        if full is None:
            whole = stores.get(FullKV().describe()) or compress(model, tokenizer, document, method=FullKV())
            full = FullAnswers(model, tokenizer, whole, asked, sample.max_new_tokens)
        for line, fidelity_of in zip(lines, agreement(full, method, context=context)):
            line.update(fidelity_of, track="agnostic")
        yield lines


def run_matrix(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: list[Sample],
    configs: list[Config],
    out_dir: str | Path,
    progress: bool = True,
    question_agnostic: bool = False,
) -> list[dict]:
    """Run every sample with every config, appending to ``out_dir/results.jsonl``; return all records."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = _resume(path, "agnostic" if question_agnostic else "aware")
    stored = [c.label for c in configs if c.store is not None]
    if stored and not question_agnostic:
        raise ValueError(
            f"{', '.join(stored)} compress each question over a stored context: run them on the question-agnostic "
            "track (--question-agnostic)"
        )
    needed = [c.method.queries_needed() for c in configs]
    counts = [n for n in needed if n is not None]
    window = None if len(counts) < len(needed) else max([*counts, 1])
    bar = tqdm(total=len(samples) * len(configs), desc="accuracy", disable=not progress, unit="run")
    for sample in samples:
        todo = [c for c in configs if (sample.id, c.label) not in done]
        bar.update(len(configs) - len(todo))
        if not todo:
            continue
        bar.set_postfix_str(sample.id)
        runs = (
            _agnostic_records(model, tokenizer, sample, todo)
            if question_agnostic
            else _aware_records(model, tokenizer, sample, todo, window)
        )
        for lines in runs:
            with path.open("a") as fh:
                fh.write("".join(json.dumps(line) + "\n" for line in lines))
            bar.update(1)
    bar.close()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    methods: list[str],
    budgets: list[int],
    lengths: list[int],
    out_dir: str | Path,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    samples: int = 1,
    seed: int = 0,
    dataset: list[Sample] | None = None,
    haystack: str | None = None,
    progress: bool = True,
    plots: bool = True,
    question_agnostic: bool = False,
) -> tuple[list[dict], list[str]]:
    """Build the samples, run the matrix (resuming; ``question_agnostic``: that track, see the module
    docstring), write ``summary.csv`` and plots; return the summary rows and the names of the files
    written in ``out_dir``."""
    built = build_samples(tokenizer, tasks, lengths, list(depths), samples, seed, haystack) + list(dataset or [])
    records = run_matrix(
        model, tokenizer, built, method_configs(methods, budgets), out_dir, progress, question_agnostic
    )
    rows = summarize(records)
    write_summary(rows, Path(out_dir) / "summary.csv")
    written = ["results.jsonl", "summary.csv"]
    if plots:
        from .plots import agreement_vs_device, needle_heatmaps, score_vs_budget  # noqa: PLC0415 - only to draw

        if needle_heatmaps(records, Path(out_dir) / "niah_heatmaps.png"):
            written.append("niah_heatmaps.png")
        if rows:
            score_vs_budget(rows, Path(out_dir) / "score_vs_budget.png")
            written.append("score_vs_budget.png")
        if agreement_vs_device(rows, Path(out_dir) / "agreement_vs_device.png"):
            written.append("agreement_vs_device.png")
    return rows, written
