"""FullKV: the uncompressed baseline. Every prompt and generated token stays in the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Method


@dataclass
class FullKV(Method):
    """Keep the whole KV cache (the reference every method is compared against)."""

    name: ClassVar[str] = "full"
