"""Word and number boundaries of a prompt, from the tokenizer's own vocabulary.

Tokenizers split a value into several tokens: Qwen, Mistral, Llama 2 and SmolLM2 give every digit of
a number its own token, and any tokenizer splits rare words. ``TokenSpans`` marks, once per
vocabulary, which tokens start a new span (a leading space or word marker, opening punctuation, a
special token), so a method can treat a number or a word as one unit: ``span_ids`` numbers the spans
of a batch of token ids. Closing punctuation written against what precedes it (``.``, ``,``, ``)``,
``?``...) never starts a span: it stays with its word or number, so ``3.14`` and ``2,500`` are one span
and a kept ``4817.`` keeps its full stop. Without it a value's end is lost: the model copying a kept
``4817`` has nothing telling it the number ends and runs on into the next kept digit ("48172").
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

SPACE_MARKERS = ("Ġ", "▁", "Ċ", "ĉ", " ", "\n", "\t")  # byte-level BPE and SentencePiece word markers
CLOSING = frozenset(".,;:!?)]}%'\"…»”’")  # punctuation that ends the word or number written before it


class TokenSpans:
    """A per-vocabulary table: does a token start a span."""

    def __init__(self, starts: torch.Tensor) -> None:
        self.starts = starts

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> TokenSpans:
        special = set(tokenizer.all_special_ids)
        starts = []
        for index, text in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
            text = text or ""
            core = text.lstrip("".join(SPACE_MARKERS))
            spaced = text[:1] in SPACE_MARKERS
            opening = core[:1] != "" and not core[0].isalnum() and not set(core) <= CLOSING
            starts.append(index in special or spaced or opening)
        return cls(torch.tensor(starts))

    @classmethod
    def every(cls, vocab_size: int, period: int = 4) -> TokenSpans:
        """Synthetic boundaries for random token ids (benchmarks): every ``period``-th id starts a span."""
        return cls(torch.arange(vocab_size) % period == 0)

    def span_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` span number of each token of ``ids [batch, seq]`` (ascending from 0 per row)."""
        starts = self.starts.to(ids.device)
        boundary = starts[ids.clamp(0, starts.numel() - 1)]
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
