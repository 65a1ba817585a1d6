"""The prompts a vLLM worker finishes in one step, scored and selected: each scored alone by its method's own
``layer_scores`` over views of its keys, the scores of those that share a method right-aligned as the library's
batches are (each prompt's padding before it, marked invalid) and chosen by the library's ``select_kept`` in one
call per layer. Imports no vLLM: the worker (``vllm_worker``) hands it tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from ..integrations.transformers.rope import Rotary
from ..methods.base import Method
from ..methods.prompt import PromptMethod
from ..methods.selection import select_kept
from ..storage.attention import scoring_sinks
from .settings import PromptLayer


@dataclasses.dataclass
class PromptValues:
    """A prompt's values as a worker holds them at the end of its prefill: the first ``cached`` tokens' still in vLLM's
    paged cache (``read``: those at positions ``[kv_heads, n]``, each head its own, as ``[kv_heads, n, dim]``), the
    rest computed by this prefill (``computed [tokens - cached, kv_heads, dim]``). Its kept tokens' are read, not the
    whole prompt's, unless a method's scores read values (at 7,500 tokens every value read cost a question ~30 ms)."""

    cached: int
    computed: torch.Tensor
    read: Callable[[torch.Tensor], torch.Tensor] | None = None  # (None: nothing cached)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The values at ``positions [kv_heads, n]``, ``[kv_heads, n, dim]``."""
        return parts_at(self.cached, self.computed, self.read, positions)

    def whole(self) -> torch.Tensor:
        """Every token's values, ``[kv_heads, tokens, dim]`` (none cached: a view of those computed)."""
        if self.cached == 0:
            return self.computed.transpose(0, 1)
        kv_heads, tokens = self.computed.shape[1], self.cached + self.computed.shape[0]
        return self.at(torch.arange(tokens).expand(kv_heads, tokens))


@dataclasses.dataclass
class PromptKeys:
    """A prompt's keys as a worker holds them at the end of its prefill: the first ``cached`` tokens' read back from
    vLLM's paged cache (``prefix [kv_heads, dim, cached]``, transposed as a scorer's product reads them; None: nothing
    cached), the rest computed by this prefill (``computed [tokens - cached, kv_heads, dim]``). ``room``: given the
    prompt's length, a buffer whose first ``cached`` tokens are the prefix (a held prefix's, ``prompt_keys``), where
    ``joined`` lays the prompt out without a copy; None, or a room that returns None: a new tensor. A joined view is
    valid until the next prompt over the same prefix is joined (the prompts of a step are scored one after another),
    so kept keys are read from the parts (``at``). ``read``: where no prefix is held (a request that scores nothing),
    the cached part's keys at positions, as ``PromptValues.read``."""

    cached: int
    computed: torch.Tensor
    prefix: torch.Tensor | None = None
    room: Callable[[int], torch.Tensor | None] | None = None
    read: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def tokens(self) -> int:
        return self.cached + self.computed.shape[0]

    def joined(self) -> torch.Tensor:
        """The whole prompt's keys ``[kv_heads, tokens, dim]`` (none cached: a view of those computed)."""
        if self.prefix is None:
            return self.computed.transpose(0, 1)
        laid = None if self.room is None else self.room(self.tokens)
        if laid is None:
            laid = torch.empty(*self.prefix.shape[:2], self.tokens, dtype=self.prefix.dtype)
            laid[..., : self.cached] = self.prefix
        laid[..., self.cached :] = self.computed.permute(1, 2, 0)
        return laid.transpose(1, 2)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The keys at ``positions [kv_heads, n]``, ``[kv_heads, n, dim]``."""
        prefix, read = self.prefix, self.read
        if prefix is not None:
            read = lambda at: prefix[torch.arange(at.shape[0])[:, None], :, at]  # noqa: E731
        return parts_at(self.cached, self.computed, read, positions)


def parts_at(
    cached: int, computed: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor] | None, positions: torch.Tensor
) -> torch.Tensor:
    """A prompt's keys or values at ``positions [kv_heads, n]`` (each head its own), ``[kv_heads, n, dim]``: before
    ``cached`` through ``read`` (those at positions ``[kv_heads, n]``), after it from ``computed [tokens - cached,
    kv_heads, dim]``."""
    heads = torch.arange(positions.shape[0])[:, None]
    own = computed.transpose(0, 1)[heads, (positions - cached).clamp(min=0)]
    if cached == 0:
        return own
    if read is None:  # (a reader is given wherever tokens are cached)
        raise RuntimeError("kvcompress: a prompt's cached part was read with no reader for it")
    return torch.where((positions < cached)[..., None], read(positions.clamp(max=cached - 1)), own)


@dataclasses.dataclass
class Finishing:
    """One request's whole prompt in one layer at the end of its prefill: its keys and values, the last queries its
    method reads ``[m, q_heads, dim]``, its word spans ``[1, tokens]`` (None: its method reads none), its tokens from
    where it says its question begins (None: it says nothing), and the tokens each KV head keeps."""

    keys: PromptKeys
    values: PromptValues
    queries: torch.Tensor
    spans: torch.Tensor | None
    asked: int | None
    kept: int


def prompt_scores(method: Method, prompt: Finishing, scaling: float, rotary: Rotary | None) -> torch.Tensor:
    """One prompt's scores ``[kv_heads, tokens]`` by its method's own ``layer_scores``, over its keys laid out once
    (in a held prefix's room: no copy) and its values read on use."""
    asked = None if prompt.asked is None else torch.tensor([prompt.asked])
    layer = PromptLayer(prompt.keys.joined()[None], lambda: prompt.values.whole()[None], prompt.spans, rotary, asked)
    scorer = cast(PromptMethod, method)  # (a compressing method is a prompt method: serving refuses the others)
    return scorer.layer_scores(layer, prompt.queries.transpose(0, 1)[None], scaling)[0]


def kept_together(
    method: Method, prompts: list[Finishing], scaling: float, rotary: Rotary | None, sinks: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Each prompt's kept positions ``[kv_heads, kept]`` (ascending within each head): ``prompts`` (one method's)
    each scored alone, one after another, and their scores chosen together, right-aligned as a library batch is.
    (Scored as one batch, each prompt's keys were copied into it, and prompts that share a document copied it once
    each: at 7,500 tokens that copy cost each question of a burst of eight 99 ms, more than its votes.) ``sinks``: the
    layer's learned sinks, which take their share of the scorer's softmax as in the library."""
    width = max(prompt.keys.tokens for prompt in prompts)
    pads = torch.tensor([width - prompt.keys.tokens for prompt in prompts])
    valid = torch.arange(width)[None, :] >= pads[:, None]
    with scoring_sinks(sinks):
        scores = [prompt_scores(method, prompt, scaling, rotary) for prompt in prompts]
    aligned = torch.stack([F.pad(score, (int(pad), 0)) for score, pad in zip(scores, pads)])  # [b, kv_heads, width]
    kept, _ = select_kept(aligned, valid, torch.tensor([prompt.kept for prompt in prompts]))  # [b, kv_heads, n]
    return [kept[row, :, kept.shape[-1] - prompt.kept :] - pads[row] for row, prompt in enumerate(prompts)]
