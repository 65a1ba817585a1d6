"""kvcompress: KV-cache compression for HuggingFace transformers causal LMs.

    import kvcompress as kvc
    model, tokenizer = kvc.load_model()
    result = kvc.generate(model, tokenizer, prompt, method=kvc.SnapKV(budget=1024))

The public names are imported on first use (PEP 562), so the command line starts by importing this
package alone and can answer Ctrl-C during the heavy imports (torch, transformers) in one line.
"""

from __future__ import annotations

import importlib
from typing import Any

from .io.version import package_version

__version__ = package_version()

_WHERE = {  # public name -> the module that defines it
    **dict.fromkeys(("CacheMisuseError", "UnsupportedModelError"), "cache.errors"),
    "KVCompressCache": "cache.kv_cache",
    "sdpa_choices": "storage.kernel_choice",
    "observe": "bench.observe",
    "Compile": "generation.decode",
    **dict.fromkeys(("Prefill", "PromptTooLongError"), "generation.feed"),
    **dict.fromkeys(
        ("compress", "forced_logprobs", "generate", "prefill", "teacher_forced_logprobs"), "generation.generate"
    ),
    **dict.fromkeys(("Result", "load"), "generation.result"),
    "CacheFileError": "io.saved",
    **dict.fromkeys(
        (
            "H2O",
            "KVzip",
            "METHODS",
            "ExpectedAttention",
            "FullKV",
            "InvalidParameterError",
            "Loki",
            "Method",
            "Quest",
            "ShadowKV",
            "SnapKV",
            "StreamingLLM",
            "method_from_name",
            "method_from_spec",
            "register_method",
        ),
        "methods",
    ),
    **dict.fromkeys(("ModelNotAvailableError", "load_model"), "integrations.transformers.models"),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
