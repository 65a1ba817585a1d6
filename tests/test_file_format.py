"""The saved-file format is a contract (docs/file-format.md): every fixture in tests/data, written
by this or an earlier version of the format, loads with the tokens it answered with when it was
written, or is refused by its version; and a file's entries are exactly the documented ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

import kvcompress as kvc
from kvcompress.generation.result import READS, VERSION, UncheckedFileWarning

from .data.make_format_fixtures import CASES, fixture_model, write_case
from .fixtures import char_tokenizer

DATA = Path(__file__).parent / "data"
DOC = Path(__file__).parents[1] / "docs" / "file-format.md"
FIXTURES = [
    (path.name.split("-")[0], name, case)
    for path in sorted(DATA.glob("v*-answers.json"))
    for name, case in json.loads(path.read_text()).items()
]


@pytest.mark.parametrize(("version", "name", "case"), FIXTURES, ids=[f"{v}-{n}" for v, n, _ in FIXTURES])
def test_every_fixture_loads_with_its_recorded_answer_or_is_refused_by_version(version, name, case):
    path, tok = DATA / f"{version}-{name}.kvc", char_tokenizer()
    model = fixture_model(case["family"])
    if int(version[1:]) not in READS:
        with pytest.raises(
            kvc.CacheFileError,
            match=rf"is in kvcompress cache format version {version[1:]} .* reads versions 2, 3 and 4",
        ):
            kvc.load(path, model, tok)
        return
    if int(version[1:]) < 3:  # no checksum: loaded unchecked, and said
        with pytest.warns(UncheckedFileWarning, match=rf"{path.name} carries no checksum \(format version 2\)"):
            loaded = kvc.load(path, model, tok)
    else:
        loaded = kvc.load(path, model, tok)
    written = kvc.method_from_spec(case["method"])  # with the settings a field added since meant when it was written
    assert loaded.cache.method == kvc.method_from_spec(case["method"], **type(written).unrecorded_meant)
    assert kvc.generate(model, tok, case["question"], past=loaded, max_new_tokens=8).token_ids[0] == case["tokens"]


def test_this_version_has_a_fixture_of_every_storage_kind():
    written = {name for version, name, _ in FIXTURES if version == f"v{VERSION}"}
    assert written == set(CASES)
    classes = {layer["class"] for name in written for layer in header(DATA / f"v{VERSION}-{name}.kvc")["layers"]}
    assert classes >= {
        "WindowLayer",
        "EvictionLayer",
        "H2OLayer",
        "HeadAdaptiveLayer",
        "ShadowKVLayer",
        "QuestLayer",
        "LokiLayer",
        "BoundedLayer",
    }


def header(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as file:
        return {**json.loads(file.metadata()["kvcompress-cache"]), "tensors": list(file.keys())}


def documented_entries() -> dict[str, set[str]]:
    """The layer entries docs/file-format.md lists, per class that adds them."""
    entries: dict[str, set[str]] = {}
    for owner, entry in re.findall(r"^\| `(\w+Layer)` \| `([\w.<>]+)` \|", DOC.read_text(), flags=re.M):
        entries.setdefault(owner, set()).add(entry)
    return entries


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_files_layer_entries_are_the_documented_ones(name, tmp_path):
    """Each layer's plain values and tensors in a file this code writes, against the entries documented
    for its kind and every kind above it (a holder's absent object is its prefix as a null value)."""
    write_case(name, tmp_path / "case.kvc")
    saved = header(tmp_path / "case.kvc")
    documented = documented_entries()
    model = fixture_model(CASES[name][0])
    kinds = {  # each kind of layer the file names, and every kind above it (the layer's classes, its policy's names)
        made.kind: {cls.__name__ for cls in type(made).__mro__}
        | {vars(cls)["SAVED_AS"] for cls in type(made.policy).__mro__ if vars(cls).get("SAVED_AS")}
        for made in kvc.method_from_spec(CASES[name][1]).make_cache(model, char_tokenizer()).layers
    }
    for index, layer in enumerate(saved["layers"]):
        prefix = f"layers.{index}."
        names = set(layer["values"]) | {key[len(prefix) :] for key in saved["tensors"] if key.startswith(prefix)}
        names = {re.sub(r"^packed\.positions\.\d+\.\d+$", "packed.positions.<r>.<h>", n) for n in names}
        allowed = set().union(*(documented.get(kind, set()) for kind in kinds[layer["class"]]))
        assert names <= allowed, f"layer {index} ({layer['class']}) holds undocumented {sorted(names - allowed)}"
        held_objects = {n.split(".")[0] for n in allowed if "." in n}
        required = {n for n in allowed if "." not in n and n not in held_objects}
        assert required <= names, f"layer {index} ({layer['class']}) lacks documented {sorted(required - names)}"
