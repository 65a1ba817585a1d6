"""One `kvcompress serve` as a user starts it (vLLM's defaults: its compiled graph, chunked prefill, its block size),
over time: a sequence of compressed requests, then a soak of many requests, sequential and in bursts, every answer
the library's. Runs where vLLM is installed (`make vllm`, CI's second part). ``KVCOMPRESS_SOAK_REQUESTS`` sets the
soak's size (60 here and in CI; `make vllm` runs 200)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass

import pytest

vllm = pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

import kvcompress as kvc  # noqa: E402
from kvcompress import demo  # noqa: E402
from kvcompress.generation.generate import _eos_ids  # noqa: E402
from kvcompress.integrations.transformers.models import default_model_dir  # noqa: E402
from kvcompress.serving import launch  # noqa: E402
from kvcompress.serving import settings as serving  # noqa: E402

from .served import Server, chat  # noqa: E402

pytestmark = pytest.mark.skipif(not (default_model_dir() / "model.safetensors").exists(), reason="no embedded model")
SOAK = int(os.environ.get("KVCOMPRESS_SOAK_REQUESTS", "60"))
ENGINE = kvc.SnapKV(budget=256)  # the server's own method; both sides run float32
# a pool of 320 blocks (10,240 tokens), which bursts of long prompts fill
FLAGS = [
    "--budget",
    "256",
    "--dtype",
    "float32",
    "--max-model-len",
    "4608",
    "--max-num-seqs",
    "16",
    "--num-gpu-blocks-override",
    "320",
]
SETTINGS = [
    None,
    {"method": "full"},
    {"method": "snapkv", "budget": 64},
    {"method": "snapkv", "budget": 512, "window": 16},
    {"method": "snapkv", "budget": 128, "clustering": "pool"},
    {"method": "streamingllm", "budget": 128},
    {"method": "h2o", "budget": 192},
    {"method": "expected", "budget": 256},
]
LONGEST = 128  # max_tokens is drawn from 1 to this


@pytest.fixture(scope="module")
def library():
    return kvc.load_model()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(FLAGS, tmp_path_factory.mktemp("serve") / "serve.log", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    try:
        yield served.start()
    finally:
        served.stop()


@dataclass
class Case:
    """A chat and the settings it is served with."""

    messages: list[dict]
    settings: dict | None

    def method(self) -> kvc.Method:
        return serving.method_of(self.settings, default=ENGINE)

    def key(self) -> str:
        return json.dumps([self.messages, self.settings], sort_keys=True)


class Library:
    """The library's greedy tokens for a case (computed once, ``LONGEST`` of them; shorter answers are prefixes)."""

    def __init__(self, library) -> None:
        self.model, self.tokenizer = library
        self.eos = _eos_ids(self.model, self.tokenizer)
        self.answers: dict[str, list[int]] = {}

    def expected(self, case: Case, max_tokens: int) -> list[int]:
        if case.key() not in self.answers:
            self.answers[case.key()] = kvc.generate(
                self.model, self.tokenizer, case.messages, method=case.method(), max_new_tokens=LONGEST
            ).token_ids[0]
        return self.strip(self.answers[case.key()][:max_tokens])

    def strip(self, ids: list[int]) -> list[int]:
        """Up to the first end-of-sequence token, without it."""
        return next((ids[:i] for i, t in enumerate(ids) if t in self.eos), list(ids))


async def ask(
    client, model: str, case: Case, max_tokens: int, stream: bool, abort_after: int | None = None
) -> list[int]:
    """The answer's token ids (vLLM's ``return_token_ids``); with ``abort_after``, the client disconnects after that
    many chunks of a streamed answer."""
    extra = {"return_token_ids": True, **({} if case.settings is None else {"kvcompress": case.settings})}
    common = dict(model=model, messages=case.messages, max_tokens=max_tokens, temperature=0, extra_body=extra)
    if not stream:
        reply = await client.chat.completions.create(**common)
        return list(reply.choices[0].model_extra["token_ids"])
    ids: list[int] = []
    chunks = await client.chat.completions.create(**common, stream=True)
    async for chunk in chunks:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
        if abort_after is not None and len(ids) >= abort_after:
            await chunks.close()
            break
    return ids


def served_answers(server: Server, plan: list[list[tuple]]) -> list[tuple]:
    """Send ``plan``: groups of (case, max_tokens, stream, abort_after) sent at once, one group after another;
    returns (request, token ids) for each request."""

    async def run() -> list[tuple]:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="none", timeout=1800, max_retries=0)
        model = (await client.models.list()).data[0].id
        answers = []
        for group in plan:
            ids = await asyncio.gather(*(ask(client, model, *request) for request in group))
            answers += list(zip(group, ids))
        await client.close()
        return answers

    return asyncio.run(run())


def differences(library: Library, answers: list[tuple]) -> list[str]:
    """Each answered request whose tokens are not the library's for the same case and max_tokens."""
    wrong = []
    for (case, max_tokens, stream, abort_after), ids in answers:
        if abort_after is not None:
            continue
        expected, got = library.expected(case, max_tokens), library.strip(ids)
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            wrong.append(
                f"{case.settings or 'server default'}, {len(case.messages[0]['content'])} characters, "
                f"max_tokens {max_tokens}, stream {stream}: differs at token {at}: "
                f"{library.tokenizer.decode(got)!r} vs the library's {library.tokenizer.decode(expected)!r}"
            )
    return wrong


def test_one_server_answers_every_compressed_request_as_the_library_does(server, library):
    """A compressed request, then compressed requests of other prompts, lengths and methods, and the first again,
    one after another on one server: each the library's tokens under the same settings (the second compressed
    request on a server used to answer "TheTheThe...")."""
    _, tokenizer = library
    first, second, third = chat(tokenizer, 1400, 0.3), chat(tokenizer, 1150, 0.6), chat(tokenizer, 600, 0.8)
    cases = [
        Case(first, None),
        Case(second, None),
        Case(first, None),
        Case(third, {"method": "h2o", "budget": 128}),
        Case(second, {"method": "snapkv", "budget": 128}),
        Case(first, {"method": "expected", "budget": 200}),
        Case(third, {"method": "streamingllm", "budget": 96}),
        Case(second, None),
    ]
    answers = served_answers(server, [[(case, 24, False, None)] for case in cases])
    assert differences(Library(library), answers) == []


def soak_plan(tokenizer, requests: int, seed: int = 0) -> list[list[tuple]]:
    """``requests`` requests over a few cases (prompts of 20 to 4,000 tokens, log-spaced, each with one of the
    settings), a third one at a time, the rest in bursts of 2 to 16; max_tokens 1 to ``LONGEST``, half streamed,
    some streams aborted."""
    rng = random.Random(seed)
    count = 12 + requests // 8
    lengths = [round(20 * 200 ** (i / (count - 1))) for i in range(count)]
    prose = tokenizer(chat(tokenizer, 200, 0.5)[0]["content"], add_special_tokens=False).input_ids
    cases = []
    for i, tokens in enumerate(lengths):
        if tokens < 200:  # a short message: its words only (the chat template adds ~30 tokens)
            messages = [{"role": "user", "content": tokenizer.decode(prose[: max(1, tokens - 30)])}]
        else:
            messages = chat(tokenizer, tokens - 100, rng.random())
        cases.append(Case(messages, SETTINGS[i % len(SETTINGS)]))
    cases += shared_cases(tokenizer, rng)
    rng.shuffle(cases)

    def request() -> tuple:
        max_tokens, stream = rng.randint(1, LONGEST), rng.random() < 0.5
        abort = rng.randint(1, 4) if stream and max_tokens > 16 and rng.random() < 0.15 else None
        return rng.choice(cases), max_tokens, stream, abort

    plan = [[request()] for _ in range(requests // 3)]
    longest = sorted(cases, key=lambda case: -len(case.messages[0]["content"]))[:6]
    plan.append([(case, LONGEST, False, None) for case in longest])  # more than the pool holds at once
    while (sent := sum(map(len, plan))) < requests:
        plan.append([request() for _ in range(min(rng.randint(2, 16), requests - sent))])
    return plan


FOLLOW_UPS = [
    "What colour is the door of the east wing?",
    "Repeat the access code, digits only.",
    "Which wing holds the archive room?",
    "Summarise the document in one sentence.",
    "What did you say the access code was?",
]


def shared_cases(tokenizer, rng: random.Random) -> list[Case]:
    """Questions over one shared document (each its own request, some with their own settings) and later turns of a
    chat over it: what prefix caching serves from the blocks the document's first request left cached."""
    document = chat(tokenizer, 2400, 0.35)[0]["content"].rsplit("\n\n", 1)[0]
    questions = [demo.QUESTION, *FOLLOW_UPS[:3]]
    cases = [Case([{"role": "user", "content": f"{document}\n\n{q}"}], rng.choice(SETTINGS)) for q in questions]
    turns = [
        {"role": "user", "content": f"{document}\n\n{demo.QUESTION}"},
        {"role": "assistant", "content": "The access code for the archive room in the east wing is 4817."},
    ]
    for follow_up in FOLLOW_UPS[3:]:
        turns += [{"role": "user", "content": follow_up}]
        cases.append(Case(list(turns), rng.choice(SETTINGS)))
        turns += [{"role": "assistant", "content": "I can answer that from the document."}]
    return cases


def test_a_conversation_finds_its_earlier_turns_in_the_prefix_cache(server, library):
    """Six turns of one chat through the OpenAI API, each re-sending the conversation: every later turn finds the
    earlier turn's prompt in vLLM's prefix cache (vLLM's own counter of prefix-cache hits grows by 90% of it or
    more) and is compressed with its own question over everything before it: each answer the library's tokens for
    the same messages (``kvc.generate(messages, method=SnapKV(budget=256))``, as a conversation over a stored
    document compresses each turn)."""
    model, tokenizer = library
    reference = Library(library)
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", timeout=600, max_retries=0)
    name = client.models.list().data[0].id
    messages, previous = chat(tokenizer, 1300, 0.5), 0
    for turn, follow_up in enumerate([*FOLLOW_UPS, None]):
        before = settled_gauge(server.base, "vllm:prefix_cache_hits_total")
        reply = client.chat.completions.create(
            model=name, messages=messages, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
        )
        hits = settled_gauge(server.base, "vllm:prefix_cache_hits_total") - before
        expected = kvc.generate(model, tokenizer, messages, method=ENGINE, max_new_tokens=24).token_ids[0]
        assert reference.strip(reply.choices[0].model_extra["token_ids"]) == reference.strip(expected), turn
        if turn:  # vLLM's counter here: 1,280 of turn 1's 1,390 tokens where the scheduler's own hit in-process is
            assert hits >= 0.9 * previous, (turn, hits, previous)  # 1,376 (the last whole block): unexplained
        previous = reply.usage.prompt_tokens
        if follow_up is not None:
            messages = [
                *messages,
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": follow_up},
            ]


def settled_gauge(base: str, name: str) -> float:
    """A counter of the server's once it has stopped moving (the API server records a step's statistics as it
    passes the step's outputs on, so a reply can come before its own step's counts)."""
    value, deadline = launch.gauge(base, name), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        value, last = launch.gauge(base, name), value
        if value == last:
            break
    return value


def test_a_soak_of_one_server_answers_every_request_as_the_library_does(server, library):
    """``SOAK`` requests on one server, sequential and in bursts of up to 16, every servable method and ``full``,
    prompts of 20 to 4,000 tokens, questions over one shared document and later turns of a chat over it (prefix-cache
    hits), a burst of the longest prompts beyond what the pool holds at once (vLLM admits them as blocks free),
    max_tokens 1 to 128, streamed or not, some aborted mid-answer: every greedy answer the library's (float32 both),
    then no request running, no KV block held (vLLM's gauges), nothing logged at ERROR."""
    reference = Library(library)
    plan = soak_plan(reference.tokenizer, SOAK)
    for group in plan:  # the library's answers first, so they do not share the 2 cores with the server's
        for case, max_tokens, *_ in group:
            reference.expected(case, max_tokens)
    answers = served_answers(server, plan)
    assert len(answers) == SOAK
    assert differences(reference, answers) == []
    assert server.idle(), "requests still running or KV blocks still held after the soak"
    assert launch.gauge(server.base, "vllm:prefix_cache_hits_total") > 0  # shared documents and turns were hits
    errors = [line for line in server.output().splitlines() if " ERROR " in line or "Traceback" in line]
    assert errors == [], errors[:20]
