"""What the plugin decides of a request when it arrives and tells the workers of it with every step: its method and
where its question begins (``Plan``, decided once), and each scheduled request's progress (``Scheduled``, in a
step's ``StepMethods``, which the KV connector carries from the scheduler to the workers)."""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import hashlib
import json
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..methods import SnapKV, method_from_name
from ..methods.base import Method
from ..methods.prompt import PromptMethod
from .settings import FIELD, check_pool, check_question_start, method_of, question_start_of, scorable


def engine_method(vllm_config: Any = None) -> Method:
    """The method of this vLLM instance (a request may name its own); refuses the engine settings the
    plugin cannot serve, naming them."""
    config = vllm_config or get_current_vllm_config()
    if config.speculative_config is not None:
        raise ValueError("kvcompress in vLLM needs no speculative decoding")
    check_pool(config.cache_config.cache_dtype, config.model_config.hf_config)
    settings = (config.additional_config or {}).get(FIELD)
    method = method_of(settings, default=SnapKV()) if settings is not None else SnapKV()
    return scorable(method, config.model_config.hf_config)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A request's compression as decided when it arrives: its method, its settings as the workers get them (JSON,
    parsed once per distinct settings: ``settled``), the prompt tokens from where it says its question begins (None:
    it says nothing, or its method reads as many: a question longer than SnapKV's window), the prompt tokens it
    keeps, and what its choice of them depends on (``choice_key``; None: something no key covers)."""

    method: Method
    settings: str
    asked: int | None
    kept: int
    choice: str | None = None

    def compresses(self, prompt: int) -> bool:
        return self.kept < prompt


def request_plan(request: Any, default: Method) -> Plan:
    """A request's own method (its ``kvcompress`` settings in ``SamplingParams.extra_args``: a dict, or the JSON
    string ``RequestSettings`` put in ``vllm_xargs``), else ``default``, and where its question begins (checked
    against its prompt)."""
    extra = request.sampling_params.extra_args if request.sampling_params is not None else None
    settings = (extra or {}).get(FIELD)
    settings, start = question_start_of(json.loads(settings) if isinstance(settings, str) else settings)
    method = method_of(settings, default=default)
    prompt = request.num_prompt_tokens
    check_question_start(start, prompt)
    asked = None if start is None else prompt - start
    if method.queries_needed(asked) == method.queries_needed():  # a question that fills the window: the window's
        asked = None  # last tokens vote, as for any prompt (the library's new prompt)
    settings_json = json.dumps({"method": method.name, **method.settings()}, sort_keys=True)
    return Plan(method, settings_json, asked, kept_count(method, prompt), choice_key(request, settings_json, asked))


def choice_key(request: Any, settings: str, asked: int | None) -> str | None:
    """What a request's kept tokens depend on, as a digest: its prompt's token ids, its method's settings, where its
    question begins, and whatever else vLLM's prefix cache tells prompts apart by (a LoRA adapter, a cache salt).
    Two requests with one key keep the same tokens (``Recalled``). None for a prompt given as embeddings or with
    multimodal inputs (their tokens do not say what the model saw)."""
    if request.prompt_token_ids is None or request.prompt_embeds is not None or request.mm_features:
        return None
    lora = request.lora_request
    digest = hashlib.blake2b(array.array("q", request.prompt_token_ids).tobytes(), digest_size=16)
    digest.update(json.dumps([settings, asked, lora and lora.lora_int_id, request.cache_salt]).encode())
    return digest.hexdigest()


def kept_count(method: Method, prompt: int) -> int:
    """Prompt tokens ``method`` keeps of a ``prompt``-token prompt (all of them: nothing to compress)."""
    if not isinstance(method, PromptMethod):
        return prompt
    return min(prompt, int(method.kept_tokens(torch.tensor([prompt]))[0]))


@dataclasses.dataclass
class Scheduled:
    """What a worker is told of one request scheduled in a step (by the connector, from the scheduler): its method's
    settings (JSON), its prompt's length, the tokens computed before the step and scheduled in it, the prompt tokens it
    keeps, those from where it says its question begins (None: it says nothing), where this prefill began
    (its prefix-cache hit: the prompt before it is read back from the paged cache), the prompt's token ids while it
    is prefilled (where its method reads them), the block ids the worker's block table holds for it (how its row is
    found), and the blocks its compressed cache lives in once the scheduler gave them."""

    settings: str
    prompt: int
    computed: int
    query: int
    kept: int
    asked: int | None = None
    start: int = 0
    tokens: list[int] | None = None
    row: list[int] | None = None
    area: list[int] | None = None
    choice: str | None = None
    recall: bool = False


@dataclasses.dataclass
class StepMethods(KVConnectorMetadata):
    """A step's scheduled requests by request id, the ids of every request holding blocks, scheduled or not, and the
    choices' keys the workers may let go (``Recalled``)."""

    requests: dict[str, Scheduled]
    live: set[str]
    forget: list[str] = dataclasses.field(default_factory=list)


RECALLED = (
    64  # prompts whose kept positions the workers hold (int32s, kv_heads x kept a layer: 92 KB for SmolLM2 at 256)
)


class Recalled:
    """The scheduler's ledger of the choices the workers hold, by key (``Plan.choice``): a request whose prompt,
    settings and question start were compressed before (a retry, the same question over a shared document) is
    prefilled over its whole prefix-cache hit and keeps what the earlier one kept, nothing scored (kept tokens depend
    on the request alone, so the choice is the one scoring would make). The ``capacity`` most recently used are
    held; one let go while a request is prefilled over it waits until that request's prompt is done."""

    def __init__(self, capacity: int = RECALLED) -> None:
        self.capacity = capacity
        self.held: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest use first
        self.using: dict[str, str] = {}  # request id -> the key its prefill recalls
        self.let_go: list[str] = []  # keys let go, the workers not yet told

    def recall(self, request_id: str, key: str | None) -> bool:
        """Whether the workers hold ``key``'s choice; if so ``request_id`` recalls it (held until ``done``)."""
        self.using.pop(request_id, None)
        if key is None or key not in self.held:
            return False
        self.held.move_to_end(key)
        self.using[request_id] = key
        return True

    def recorded(self, key: str) -> None:
        """The workers keep ``key``'s choice from this step on; the least recently used not in use let go."""
        self.held[key] = None
        self.held.move_to_end(key)
        spare = [old for old in self.held if old not in self.using.values()]
        for old in spare[: max(len(self.held) - self.capacity, 0)]:
            del self.held[old]
            self.let_go.append(old)

    def done(self, prefilling: set[str]) -> None:
        """Only the requests still ``prefilling`` recall a choice."""
        self.using = {request: key for request, key in self.using.items() if request in prefilling}

    def tell(self) -> list[str]:
        """The keys let go since the workers were last told."""
        told, self.let_go = self.let_go, []
        return told


@functools.lru_cache(maxsize=256)
def settled(settings: str) -> Method:
    """The method of settings the scheduler already checked (built once per distinct settings)."""
    fields = json.loads(settings)
    return method_from_name(fields.pop("method"), **fields)
