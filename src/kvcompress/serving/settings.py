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
import json
import logging
import math
import os
import sys
import urllib.request
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig

from ..generation.conversation import PROBES, shared_prefix
from ..integrations.transformers.rope import Rotary, check_rope_config
from ..methods import METHODS, method_from_name
from ..methods.base import InvalidParameterError, Method, field_specs
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


def check_servable(method: Method, cache_dtype: str | None = None) -> Method:
    """``method`` if a vLLM engine whose pool is ``cache_dtype`` (None: the model's dtype) can apply it, else
    ``InvalidParameterError`` naming what is refused and why. In an fp8 pool, ``kv_bits=8, kv_format='fp8'`` says
    what the pool stores: taken, and returned as the pool's own precision (the pool writes the codes)."""
    name = method.name
    if method.not_served is not None:
        raise InvalidParameterError(
            f"method={name!r} cannot be served by vLLM: {method.not_served}; servable: {', '.join(servable_names())}"
        )
    owner = type(method).__name__
    if isinstance(method, PromptMethod):
        for field, uniform in (("heads", method.heads), ("layers", method.layers)):
            if uniform != "uniform":
                raise InvalidParameterError(
                    f"{owner}: {field}={uniform!r} cannot be served by vLLM (a paged cache holds the same count per KV "
                    "head and layer); valid: 'uniform'"
                )
    if fp8_pool(cache_dtype) and (method.kv_bits, method.kv_format, method.key_bits) == (8, "fp8", None):
        method = dataclasses.replace(method, kv_bits=16, kv_format="int")
    if method.kv_bits != 16:
        pool = (
            f"this server's pool is {cache_dtype}: every request is stored as kv_bits=8, kv_format='fp8'; valid: "
            "16, or kv_bits=8 with kv_format='fp8'"
            if fp8_pool(cache_dtype)
            else "vLLM's cache pool has one dtype for every request: `kvcompress serve --kv-cache-dtype fp8` stores "
            "each as kv_bits=8, kv_format='fp8' would; valid: 16"
        )
        raise InvalidParameterError(
            f"{owner}: kv_bits={method.kv_bits} cannot be served per request (with "
            f"kv_format={method.kv_format!r}: {pool})"
        )
    if getattr(method, "decode_budget", None) is not None:
        raise InvalidParameterError(
            f"{owner}: decode_budget={method.decode_budget} cannot be served by vLLM: kvcompress's plugin selects a "
            "request's blocks once, at the end of its prefill, and does not re-select them while it decodes; valid: "
            "no decode_budget (docs/vllm.md)"
        )
    if getattr(method, "kv_bytes", None) is not None:
        raise InvalidParameterError(
            f"{owner}: kv_bytes={method.kv_bytes} cannot be served by vLLM (its pool holds every request in one dtype, "
            "the same count per KV head and layer); valid: budget or ratio"
        )
    if getattr(method, "evict_during_decoding", False):
        raise InvalidParameterError(
            f"{owner}: evict_during_decoding=True cannot be served by vLLM (it compresses at the end of a prefill)"
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
    except InvalidParameterError as err:
        raise InvalidParameterError(f"{FIELD}: {err}") from None


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
            f"{FIELD}: method={method.name!r} cannot be served on model type {kind!r}: it has sliding-window layers "
            f"({', '.join(map(str, sliding_layers(config)))}), which vLLM pages apart from a compressed cache; serve "
            "it with method='full', or compress it with the library (kvcompress generate)"
        )
    if method.needs_rotary():
        problem = check_rope_config(config, 0)
        if problem:
            raise InvalidParameterError(
                f"{FIELD}: method={method.name!r} scores with the model's rotary embedding, and model type {kind!r}: "
                f"{problem}"
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


def serve_argv(model: str, method: Method, host: str, port: int, vllm_flags: list[str]) -> list[str]:
    """The arguments of vLLM's OpenAI-compatible server: the model, the plugin's scheduler and request
    middleware, the engine's method, the address, then the user's own vLLM flags (``vllm serve --help``)."""
    return [
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--scheduler-cls",
        SCHEDULER,
        "--middleware",
        MIDDLEWARE,
        "--kv-transfer-config",
        json.dumps(CONNECTOR),
        "--additional-config",
        json.dumps(engine_settings(method)),
        "--shutdown-timeout",
        "30",
        *vllm_flags,  # SIGINT/SIGTERM: finish, then stop
    ]


GiB = 1 << 30
# vLLM's API server and engine processes (0.7 and 0.6 GiB resident here, serving the embedded model), which start
# after `kvcompress serve` reads the free memory and before vLLM's worker checks its reservation against it
SERVER_PROCESSES = 3 * GiB // 2
VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM's --gpu-memory-utilization, on the CPU build the share of the NUMA node reserved
UTILIZATION = ("--gpu-memory-utilization", "--device-memory-utilization")
KV_BYTES = "--kv-cache-memory-bytes"
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache, vLLM's older setting


def flag_value(flags: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of ``names`` in ``flags`` (``--name value`` or ``--name=value``), None if absent."""
    found = None
    for i, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name in names:
            found = value if eq else (flags[i + 1] if i + 1 < len(flags) else "")
    return found


def memory_flags(
    flags: list[str], total: int, available: int, env: dict[str, str], parse_bytes: Any = int
) -> list[str]:
    """The flags that size vLLM's CPU build to the memory that is free, checked before vLLM starts (it would refuse in
    its worker, with a wall of tracebacks). With none of --gpu-memory-utilization, --kv-cache-memory-bytes or
    VLLM_CPU_KVCACHE_SPACE given: a utilization reserving the free memory but a headroom for the server's other
    processes (vLLM's default, 0.92 of the node, fails wherever other processes hold memory). What the user gave is
    kept, or refused in one line saying what fits. ``total``/``available``: the memory node's bytes, as vLLM reads them;
    ``parse_bytes``: vLLM's reading of a byte count ("4G")."""
    room = available - SERVER_PROCESSES  # what vLLM's worker will find free
    fits = math.floor(100 * min(VLLM_DEFAULT_UTILIZATION, max(room - available // 10, 0) / total)) / 100  # 10% spare
    free = f"{available / GiB:.1f} GiB of this machine's {total / GiB:.1f} GiB are free"
    kv_bytes, env_gib, most = flag_value(flags, (KV_BYTES,)), env.get(KV_ENV, ""), max(room, 0) // GiB
    if env_gib:  # vLLM's CPU build takes the environment's over the flag
        asked, given, fix = int(env_gib) * GiB, f"{KV_ENV}={env_gib}", f"set {KV_ENV} to at most {most}"
    elif kv_bytes is not None:
        asked, given, fix = parse_bytes(kv_bytes), f"{KV_BYTES} {kv_bytes}", f"give at most {KV_BYTES} {most}G"
    if env_gib or kv_bytes is not None:
        if asked > room:
            raise InvalidParameterError(
                f"{given} asks for {asked / GiB:.1f} GiB of KV cache and {free}; {fix}, "
                "or leave it out to size it from the free memory"
            )
        return []
    utilization = flag_value(flags, UTILIZATION)
    if utilization is not None:
        if float(utilization) * total > room:
            fix = (
                "stop other processes"
                if fits * total < 2 * GiB
                else (f"pass --gpu-memory-utilization {fits:.2f}, or {KV_BYTES} 4G, or leave both out")
            )
            reserved = f"{float(utilization) * total / GiB:.1f} GiB"
            raise InvalidParameterError(f"--gpu-memory-utilization {utilization} reserves {reserved} and {free}; {fix}")
        return []
    if fits * total < 2 * GiB:
        raise InvalidParameterError(
            f"kvcompress serve needs about 2 GiB for the model and its KV cache and {free}; "
            f"pass {KV_BYTES} with what fits, or stop other processes"
        )
    return ["--gpu-memory-utilization", f"{fits:.2f}"]


def quiet_teardown() -> None:
    """An exit handler for `kvcompress serve`'s processes, registered before vLLM's own so that it runs after them:
    what the interpreter's teardown prints from then on goes to /dev/null. The extension modules vLLM loads (Triton's,
    built with nanobind) list there the objects they never freed, 28 lines after a clean stop that say nothing about
    the server."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def dtype_flags(flags: list[str], on_cpu: bool) -> list[str]:
    """The precision a server runs in when the user names none: on a CPU the library's, float32 (vLLM's ``--dtype
    auto`` serves a float32 checkpoint in bfloat16 there, where near-tied tokens part from the library's and a small
    model's answers can run in loops); elsewhere vLLM's own."""
    return ["--dtype", "float32"] if on_cpu and flag_value(flags, ("--dtype",)) is None else []


def ready(base: str) -> bool:
    """Whether the server at ``base`` (``http://host:port``) answers its health check."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def gauge(base: str, name: str) -> float:
    """A gauge of the server's Prometheus endpoint (``vllm:num_requests_running``, ...), summed over its labels."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " ")))


class QuietStop(logging.Filter):
    """Drops the one error vLLM's API server logs when a deliberate stop races its output loop: once the server
    says its shutdown was triggered (SIGINT/SIGTERM), the loop still awaiting the engine it is stopping reports
    the engine dead, with a traceback saying it "encountered an issue" (vLLM 0.32 stops the engine before it
    cancels that loop; plain vLLM logs it too, 1 stop in 4 here). Any other error, and that one before a stop,
    is kept."""

    LOGGERS = ("vllm.entrypoints.launchers.launcher", "vllm.v1.engine.async_llm")  # where each record is logged

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().endswith("shutdown triggered"):
            self.stopping = True
        error = record.exc_info[1] if record.exc_info else None
        return not (self.stopping and type(error).__name__ == "EngineDeadError")

    def install(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)


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

    @functools.cached_property
    def values(self) -> torch.Tensor:
        return self.stored_values() if callable(self.stored_values) else self.stored_values

    @property
    def prompt_tokens(self) -> torch.Tensor:
        return self.slot_validity().sum(dim=-1)

    def slot_validity(self) -> torch.Tensor:
        return torch.ones(self.keys.shape[0], self.keys.shape[2], dtype=torch.bool)
