"""Word and number boundaries of a prompt, from the tokenizer's own vocabulary.

Tokenizers split a value into several tokens: Qwen, Mistral, Llama 2 and SmolLM2 give every digit of
a number its own token, and any tokenizer splits rare words. ``TokenSpans`` marks, once per
vocabulary, which tokens start a new span (a leading space or word marker, punctuation, a special
token), so a method can treat a number or a word as one unit: ``span_ids`` numbers the spans of a
batch of token ids. A ``.`` or ``,`` between digits (``3.14``, ``2,500``) stays inside the number.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

SPACE_MARKERS = ("Ġ", "▁", "Ċ", "ĉ", " ", "\n", "\t")  # byte-level BPE and SentencePiece word markers
NUMBER_JOINERS = (".", ",")


class TokenSpans:
    """Per-vocabulary tables: does a token start a span, is it all digits, can it join two digits."""

    def __init__(self, starts: torch.Tensor, digits: torch.Tensor, joiners: torch.Tensor) -> None:
        self.starts, self.digits, self.joiners = starts, digits, joiners

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> TokenSpans:
        special = set(tokenizer.all_special_ids)
        starts, digits, joiners = [], [], []
        for index, text in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
            text = text or ""
            core = text.lstrip("".join(SPACE_MARKERS))
            spaced = text[:1] in SPACE_MARKERS
            starts.append(index in special or spaced or
                          (core[:1] != "" and not core[0].isalnum() and core not in NUMBER_JOINERS))
            digits.append(core != "" and core.isdigit())
            joiners.append(core in NUMBER_JOINERS and not spaced)
        return cls(torch.tensor(starts), torch.tensor(digits), torch.tensor(joiners))

    @classmethod
    def every(cls, vocab_size: int, period: int = 4) -> TokenSpans:
        """Synthetic boundaries for random token ids (benchmarks): every ``period``-th id starts a span."""
        starts = torch.arange(vocab_size) % period == 0
        return cls(starts, torch.zeros_like(starts), torch.zeros_like(starts))

    def span_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` span number of each token of ``ids [batch, seq]`` (ascending from 0 per row)."""
        table = self.starts.to(ids.device), self.digits.to(ids.device), self.joiners.to(ids.device)
        ids = ids.clamp(0, table[0].numel() - 1)
        starts, digits, joiners = (t[ids] for t in table)
        before = torch.nn.functional.pad(digits[:, :-1], (1, 0), value=False)
        after = torch.nn.functional.pad(digits[:, 1:], (0, 1), value=False)
        boundary = starts | (joiners & ~(before & after))
        boundary[:, 0] = True
        return boundary.long().cumsum(-1) - 1


def spans_for(tokenizer: PreTrainedTokenizerBase | TokenSpans) -> TokenSpans:
    """The tokenizer's ``TokenSpans``, built once and kept on the tokenizer (a ``TokenSpans`` is returned as it is)."""
    if isinstance(tokenizer, TokenSpans):
        return tokenizer
    spans = getattr(tokenizer, "_kvcompress_spans", None)
    if spans is None:
        spans = TokenSpans.from_tokenizer(tokenizer)
        tokenizer._kvcompress_spans = spans
    return spans


def span_max(scores: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Each position's score replaced by the highest score of its span: ``scores [b, h, s]``,
    ``spans [b, s]``, or ``[b, h, s]`` where each head holds other tokens (span numbers from 0). A span
    is then kept or dropped as a whole."""
    batch, heads, seq = scores.shape
    index = spans[:, None, :].expand(batch, heads, seq) if spans.dim() == 2 else spans
    peak = torch.full((batch, heads, int(spans.max()) + 1), -torch.inf, dtype=scores.dtype, device=scores.device)
    return peak.scatter_reduce(2, index, scores, reduce="amax").gather(2, index)
