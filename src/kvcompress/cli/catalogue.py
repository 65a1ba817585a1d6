"""What the command line's parser shows, read without torch: the methods and their fields (typed, ranged, described,
with their defaults), the benchmarks' presets, tasks and haystacks, the embedded models, the servable methods.
Importing the library takes seconds (torch, transformers); the parser and every ``--help`` need none of it, so they
read ``catalogue.json``. ``python -m kvcompress.cli.catalogue`` writes that file from the live library, and a test
holds the two equal (a method's new field cannot be missed by the CLI)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from ..cache.errors import flag_for

FILE = Path(__file__).with_name("catalogue.json")
KINDS = {kind.__name__: kind for kind in (int, float, bool, str)}


class Field(NamedTuple):
    """One method field as a flag shows it (``methods.FieldSpec`` read from the catalogue)."""

    name: str
    kind: type
    choices: list[Any] | None
    help: str
    valid: str

    @property
    def flag(self) -> str:
        return flag_for(self.name)


@functools.cache
def catalogue() -> dict[str, Any]:
    return json.loads(FILE.read_text())


def _method_entry(cls: type) -> dict[str, Any]:
    """A method class's fields and defaults as the catalogue holds them (JSON's types: tuples as lists)."""
    from ..methods import field_specs  # noqa: PLC0415 - the live library, for a class it has loaded already

    fields = [
        {
            "name": spec.name,
            "kind": spec.kind.__name__,
            "choices": list(spec.choices) if spec.choices else None,
            "help": spec.help,
            "valid": spec.valid(),
        }
        for spec in field_specs(cls)
    ]
    return json.loads(json.dumps({"fields": fields, "defaults": cls().settings()}))


def _methods() -> dict[str, dict[str, Any]]:
    """The built-in methods from the file, and any a program registered in this process before calling ``main``
    (``register_method``: the library is loaded then, so they are read live)."""
    methods = dict(catalogue()["methods"])
    library = sys.modules.get("kvcompress.methods")
    if library is not None:
        methods.update({name: _method_entry(cls) for name, cls in library.METHODS.items() if name not in methods})
    return methods


def method_names() -> list[str]:
    return list(_methods())


def method_fields(name: str) -> list[Field]:
    """The fields of method ``name``, the method's own first."""
    return [
        Field(entry["name"], KINDS[entry["kind"]], entry["choices"], entry["help"], entry["valid"])
        for entry in _methods()[name]["fields"]
    ]


def method_defaults(name: str) -> dict[str, Any]:
    return _methods()[name]["defaults"]


def live_catalogue() -> dict[str, Any]:
    """The catalogue as the library has it now (imports torch and transformers: for writing and checking the file)."""
    # (each import below: the live library is what this reads, and only here)
    from ..bench.accuracy import PRESETS as ACCURACY_PRESETS  # noqa: PLC0415
    from ..bench.haystack import HAYSTACKS  # noqa: PLC0415
    from ..bench.headline import PRESETS as HEADLINE_PRESETS  # noqa: PLC0415
    from ..bench.shared_context import DEFAULT_SPECS  # noqa: PLC0415
    from ..bench.speed import PRESETS as SPEED_PRESETS  # noqa: PLC0415
    from ..bench.tasks import TASKS  # noqa: PLC0415
    from ..generation.feed import PREFILL_TOKENS  # noqa: PLC0415
    from ..generation.generate import QUERY_WINDOW  # noqa: PLC0415
    from ..integrations.transformers.models import DEFAULT_MODEL, EMBEDDED  # noqa: PLC0415
    from ..methods import BUILT_IN  # noqa: PLC0415
    from ..serving.settings import SERVABLE  # noqa: PLC0415

    found = {
        "methods": {name: _method_entry(cls) for name, cls in BUILT_IN.items()},
        "servable": list(SERVABLE),
        "query_window": QUERY_WINDOW,
        "prefill_tokens": PREFILL_TOKENS,
        "accuracy_presets": list(ACCURACY_PRESETS),
        "speed_presets": list(SPEED_PRESETS),
        "headline_presets": list(HEADLINE_PRESETS),
        "tasks": list(TASKS),
        "haystacks": list(HAYSTACKS),
        "shared_specs": DEFAULT_SPECS,
        "embedded_models": list(EMBEDDED),
        "default_model": DEFAULT_MODEL,
    }
    return json.loads(json.dumps(found))  # (as the file reads back: tuples as lists)


if __name__ == "__main__":
    FILE.write_text(json.dumps(live_catalogue(), indent=1) + "\n")
    print(f"wrote {FILE}")
