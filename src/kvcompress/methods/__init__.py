"""The KV-cache methods, one module each, and lookup by name (for the CLI and benchmarks)."""

from __future__ import annotations

from typing import Any

from .base import InvalidParameterError, Method
from .full import FullKV
from .h2o import H2O
from .loki import Loki
from .quest import Quest
from .shadowkv import ShadowKV
from .snapkv import SnapKV
from .streaming import StreamingLLM

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (FullKV, SnapKV, StreamingLLM, ShadowKV, H2O, Quest, Loki)}


def method_from_name(name: str, **params: Any) -> Method:
    """Build a method from its name; ``params`` set to None are left at their defaults."""
    if name not in METHODS:
        raise InvalidParameterError(f"method={name!r} is unknown; valid: {', '.join(METHODS)}")
    cls = METHODS[name]
    accepted = set(cls.__dataclass_fields__)
    unknown = sorted(k for k, v in params.items() if v is not None and k not in accepted)
    if unknown:
        raise InvalidParameterError(f"method {name!r} does not take {', '.join(unknown)}; it takes: {', '.join(sorted(accepted)) or 'no parameters'}")
    return cls(**{k: v for k, v in params.items() if v is not None})
