"""Task generators (seeded, offline, lengths in the model's own tokens) and the registry by name."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from .base import Sample, Turn
from .dataset import load_dataset
from .lines import lines
from .niah import fact, multiturn, niah, niah_multikey, niah_multiquery, niah_multivalue, niah_single, passkey
from .qa import qa_hotpot, qa_squad
from .variables import variable_tracking
from .words import common_words, frequent_words

Generator = Callable[[PreTrainedTokenizerBase, int, float, int], Sample]

TASKS: dict[str, Generator] = {
    "niah": niah,
    "fact": fact,
    "passkey": passkey,
    "lines": lines,
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "vt": variable_tracking,
    "cwe": common_words,
    "fwe": frequent_words,
    "multiturn": multiturn,
    "qa_1": qa_squad,
    "qa_2": qa_hotpot,
}
# Tasks swept over the depth grid (heatmaps); the others draw one depth per sample from the seed.
DEPTH_GRID_TASKS = ("niah", "fact", "passkey", "lines")
# Tasks whose context is a haystack with things hidden in it; they take haystack= one of haystack.HAYSTACKS.
HAYSTACK_TASKS = (
    "niah",
    "fact",
    "passkey",
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "multiturn",
)

__all__ = ["DEPTH_GRID_TASKS", "HAYSTACK_TASKS", "TASKS", "Sample", "Turn", "load_dataset"]
