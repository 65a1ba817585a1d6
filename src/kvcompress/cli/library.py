"""The library's names the command line calls, each imported on first use (PEP 562, as the package's own public
names are): torch and transformers take seconds to import, and no parser or ``--help`` needs them (they read
``catalogue.py``). A command's handler reaches the library as ``lib.generate(...)``; ``preload`` imports the bulk
after parsing, where an interrupt is answered in one line."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE: dict[str, tuple[str, str | None]] = {  # name -> (its module under kvcompress, its name there; None: the module)
    "report": ("bench.report", None),
    "observe": ("bench.observe", None),
    "demo": ("demo", None),
    **{
        name: ("methods", name)
        for name in (
            "METHODS",
            "FullKV",
            "InvalidParameterError",
            "method_class",
            "method_from_name",
            "method_from_spec",
            "field_specs",
        )
    },
    **{name: ("generation.generate", name) for name in ("compress", "generate")},
    **{name: ("generation.result", name) for name in ("load", "saved_method")},
    "user_prompt": ("generation.conversation", "user_prompt"),
    "Stops": ("generation.stops", "Stops"),
    "check_per_question": ("generation.ways_in", "check_per_question"),
    "PromptTooLongError": ("generation.feed", "PromptTooLongError"),
    **{
        name: ("integrations.transformers.models", name)
        for name in ("ARCHITECTURES", "EMBEDDED", "fetch_model", "load_model", "model_path", "random_model")
    },
    **{name: ("cache.errors", name) for name in ("CacheMisuseError", "UnsupportedModelError", "Said")},
    "CacheFileError": ("io.saved", "CacheFileError"),
    "NotFetchedError": ("io.wheels", "NotFetchedError"),
    "ACCURACY_PRESETS": ("bench.accuracy", "PRESETS"),
    "run_accuracy": ("bench.accuracy", "run_accuracy"),
    "SPEED_PRESETS": ("bench.speed", "PRESETS"),
    "run_speed": ("bench.speed", "run_speed"),
    "SpeedGrid": ("bench.speed", "SpeedGrid"),
    "HEADLINE_PRESETS": ("bench.headline", "PRESETS"),
    "run_headline": ("bench.headline", "run_headline"),
    "run_shared_context": ("bench.shared_context", "run_shared_context"),
    "load_dataset": ("bench.tasks", "load_dataset"),
    "fetch_ruler_data": ("bench.ruler", "fetch_ruler_data"),
    "serving": ("serving.settings", None),
    "launch": ("serving.launch", None),
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _WHERE[name]
    loaded = importlib.import_module(f"kvcompress.{module}")
    value = loaded if attribute is None else getattr(loaded, attribute)
    globals()[name] = value
    return value


def preload() -> None:
    """Import what every command runs on (torch, transformers, the methods, generation and the report)."""
    for name in ("METHODS", "generate", "load_model", "report"):
        __getattr__(name)


def user_errors() -> tuple[type[Exception], ...]:
    """The errors a user's input causes, shown in one line in the flags' words (others are the library's bugs)."""
    return (
        __getattr__("InvalidParameterError"),
        __getattr__("PromptTooLongError"),
        __getattr__("UnsupportedModelError"),
        __getattr__("CacheMisuseError"),
        __getattr__("CacheFileError"),
        __getattr__("NotFetchedError"),
        OSError,
        ValueError,
    )
