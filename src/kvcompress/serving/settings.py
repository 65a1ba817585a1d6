"""What serving compressed caches through vLLM needs apart from vLLM itself: which methods a vLLM
engine can apply, a request's own settings, and the command line that starts vLLM's server with
the plugin (``kvcompress serve``), and what a method's scoring reads of one request's prompt in a worker
(``PromptLayer``). Imports no vLLM, so bad settings are refused before vLLM starts
and the API server checks a request's settings with the library's own validation.

A request chooses its method in its body, beside OpenAI's fields (``extra_body`` in the ``openai``
client): ``{"kvcompress": {"method": "snapkv", "budget": 256}}`` (any field of the method; none:
the engine's method; ``{"method": "full"}``: its full cache).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig

from ..cache.intake import ObservationPass
from ..generation.conversation import PROBES, shared_prefix
from ..integrations.transformers.rope import Rotary, check_rope_config
from ..methods import METHODS, method_from_name
from ..methods.base import Method
from ..methods.fields import InvalidParameterError, field_specs, setting
from ..methods.prompt import PromptMethod

FIELD = "kvcompress"  # the request body's field, and the key of the engine's settings in vLLM's additional_config
QUESTION_START = "question_start"  # a request's own field in it: the prompt token where its question begins
ENGINE_ENV = "KVCOMPRESS_ENGINE"  # the engine's settings for the API server's middleware (``kvcompress serve`` sets it)
SCHEDULER = "kvcompress.serving.vllm_scheduler.KVCompressScheduler"
CONNECTOR = {
    "kv_connector": "KVCompressConnector",
    "kv_connector_module_path": "kvcompress.serving.vllm_plugin",
    "kv_role": "kv_both",
}
MIDDLEWARE = "kvcompress.serving.vllm_api.RequestSettings"


def servable_names() -> tuple[str, ...]:
    """The methods vLLM can serve (each declares it: ``Method.not_served`` None), in the registry's order: those
    scored from the prefill alone, one score per prompt position and KV head, the same count per head (what a paged
    cache can hold after the prefill step; the rest are refused by name, with their reason)."""
    return tuple(name for name, cls in METHODS.items() if cls.not_served is None)


SERVABLE = servable_names()  # the built-in ones (``servable_names()`` also counts methods registered later)


# The fields a served request cannot set (each refused with its reason by ``check_servable``), left out of the fields
# an unknown one's refusal lists
NOT_SERVED = (
    "decode_budget",
    "every",
    "decode_window",
    "head_floor",
    "layer_floor",
    "pyramid_beta",
    "key_bits",
    "evict_during_decoding",
    "kv_bytes",
)


def fp8_pool(cache_dtype: str | None) -> bool:
    """Whether a vLLM ``--kv-cache-dtype`` stores e4m3 codes (what the library's ``kv_format='fp8'`` writes)."""
    return cache_dtype in ("fp8", "fp8_e4m3")


def _pool_holds(cache_dtype: str | None) -> str:
    """What a pool of ``cache_dtype`` holds every request in, a refusal's template (its value: ``pool``)."""
    if fp8_pool(cache_dtype):
        return (
            "this server's pool is {pool}: every request is stored as {kv_bits=8}, {kv_format='fp8'}; valid: 16, or "
            "{kv_bits=8} with {kv_format='fp8'}"
        )
    return (
        "vLLM's cache pool has one dtype for every request: `kvcompress serve --kv-cache-dtype fp8` stores each as "
        "{kv_bits=8}, {kv_format='fp8'} would; valid: 16"
    )


def check_servable(method: Method, cache_dtype: str | None = None) -> Method:
    """``method`` if a vLLM engine whose pool is ``cache_dtype`` (None: the model's dtype) can apply it, else
    ``InvalidParameterError`` naming what is refused and why. In an fp8 pool, ``kv_bits=8, kv_format='fp8'`` says
    what the pool stores: taken, and returned as the pool's own precision (the pool writes the codes)."""
    name = method.name
    if method.not_served is not None:
        raise InvalidParameterError(
            "{method=} cannot be served by vLLM: {why}; servable: {valid}",
            method=name,
            why=method.not_served,
            valid=", ".join(servable_names()),
        )
    owner = type(method).__name__
    if isinstance(method, PromptMethod):
        for field, uniform in (("heads", method.heads), ("layers", method.layers)):
            if uniform != "uniform":
                raise InvalidParameterError(
                    "{owner}: " + setting(field) + " cannot be served by vLLM (a paged cache holds the same count per "
                    "KV head and layer); valid: 'uniform'",
                    owner=owner,
                    **{field: uniform},
                )
    if fp8_pool(cache_dtype) and (method.kv_bits, method.kv_format, method.key_bits) == (8, "fp8", None):
        method = dataclasses.replace(method, kv_bits=16, kv_format="int")
    if method.kv_bits != 16:
        raise InvalidParameterError(
            "{owner}: {kv_bits=} cannot be served per request (with {kv_format=}: " + _pool_holds(cache_dtype) + ")",
            owner=owner,
            kv_bits=method.kv_bits,
            kv_format=method.kv_format,
            pool=cache_dtype,
        )
    decode_budget, kv_bytes = getattr(method, "decode_budget", None), getattr(method, "kv_bytes", None)
    if decode_budget is not None:
        raise InvalidParameterError(
            "{owner}: {decode_budget=} cannot be served by vLLM: kvcompress's plugin selects a request's blocks once, "
            "at the end of its prefill, and does not re-select them while it decodes; valid: no {decode_budget!n} "
            "(docs/vllm.md)",
            owner=owner,
            decode_budget=decode_budget,
        )
    if kv_bytes is not None:
        raise InvalidParameterError(
            "{owner}: {kv_bytes=} cannot be served by vLLM (its pool holds every request in one dtype, the same count "
            "per KV head and layer); valid: {budget!n} or {ratio!n}",
            owner=owner,
            kv_bytes=kv_bytes,
        )
    if getattr(method, "evict_during_decoding", False):
        raise InvalidParameterError(
            "{owner}: {evict_during_decoding=} cannot be served by vLLM (it compresses at the end of a prefill)",
            owner=owner,
            evict_during_decoding=True,
        )
    return method


def method_of(settings: Any, default: Method | None = None, cache_dtype: str | None = None) -> Method:
    """The method a request's ``kvcompress`` settings name (``{"method": NAME, FIELD: VALUE, ...}``;
    None or ``{}``: ``default``), validated as the library validates it for a pool of ``cache_dtype``
    (``check_servable``), its errors naming the field."""
    if (settings is None or settings == {}) and default is not None:
        return default
    if not isinstance(settings, dict):
        example = '{"method": "snapkv", "budget": 256}'
        raise InvalidParameterError(f"{FIELD} must be an object such as {example}; got {settings!r}")
    fields = dict(settings)
    name = fields.pop("method", None if default is None else default.name)
    if not isinstance(name, str):
        raise InvalidParameterError(f"{FIELD}.method={name!r} is invalid; valid: {', '.join(servable_names())}")
    if name not in METHODS:
        raise InvalidParameterError(f"{FIELD}.method={name!r} is unknown; valid: {', '.join(servable_names())}")
    known = {spec.name for spec in field_specs(METHODS[name])}
    unknown = sorted(key for key in fields if key not in known)
    if unknown:
        served = ", ".join(sorted(known - set(NOT_SERVED)))
        raise InvalidParameterError(f"{FIELD}: method {name!r} does not take {', '.join(unknown)}; served: {served}")
    try:
        return check_servable(method_from_name(name, **fields), cache_dtype)
    except InvalidParameterError as err:  # the same refusal, led by the request's field
        raise InvalidParameterError(f"{FIELD}: " + err.template, cli=err.cli, **err.values) from None


def question_start_of(settings: Any) -> tuple[Any, int | None]:
    """A request's ``kvcompress`` settings less its ``question_start`` (the prompt token where its question begins:
    SnapKV's window then votes with the question's own tokens, as the library's ``question_window`` does over a
    stored context), and that start, checked (None: not given)."""
    if not isinstance(settings, dict) or QUESTION_START not in settings:
        return settings, None
    fields = dict(settings)
    start = fields.pop(QUESTION_START)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidParameterError(
            f"{FIELD}.{QUESTION_START}={start!r} is invalid; it must be an integer >= 0 (the "
            "prompt token where the question begins)"
        )
    return fields, start


def check_question_start(start: int | None, prompt_tokens: int) -> None:
    """Refuse a question start that leaves no question in a ``prompt_tokens``-token prompt, naming the valid range."""
    if start is not None and start >= prompt_tokens:
        raise InvalidParameterError(
            f"{FIELD}.{QUESTION_START}={start} is invalid for this prompt of {prompt_tokens} "
            f"tokens; valid: 0 to {prompt_tokens - 1} (a question of at least one token)"
        )


def chat_question_start(tokenizer: Any, messages: list[dict], **template: Any) -> int | None:
    """Where a chat's conversation begins in its rendered prompt's tokens: the first token of the first message that
    is not a system (or developer) message, rendered as vLLM renders a chat (the template's text, tokenized without
    special tokens). A document in the system message is then the stored context and the conversation after it the
    question (its first turn votes with its own tokens; a later turn's last ``window`` reach into earlier turns, as
    the library's conversations over a stored context do); a document sent with its question in one message is part
    of the question, whose last ``window`` tokens then vote (what a request without a start gets). Found as the
    library finds a context's end (``conversation.context_ids``): where the prompt parts from the same chat whose first
    such message says something else (by text, then counted in tokens through a fast tokenizer's offsets: one
    tokenization, not three). None where it cannot be told (no such message, or content that is not text)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), None)
    if first is None or not all(isinstance(m.get("content"), str) for m in messages):
        return None
    chats = [messages, *([*messages[:first], {**messages[first], "content": probe}] for probe in PROBES[:2])]
    if not tokenizer.is_fast:  # (no offsets: the longest prefix of tokens the three share)
        return shared_prefix(
            [
                tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, **template), add_special_tokens=False)[
                    "input_ids"
                ]
                for chat in chats
            ]
        )
    text, *probes = (tokenizer.apply_chat_template(chat, tokenize=False, **template) for chat in chats)
    chars = len(os.path.commonprefix([text, *probes]))
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return sum(end <= chars for _, end in offsets)  # the tokens wholly before the conversation


def scorable(method: Method, config: Any) -> Method:
    """``method`` if a vLLM engine can apply it to a model with this transformers ``config`` (None: unknown here, not
    checked), else ``InvalidParameterError`` saying why in one line, the family's quirks read from its config, as
    the library reads them from the model: a method reading the rotary embedding needs RoPE kvcompress can invert
    (``rope.check_rope_config``); a compressing method needs every layer to attend the whole prompt (vLLM pages a
    sliding-window layer's cache apart and drops what leaves its window, which a compressed cache's slots are not)."""
    if config is None:
        return method
    kind = config.get_text_config().model_type
    if isinstance(method, PromptMethod) and sliding_layers(config):
        raise InvalidParameterError(
            f"{FIELD}: "
            + "{method=} cannot be served on model type {kind!r}: it has sliding-window layers ({layers}), "
            "which vLLM pages apart from a compressed cache; serve it with {method='full'}, or compress it with the "
            "library (kvcompress generate)",
            method=method.name,
            kind=kind,
            layers=", ".join(map(str, sliding_layers(config))),
        )
    if method.needs_rotary():
        problem = check_rope_config(config, 0)
        if problem:
            raise InvalidParameterError(
                f"{FIELD}: " + "{method=} scores with the model's rotary embedding, and model type {kind!r}: {problem}",
                method=method.name,
                kind=kind,
                problem=problem,
            )
    return method


POOLS = ("auto", "fp8", "fp8_e4m3")  # vLLM cache dtypes the plugin serves (fp8: the library's ``fp8`` codec, e4m3)
SINK_TYPES = ("gpt_oss",)  # model types whose attention adds learned sink logits


def check_pool(cache_dtype: str | None, config: Any) -> None:
    """Refuse, in one line, a vLLM ``--kv-cache-dtype`` the plugin cannot serve as the library computes it (None:
    vLLM's default). In an fp8 pool a prompt attends itself as computed (``KVCompressCPUImpl.attend_prompt``), which
    covers plain causal attention: models with sliding windows, soft-capped scores or learned sinks are refused."""
    if cache_dtype in (None, "auto"):
        return
    if cache_dtype not in POOLS:
        why = (
            "kvcompress's fp8 is e4m3 (vLLM's fp8)"
            if cache_dtype == "fp8_e5m2"
            else "kvcompress serves vLLM's CPU pools of the model's dtype or fp8"
        )
        raise InvalidParameterError(
            f"--kv-cache-dtype {cache_dtype} cannot be served with kvcompress: {why}; valid: {', '.join(POOLS)}"
        )
    if config is None:
        return
    text = config.get_text_config()
    quirks = [
        what
        for what, present in (
            ("sliding-window layers", bool(sliding_layers(config))),
            ("soft-capped attention scores", bool(getattr(text, "attn_logit_softcapping", None))),
            ("learned attention sinks", text.model_type in SINK_TYPES),
        )
        if present
    ]
    if quirks:
        raise InvalidParameterError(
            f"--kv-cache-dtype {cache_dtype} cannot be served with kvcompress on model type {text.model_type!r}: it "
            f"has {' and '.join(quirks)}, which kvcompress's prefill over an fp8 pool does not apply; valid: auto"
        )


def sliding_layers(config: Any) -> list[int]:
    """The layers of a model with ``config`` that attend a sliding window (its ``layer_types``, or every layer where
    the config sets ``sliding_window`` without layer types and does not turn it off)."""
    text = config.get_text_config()
    types = getattr(text, "layer_types", None)
    if types:
        return [index for index, kind in enumerate(types) if kind == "sliding_attention"]
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) is not False:
        return list(range(text.num_hidden_layers))
    return []


def model_config(model: str) -> Any:
    """The transformers config of ``model`` (a folder, or a name already in the local hub cache), None if it cannot
    be read here (vLLM then reads it, and its workers check the method)."""
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None


def engine_settings(method: Method) -> dict[str, Any]:
    """The engine's default method as vLLM's ``additional_config`` carries it."""
    return {FIELD: {"method": method.name, **method.settings()}}


def engine_options(method: Method) -> dict[str, Any]:
    """What a vLLM engine (``vllm.LLM(model, **engine_options(method))``) needs to apply kvcompress:
    the plugin's scheduler and connector, the engine's method (vLLM's prefix caching stays on)."""
    return {
        "scheduler_cls": SCHEDULER,
        "kv_transfer_config": CONNECTOR,
        "additional_config": engine_settings(check_servable(method)),
    }


@dataclasses.dataclass
class PromptLayer:
    """What a method's scoring reads of a kvcompress layer (``PromptMethod.layer_scores``), for a worker's prompt (or
    prompts of one length): keys and values ``[b, kv_heads, tokens, dim]``, word spans, the layer's rotary, and the
    tokens from where each request says its question begins ``[b]`` (None: none says); every slot is real."""

    keys: torch.Tensor
    stored_values: torch.Tensor | Callable[[], torch.Tensor]  # (a reader: values read only where a method reads them)
    spans: torch.Tensor | None
    rotary: Rotary | None
    asked: torch.Tensor | None = None
    observation: ObservationPass | None = None  # (no pass: what a method scoring from one reads is refused first)

    @functools.cached_property
    def values(self) -> torch.Tensor:
        return self.stored_values() if callable(self.stored_values) else self.stored_values

    @property
    def prompt_tokens(self) -> torch.Tensor:
        return self.slot_validity().sum(dim=-1)

    def slot_validity(self) -> torch.Tensor:
        return torch.ones(self.keys.shape[0], self.keys.shape[2], dtype=torch.bool)
