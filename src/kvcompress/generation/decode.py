"""Greedy decoding: one step as a single graph, and the loop that runs it without waiting on the device.

``greedy_step`` feeds every row's last token through the model and writes the next one, all in
place on a ``DecodeState`` of device tensors (tokens, positions, which rows finished, what each step
produced). Together with the cache's fixed-capacity buffers and device-side write positions
(``cache/``), nothing in a step depends on a host value, so ``torch.compile(fullgraph=True)``
traces it once and, on a GPU, the compiled step is captured as a CUDA graph by hand and replayed:
one launch per token instead of a thousand. The host keeps its counters with ``cache.advance``
after each compiled step, and learns whether every row finished one step late (a pinned flag copied
asynchronously), so it never waits for the step it just launched.

Compiled decoding rounds every shape a request sets to a bucket (``slots.capacity_bucket``: the
buffers' capacities, the width of the produced tokens), so a request of another prompt length or
``max_new_tokens`` in the same bucket reuses the compiled step; the time spent compiling (and, on a
GPU, capturing) is counted apart (``compile_s``), never as decoding.

The first step always runs eagerly: it times the SDPA kernels for the decoding phase
(``kernel_choice.choose_backends``) before any tracing bakes the choice in. On a GPU the second step
runs the compiled function once on a side stream (the warm-up a capture needs), and the third is
captured and replayed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters
from transformers import PreTrainedModel

from ..cache.kv_cache import KVCompressCache
from ..methods.fields import InvalidParameterError
from ..storage.slots import capacity_bucket
from .stops import Stops

RECOMPILE_LIMIT = 64  # distinct cache layouts (methods, models, batch sizes) one process may compile


@dataclass(frozen=True)
class Compile:
    """How ``generate(..., compile=...)`` compiles the decoding step: ``torch.compile``'s ``backend``
    and ``mode``; ``cuda_graph`` captures the compiled step as a CUDA graph on a GPU (by hand, so
    ``mode`` should not ask inductor for its own graphs as well)."""

    backend: str = "inductor"
    mode: str | None = None
    cuda_graph: bool = True


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding instead of greedy: logits divided by ``temperature`` (> 0), the smallest set of tokens whose
    probability reaches ``top_p`` (nucleus sampling), drawn with ``seed`` (None: a random seed)."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class DecodeState:
    """What decoding carries from step to step, on the device."""

    token: torch.Tensor  # [b]: each row's last produced token, fed by the next step
    position: torch.Tensor  # [b]: RoPE position of each row's next real token
    finished: torch.Tensor  # [b] bool: the row produced an end token (its later tokens are fed as padding)
    produced: torch.Tensor  # [b, max_new_tokens]: the tokens produced, one column per step
    fed_real: torch.Tensor  # [b, max_new_tokens - 1]: whether each fed token was real
    count: torch.Tensor  # [1]: tokens produced so far
    eos: torch.Tensor  # [e]: the end tokens
    # sampling (None: greedy): each step's uniform noise [b, vocab], drawn by the host before the step (no
    # generator inside a compiled step), and the temperature and top-p as [1] tensors (no recompile per value)
    noise: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None

    @classmethod
    def start(
        cls,
        logits: torch.Tensor,
        position: torch.Tensor,
        max_new_tokens: int,
        eos: set[int],
        buckets: bool = False,
        sampling: Sampling | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeState:
        """The state after the prompt: ``logits [b, vocab]`` give each row's first token (greedy, or drawn with
        ``sampling`` from ``generator``); room for ``max_new_tokens`` (with ``buckets``, rounded to
        ``capacity_bucket``, as compiled decoding needs)."""
        device, batch = logits.device, logits.shape[0]
        width = capacity_bucket(max_new_tokens) if buckets else max_new_tokens
        eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
        produced = torch.zeros(batch, width, dtype=torch.long, device=device)
        fed_real = torch.zeros(batch, width - 1, dtype=torch.bool, device=device)
        count = torch.ones(1, dtype=torch.long, device=device)
        token = torch.zeros(batch, dtype=torch.long, device=device)
        state = cls(token, position.clone(), token.bool(), produced, fed_real, count, eos_ids)
        if sampling is not None:
            state.noise = torch.empty(logits.shape, dtype=torch.float32, device=device)
            state.temperature = torch.tensor([float(sampling.temperature)], device=device)
            state.top_p = torch.tensor([float(sampling.top_p)], device=device)
            state.draw(generator)
        token.copy_(next_token(logits, state))
        produced[:, 0] = token
        state.finished.copy_(torch.isin(token, eos_ids))
        return state

    def draw(self, generator: torch.Generator | None) -> None:
        """The next step's noise (sampling only)."""
        if self.noise is not None:
            torch.rand(self.noise.shape, generator=generator, device=self.noise.device, out=self.noise)


def next_token(logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """Each row's next token from ``logits [b, vocab]``: the argmax, or with sampling a draw from the nucleus
    (the most probable tokens until their probability reaches top-p) of the temperature-scaled distribution, by the
    Gumbel-max trick over the state's noise (the same draw for the same noise: a seed repeats an answer)."""
    noise, temperature, top_p = state.noise, state.temperature, state.top_p
    if noise is None or temperature is None or top_p is None:  # greedy (sampling sets the three together)
        return logits.argmax(dim=-1)
    ordered, order = (logits.float() / temperature).sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    ordered = ordered.masked_fill(probs.cumsum(dim=-1) - probs > top_p, float("-inf"))  # past the nucleus
    gumbel = -torch.log(-torch.log(noise.clamp(1e-10, 1 - 1e-7)))
    return order.gather(-1, (ordered + gumbel).argmax(dim=-1, keepdim=True)).squeeze(-1)


def greedy_step(model: PreTrainedModel, cache: KVCompressCache, state: DecodeState) -> None:
    """Feed each row's last token (as padding where the row finished) and record the next one (greedy, or drawn
    from the state's noise: ``next_token``)."""
    real = ~state.finished
    fed_position = (state.position + real.long() - 1).clamp(min=0)  # padding: the position before (never attended)
    logits = model(
        input_ids=state.token[:, None],
        position_ids=fed_position[:, None],
        # the new token's own block: the kvcompress attention reads padding from it
        attention_mask=real[:, None, None, None],
        **{cache.keyword: cache},
        use_cache=True,
        logits_to_keep=1,
    ).logits
    token = next_token(logits[:, -1], state)
    state.fed_real.index_copy_(1, state.count - 1, real[:, None])
    state.produced.index_copy_(1, state.count, token[:, None])
    state.count.add_(1)
    state.position.add_(real.long())
    state.finished.logical_or_(torch.isin(token, state.eos))
    state.token.copy_(token)


_compiled: dict[Compile, Callable] = {}


def compiled_step(options: Compile) -> Callable:
    """``greedy_step`` compiled as one graph (``fullgraph=True``: a graph break raises)."""
    if options not in _compiled:
        _compiled[options] = torch.compile(greedy_step, fullgraph=True, backend=options.backend, mode=options.mode)
    return _compiled[options]


class StepRunner:
    """Runs greedy steps over one cache: eagerly, or compiled (and on a GPU replayed as a CUDA graph)."""

    def __init__(
        self, model: PreTrainedModel, cache: KVCompressCache, state: DecodeState, compile: Compile | None
    ) -> None:
        self.model, self.cache, self.state, self.options = model, cache, state, compile
        self.cuda = state.token.is_cuda
        self.calls = 0
        self.compile_s, self.compile_steps = 0.0, 0  # steps that compiled (or captured) and their time
        self.graph: torch.cuda.CUDAGraph | None = None
        self.flags = torch.zeros(2, dtype=torch.bool, pin_memory=self.cuda)  # lagged "all finished" (read on CUDA)
        self.events = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []

    def step(self) -> None:
        """One step; the host's counters move on with it."""
        options = self.options
        if options is None or self.calls == 0:  # eager (the first step also times the SDPA kernels)
            greedy_step(self.model, self.cache, self.state)
        else:
            graphs, capturing = (
                counters["stats"]["unique_graphs"],
                self.cuda and options.cuda_graph and self.graph is None,
            )
            self.cache.prepare_step(1)  # between graphs: a decoding bound's re-selection
            start = time.perf_counter()
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                self._compiled(options)
            if capturing or counters["stats"]["unique_graphs"] != graphs:
                if self.cuda:
                    torch.cuda.synchronize(self.state.token.device)
                self.compile_s += time.perf_counter() - start
                self.compile_steps += 1
            self.cache.advance(1)
        if self.cuda:
            slot = self.calls % 2
            self.flags[slot].copy_(self.state.finished.all(), non_blocking=True)
            self.events[slot].record()
        self.calls += 1

    def _compiled(self, options: Compile) -> None:
        run = compiled_step(options)
        if not (self.cuda and options.cuda_graph):
            run(self.model, self.cache, self.state)
        elif self.graph is not None:
            self.graph.replay()
        elif self.calls == 1:  # the warm-up a capture needs: the compiled step once, on a side stream
            side = torch.cuda.Stream(self.state.token.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run(self.model, self.cache, self.state)
            torch.cuda.current_stream().wait_stream(side)
        else:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                run(self.model, self.cache, self.state)
            self.graph.replay()  # capturing records the step; replaying runs it

    def all_finished(self) -> bool:
        """Whether every row had finished as of the step before last (on a CPU: as of the last
        step), so the host never waits for the step it just launched."""
        if not self.cuda:
            return bool(self.state.finished.all())
        if self.calls < 2:
            return False
        slot = (self.calls - 2) % 2
        self.events[slot].synchronize()
        return bool(self.flags[slot])


def check_capturable(cache: KVCompressCache) -> None:
    """Refuse, naming it, a cache whose decoding step reads the host (it cannot be one graph)."""
    for layer in cache.layers:
        problem = layer.policy.uncapturable()
        if problem:
            raise InvalidParameterError(
                "kvcompress: {compile=} cannot capture {method}'s decoding step: {problem}; run it without compile",
                compile=True,
                method=cache.method.describe(),
                problem=problem,
            )


def _stream(streamer: Any, state: DecodeState, column: int, ended: torch.Tensor) -> torch.Tensor:
    """Give ``streamer`` the tokens of step ``column`` of the rows that had not produced an end token before
    it; returns which rows have ended now."""
    if streamer is None:
        return ended
    tokens, ended_now = state.produced[:, column].cpu(), ended | state.finished.cpu()
    if not bool(ended.all()):
        streamer.put(tokens[~ended])
    return ended_now


@dataclass
class Decoded:
    """What ``greedy_decode`` returns."""

    tokens: list[list[int]]  # each row's tokens, up to and including its end token
    finished: list[bool]  # whether the row produced an end token
    steps: int  # decoding steps run
    # seconds of the steps that compiled the decoding step (or captured it), included in the loop's time
    compile_s: float
    compile_steps: int  # those steps
    # [b, steps]: which fed tokens were real (a finished row is fed padding until the loop stops)
    fed_real: torch.Tensor
    position: torch.Tensor  # [b]: each row's next RoPE position


def greedy_decode(
    model: PreTrainedModel,
    cache: KVCompressCache,
    logits: torch.Tensor,
    position: torch.Tensor,
    max_new_tokens: int,
    eos: set[int],
    compile: Compile | None,
    sampling: Sampling | None = None,
    streamer: Any = None,
    stops: Stops | None = None,
) -> Decoded:
    """Decoding after the prompt (``logits [b, vocab]``, next positions ``position [b]``), greedy or with
    ``sampling``, until every row produced an end token or ``max_new_tokens`` are produced. Compiled, every
    shape the request sets is rounded to a bucket, so later requests in it reuse the graph. ``streamer``
    (transformers' ``TextStreamer`` contract: ``put(tokens)``, ``end()``) is given each step's tokens as they
    come, up to each row's end token (a read from the device per step). ``stops``: stop strings, which end a row as
    ``max_new_tokens`` would, at the token that completed one (stops.py; a read from the device per step)."""
    buckets = compile is not None
    generator = None
    if sampling is not None:
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(sampling.seed) if sampling.seed is not None else generator.seed()
    state = DecodeState.start(logits, position, max_new_tokens, eos, buckets, sampling, generator)
    if buckets:
        check_capturable(cache)
    cache.reserve(max_new_tokens - 1, buckets)
    runner = StepRunner(model, cache, state, compile)
    steps = 0
    streamed = _stream(streamer, state, 0, torch.zeros_like(state.finished))
    if stops is not None:
        stops.watch(state.finished, state.produced, 0)
    done = bool(state.finished.all())
    while steps < max_new_tokens - 1 and not done:
        state.draw(generator)
        runner.step()
        steps += 1
        streamed = _stream(streamer, state, steps, streamed)
        if stops is not None:
            stops.watch(state.finished, state.produced, steps)
        done = runner.all_finished()
    if streamer is not None:
        streamer.end()
    produced, finished = state.produced[:, : steps + 1].tolist(), state.finished.tolist()
    tokens = []
    stopped = {} if stops is None else stops.hit
    for index, row in enumerate(produced):
        end = stopped.get(index, next((i for i, t in enumerate(row) if t in eos), len(row) - 1))
        tokens.append(row[: end + 1])
        finished[index] = finished[index] and index not in stopped  # a stopped row's last token is unfed
    return Decoded(
        tokens, finished, steps, runner.compile_s, runner.compile_steps, state.fed_real[:, :steps], state.position
    )
