"""``kvcompress observe``: the measurements SnapKV and ShadowKV are built on (their Sec. 3, attention_measures.py)
run on a model over prompts the project builds (a document with needles, its questions and answers), written as
JSON and figures (plots.observation_figures) and summarized beside the papers' (report.observations)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.tokens import TokenSpans
from ..integrations.transformers.attach import attention_modules
from ..methods import FullKV, ShadowKV
from ..methods.shadowkv import chunk_landmarks, chunk_min_cosine
from ..storage.attention import grouped_logits
from .attention_measures import (
    hit_rate,
    outlier_fraction,
    relative_spectrum,
    significant,
    subspace_similarity,
    top_subspace,
    vote_mask,
)
from .haystack import fill

# --- the runs: the embedded model (or any) on prompts the project builds ------------------------------------

NEEDLES = (
    ("The vault code for the east wing is 4817.", "What is the vault code for the east wing?"),
    (
        "The quarterly meeting takes place in room 12 of the old library.",
        "Where does the quarterly meeting take place?",
    ),
)
LONG_ANSWER = "Summarize the text above in detail, paragraph by paragraph."


@dataclass
class Settings:
    """What a run measures with (the papers' values where they give them)."""

    tokens: int = 2000  # document length
    window: int = 32  # SnapKV's observation window
    share: float = 0.05  # p: each head's selection, a share of the prefix
    theta: float = 0.05  # a generated token's attention that counts as significant
    generated: int = 512  # tokens generated for the hit rate along generation (windows of ``span``)
    span: int = 128
    rank: int = 32  # ShadowKV's rank for the subspace similarity
    chunk: int = 8
    outlier_cosine: float = 0.5  # a chunk whose keys' minimum cosine to their mean is under this is an outlier
    lengths: tuple[int, ...] = (1000, 2000, 4000)  # SVD's share of the prefill
    budget: int = 256  # ShadowKV's tokens per step (chunk reuse, accuracy by rank)

    @classmethod
    def quick(cls) -> Settings:
        return cls(tokens=300, generated=48, span=16, rank=8, lengths=(200, 400), budget=64)

    def ranks(self, width: int) -> tuple[int, ...]:
        """Key ranks for the accuracy by rank: halvings of the key width ``kv_heads * head_dim``, down to 4."""
        ranks = [width]
        while ranks[-1] > 4 and len(ranks) < 6:
            ranks.append(ranks[-1] // 2)
        return tuple(reversed(ranks))


@dataclass
class Recorded:
    """One forward over token ids with a full cache: per layer its post-RoPE keys and values ``[kv_heads, seq, d]``,
    its last ``queries`` ``[q_heads, n, d]`` and their scaling; and, where hooks saw them, each layer's input and
    pre-RoPE keys ``[seq, ...]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]
    scaling: float
    inputs: list[torch.Tensor] = field(default_factory=list)
    pre_rope: list[torch.Tensor] = field(default_factory=list)


@torch.inference_mode()
def record(model: PreTrainedModel, ids: list[int], queries: int, hooks: bool = False) -> Recorded:
    """Feed ``ids`` through a full kvcompress cache keeping each layer's last ``queries`` queries; with ``hooks``,
    also each attention module's input and its key projection's output (the pre-RoPE keys)."""
    cache = FullKV().make_cache(model, TokenSpans.every(model.config.get_text_config().vocab_size))
    cache.record_prefill(queries)
    inputs: list[torch.Tensor] = []
    pre_rope: list[torch.Tensor] = []
    handles = []
    if hooks:
        for module in attention_modules(model):
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, args, kwargs: inputs.append(kwargs.get("hidden_states", args[0] if args else None)[0]),
                    with_kwargs=True,
                )
            )
            projection = cast(torch.nn.Module, module.k_proj)
            handles.append(projection.register_forward_hook(lambda _m, _args, out: pre_rope.append(out[0])))
    try:
        model(torch.tensor([ids], device=model.device), **{cache.keyword: cache}, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    layers = [layer for layer in cache.layers if not layer.is_sliding]
    kept = [layer.queries for layer in layers]
    scaling = layers[0].query_scaling
    if scaling is None or any(q is None for q in kept):  # (a cache recording its prefill holds both)
        raise RuntimeError("kvcompress: the recording cache kept no prefill queries")
    return Recorded(
        [layer.keys[0] for layer in layers],
        [layer.values[0] for layer in layers],
        [q[0] for q in kept if q is not None],
        scaling,
        inputs,
        pre_rope,
    )


def last_rows_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention ``[q_heads, n, seq]`` of the last ``n`` positions' queries ``[q_heads, n, d]`` over
    ``keys [kv_heads, seq, d]``."""
    n, seq = queries.shape[-2], keys.shape[-2]
    logits = grouped_logits(queries[None], keys[None], scaling)[0]
    visible = torch.arange(seq, device=keys.device)[None, :] <= torch.arange(seq - n, seq, device=keys.device)[:, None]
    return logits.masked_fill(~visible, -torch.inf).softmax(dim=-1)


def _ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    return tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]


def _answer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict], tokens: int) -> list[int]:
    from ..generation.generate import generate  # noqa: PLC0415 - generation sits above the bench's metrics

    return generate(model, tokenizer, messages, method=FullKV(), max_new_tokens=tokens).token_ids[0]


def hit_rates_along_generation(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    settings: Settings,
    prefix_end: int | None = None,
) -> dict:
    """SnapKV's Fig. (a): the observation window's selection against each ``span`` of the generated answer, per
    layer (``prefix_end``: where the prefix ends, default before the window); also over the whole answer."""
    prompt = _ids(tokenizer, messages)
    answer = _answer(model, tokenizer, messages, settings.generated)
    seen = record(model, prompt + answer, settings.window + len(answer))
    end = prefix_end if prefix_end is not None else len(prompt) - settings.window
    per_layer, whole = [], []
    for keys, queries in zip(seen.keys, seen.queries):
        attention = last_rows_attention(queries, keys, seen.scaling)[..., :end]
        selection = vote_mask(attention[:, : settings.window], settings.share)[:, None, :]
        generated = significant(attention[:, settings.window :], settings.theta)
        per_layer.append(
            [
                hit_rate(generated[:, start : start + settings.span], selection)
                for start in range(0, len(answer), settings.span)
            ]
        )
        whole.append(hit_rate(generated, selection))
    return {"prompt_tokens": len(prompt), "answer_tokens": len(answer), "per_span": per_layer, "whole": whole}


def pair_hit_rates(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, document: str, questions: list[str], settings: Settings
) -> list:
    """SnapKV's Fig. (c): two questions on one document, each with its answer; each pair's last ``window`` tokens
    (question and answer) vote on the document (the tokens both prompts share), and ``H(vote A, vote B)``, per layer."""
    prompts = [_ids(tokenizer, [{"role": "user", "content": document + "\n\n" + question}]) for question in questions]
    # the document's tokens, before either question
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    selections = []
    for question, prompt in zip(questions, prompts):
        answer = _answer(model, tokenizer, [{"role": "user", "content": document + "\n\n" + question}], settings.window)
        seen = record(model, prompt + answer, settings.window)
        selections.append(
            [
                vote_mask(last_rows_attention(q, k, seen.scaling)[..., :shared], settings.share)
                for q, k in zip(seen.queries, seen.keys)
            ]
        )
    return [hit_rate(first, second) for first, second in zip(*selections)]


def energy_rank(spectrum: torch.Tensor, share: float = 0.9) -> int:
    """The fewest singular values holding ``share`` of the energy (their squares' sum) of a relative ``spectrum``."""
    energy = spectrum.square().cumsum(0)
    return int((energy < share * energy[-1]).sum()) + 1


def key_spectra(model: PreTrainedModel, ids: list[int]) -> dict:
    """ShadowKV's Fig. 1a: per layer, the relative spectra of the attention's input, ``W_k``, ``W_v``, the pre-RoPE
    keys, the post-RoPE keys and the values (heads side by side: ``[seq, kv_heads * d]``); the rank holding 90% of
    each one's energy, per layer, and the middle layer's spectra."""
    seen = record(model, ids, 1, hooks=True)
    modules = list(attention_modules(model))
    kinds: dict[str, list[torch.Tensor]] = {
        "layer input": seen.inputs,
        "W_k": [cast(torch.nn.Linear, m.k_proj).weight for m in modules],
        "W_v": [cast(torch.nn.Linear, m.v_proj).weight for m in modules],
        "pre-RoPE keys": seen.pre_rope,
        "post-RoPE keys": [k.transpose(0, 1).flatten(1) for k in seen.keys],
        "values": [v.transpose(0, 1).flatten(1) for v in seen.values],
    }
    middle = len(modules) // 2
    spectra = {kind: [relative_spectrum(m) for m in matrices] for kind, matrices in kinds.items()}
    return {
        "ranks_90": {kind: [energy_rank(s) for s in values] for kind, values in spectra.items()},
        "middle_layer": middle,
        "middle_spectra": {kind: values[middle].tolist() for kind, values in spectra.items()},
    }


def subspace_similarities(
    model: PreTrainedModel, context: list[int], continuation: list[int], other: list[int], rank: int
) -> dict:
    """ShadowKV's Fig. 1b: per layer, ``D`` between the rank-``rank`` right subspaces of a context's pre-RoPE keys and
    those of the context extended by ``continuation``, and of another context of the same length."""
    keys = {
        name: record(model, ids, 1, hooks=True).pre_rope
        for name, ids in (("context", context), ("extended", context + continuation), ("other", other))
    }
    bases = {name: [top_subspace(k, rank) for k in layers] for name, layers in keys.items()}
    return {
        "extended context": [subspace_similarity(a, b) for a, b in zip(bases["context"], bases["extended"])],
        "inter-context": [subspace_similarity(a, b) for a, b in zip(bases["context"], bases["other"])],
    }


def svd_share(model: PreTrainedModel, ids: list[int], lengths: tuple[int, ...]) -> list[dict]:
    """ShadowKV's Fig. 1c: the SVD of every layer's pre-RoPE keys against the prefill's time, per prompt length."""
    rows = []
    for length in lengths:
        start = time.perf_counter()
        seen = record(model, ids[:length], 1, hooks=True)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for keys in seen.pre_rope:
            torch.linalg.svd(keys.float(), full_matrices=False)
        rows.append({"length": length, "prefill_s": prefill, "svd_s": time.perf_counter() - start})
        rows[-1]["svd_share"] = rows[-1]["svd_s"] / prefill
    return rows


def chunk_cosines(model: PreTrainedModel, ids: list[int], chunk: int, threshold: float) -> dict:
    """ShadowKV's Fig. 3b: per layer, the chunks of ``chunk`` post-RoPE keys whose minimum cosine similarity to their
    mean is under ``threshold`` (a share of all chunks and heads), and the 0.3% quantile of that minimum."""
    seen = record(model, ids[: len(ids) // chunk * chunk], 1)
    shares, quantiles = [], []
    for keys in seen.keys:
        valid = torch.ones(1, keys.shape[-2], dtype=torch.bool, device=keys.device)
        minimum = chunk_min_cosine(
            keys[None].float(), chunk_landmarks(keys[None].float(), valid, chunk), valid, chunk
        ).flatten()
        shares.append(outlier_fraction(minimum, threshold))
        quantiles.append(float(minimum.quantile(0.003)))
    return {"outlier_share": shares, "quantile_0.3%": quantiles}


def needle_accuracy_by_rank(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: Settings, ranks: tuple[int, ...]
) -> list[dict]:
    """ShadowKV's Fig. 3a: a needle's retrieval (depths 10%, 50%, 90%) with ShadowKV at each key rank, through the
    accuracy suite's needle task and scoring."""
    from ..generation.generate import generate  # noqa: PLC0415
    from .accuracy import build_samples  # noqa: PLC0415
    from .metrics import score  # noqa: PLC0415

    samples = build_samples(tokenizer, ["niah"], [settings.tokens], [0.1, 0.5, 0.9], 1, 0, "essays")
    rows = []
    for rank in ranks:
        scores = [
            score(
                cast(
                    str,
                    generate(
                        model,
                        tokenizer,
                        sample.prompt(tokenizer),
                        method=ShadowKV(budget=settings.budget, rank=rank),
                        max_new_tokens=sample.max_new_tokens,
                    ).text,
                ),  # (one prompt: one text)
                sample.turns[0].answers,
                sample.metric,
            )
            for sample in samples
        ]
        rows.append({"rank": rank, "accuracy": sum(scores) / len(scores)})
    return rows


def observe(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: Settings | None = None, progress: bool = True
) -> dict:
    """Every measurement above on ``model``, over a document built from the essays haystack with two facts in it."""
    from ..generation.generate import generate  # noqa: PLC0415

    settings = settings or Settings()
    document = fill(tokenizer, settings.tokens, [(0.3, NEEDLES[0][0]), (0.7, NEEDLES[1][0])], kind="essays")
    question = NEEDLES[0][1]

    def text(kind: str, n: int) -> list[int]:
        return tokenizer(fill(tokenizer, n, [], kind=kind), add_special_tokens=False)["input_ids"]

    ids = text("essays", max(settings.tokens, *settings.lengths))
    context = ids[: settings.tokens * 8 // 9]
    dim = model.config.get_text_config()
    steps = {
        "snapkv_along_generation": lambda: hit_rates_along_generation(
            model, tokenizer, [{"role": "user", "content": document + "\n\n" + LONG_ANSWER}], settings
        ),
        "snapkv_question_after": lambda: hit_rates_along_generation(
            model, tokenizer, [{"role": "user", "content": document + "\n\n" + question}], settings
        ),
        "snapkv_question_before": lambda: hit_rates_along_generation(
            model, tokenizer, [{"role": "user", "content": question + "\n\n" + document}], settings
        ),
        "snapkv_question_pairs": lambda: pair_hit_rates(model, tokenizer, document, [q for _, q in NEEDLES], settings),
        "shadowkv_spectra": lambda: key_spectra(model, ids[: settings.tokens]),
        "shadowkv_subspaces": lambda: subspace_similarities(
            model,
            context,
            ids[len(context) : settings.tokens],
            text("prose", len(context))[: len(context)],
            settings.rank,
        ),
        "shadowkv_svd_share": lambda: svd_share(model, ids, settings.lengths),
        "shadowkv_chunks": lambda: chunk_cosines(
            model, ids[: settings.tokens], settings.chunk, settings.outlier_cosine
        ),
        "shadowkv_reuse": lambda: generate(
            model,
            tokenizer,
            [{"role": "user", "content": document + "\n\n" + LONG_ANSWER}],
            method=ShadowKV(budget=settings.budget),
            max_new_tokens=settings.generated,
        ).stats["chunk_hit_rate"],
        "shadowkv_rank_accuracy": lambda: needle_accuracy_by_rank(
            model, tokenizer, settings, settings.ranks(dim.num_key_value_heads * dim.head_dim)
        ),
    }
    results: dict = {"settings": asdict(settings)}
    for name, step in tqdm(steps.items(), desc="observe", disable=not progress, unit="step"):
        results[name] = step()
    return results


def write_report(results: dict, out: str | Path) -> list[str]:
    """``observations.json`` and one PNG per figure in ``out``; returns the names written."""
    from .plots import observation_figures  # noqa: PLC0415 - only to draw

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "observations.json").write_text(json.dumps(results, indent=1))
    return ["observations.json", *observation_figures(results, folder)]
