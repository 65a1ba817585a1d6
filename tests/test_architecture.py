"""The shape of the house: imports flow one way, and a method is one file plus a registry line."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import kvcompress as kvc
from kvcompress.cache.held import hold
from kvcompress.cache.layer import KVLayer
from kvcompress.cache.policy import present
from kvcompress.cli import build_parser, main
from kvcompress.methods import METHODS, field_specs
from kvcompress.methods.fields import param
from kvcompress.methods.prompt import PromptMethod
from kvcompress.methods.sparse import SparseDecodePolicy, SparseMethod
from kvcompress.storage.attention import grouped_logits

from .fixtures import char_tokenizer, random_text, tiny_model

PACKAGE = Path(kvc.__file__).parent


def module_imports() -> dict[str, set[str]]:
    """Every kvcompress module and the kvcompress modules it imports (anywhere in the file,
    type-checking and function-local imports included)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = found
    return {name: {t for t in targets if t in graph and t != name} for name, targets in graph.items()}


def test_the_module_graph_has_no_cycle():
    graph = module_imports()
    packages = {name for name in graph if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}
    # a package's face only hands names on
    edges = {name: {t for t in targets if t not in packages} for name, targets in graph.items()}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges[node]):
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [node, target])}"
            if target not in state:
                visit(target, path + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


# The layers, bottom up: a module may import its own layer and those below it, never one above. The front (the
# package's face, the command line, the demo) is everything else. Each layer's __init__ says what it owns.
LAYERS = [
    "kvcompress.storage",
    "kvcompress.cache",
    "kvcompress.io",
    "kvcompress.integrations.transformers",
    "kvcompress.methods",
    "kvcompress.generation",
    "kvcompress.serving",
    "kvcompress.bench",
]


def layer_of(module: str) -> int:
    """The index of ``module``'s layer in LAYERS (the front: len(LAYERS))."""
    found = [index for index, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")]
    return found[-1] if found else len(LAYERS)


def test_no_layer_imports_one_above_it():
    upward = [
        f"{source} ({LAYERS[layer_of(source)] if layer_of(source) < len(LAYERS) else 'the front'}) imports {target}"
        for source, targets in module_imports().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(source)
    ]
    assert not upward, "\n".join(upward)


def test_the_layer_check_catches_an_upward_import():
    assert layer_of("kvcompress.cache.kv_cache") < layer_of("kvcompress.methods.snapkv") < layer_of("kvcompress.cli")
    assert layer_of("kvcompress.integrations.transformers.rope") < layer_of("kvcompress.methods")
    assert layer_of("kvcompress.serving.vllm_plugin") > layer_of("kvcompress.generation.generate")


def test_every_module_lives_in_a_layer_whose_init_says_what_it_owns_and_may_import():
    front = {"kvcompress", "kvcompress.__main__", "kvcompress.cli", "kvcompress.chat", "kvcompress.demo"}
    front |= {f"kvcompress.cli.{path.stem}" for path in (PACKAGE / "cli").glob("*.py") if path.stem != "__init__"}
    front.add("kvcompress.integrations")  # the folder of the model library's integration, its __init__ a docstring
    assert {name for name in module_imports() if layer_of(name) == len(LAYERS)} == front
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE.parent / layer.replace(".", "/") / "__init__.py").read_text()))
        assert doc and "may import" in doc.lower(), f"{layer}/__init__.py does not say what it may import"


def test_every_method_field_is_a_flag_with_one_type():
    options = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    for name, cls in METHODS.items():
        for spec in field_specs(cls):
            assert spec.name in options, f"{name}.{spec.name} has no flag"
            assert spec.help, f"{name}.{spec.name} has no help text"
    kinds = {}
    for cls in METHODS.values():
        for spec in field_specs(cls):
            assert kinds.setdefault(spec.name, spec.kind) is spec.kind, f"field {spec.name} has two types"


@dataclass
class EveryOther(PromptMethod):
    """A toy prompt-compression method written the way a newcomer would, one method of ``scores`` (its
    ``kept_tokens`` is PromptMethod's: the budget): keep the last ``budget`` tokens whose position is a
    multiple of ``stride`` (plus, when too few, the most recent)."""

    name: ClassVar[str] = "every-other"
    stride: int = param(2, "keep positions that are multiples of this", minimum=1)

    def scores(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        spans: torch.Tensor | None = None,
    ) -> torch.Tensor:
        position = valid.long().cumsum(-1).float()
        return (position + 1e6 * (position % self.stride == 0))[:, None, :].expand(-1, keys.shape[1], -1)


@pytest.fixture
def toy_method():
    kvc.register_method(EveryOther)
    yield EveryOther
    METHODS.pop(EveryOther.name)


@pytest.fixture
def saved_tiny_model(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    tiny_model(max_position_embeddings=2048).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_a_new_method_is_one_class_and_a_registry_line(toy_method, saved_tiny_model, tmp_path, capsys):
    model, tok = tiny_model(), char_tokenizer()
    result = kvc.generate(model, tok, "x" * 100, method=EveryOther(budget=20, stride=3), max_new_tokens=2)
    kept = result.cache.kept_positions(0)[0, 0].tolist()
    assert len(kept) == 20 and all(p % 3 == 2 for p in kept)  # cumsum positions start at 1

    assert (
        main(
            [
                "generate",
                "--model",
                str(saved_tiny_model),
                "--method",
                "every-other",
                "--budget",
                "24",
                "--stride",
                "4",
                "--raw",
                "--prompt",
                "y" * 80,
                "--max-new-tokens",
                "3",
                "--json",
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["method"] == "every-other(budget=24, stride=4)"
    assert record["kv_tokens_per_layer"] == [24 + 2, 24 + 2]

    out = tmp_path / "acc"
    assert (
        main(
            [
                "bench",
                "accuracy",
                "--model",
                str(saved_tiny_model),
                "--tasks",
                "niah",
                "--methods",
                "full,every-other:stride=2",
                "--budgets",
                "64",
                "--lengths",
                "300",
                "--depths",
                "0.5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    labels = {json.loads(line)["label"] for line in (out / "results.jsonl").read_text().splitlines()}
    assert labels == {"full", "every-other:stride=2@64"}
    assert (
        main(
            [
                "bench",
                "speed",
                "--model",
                str(saved_tiny_model),
                "--methods",
                "every-other:stride=2",
                "--budget",
                "32",
                "--lengths",
                "200",
                "--batches",
                "1",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--out",
                str(tmp_path / "speed"),
            ]
        )
        == 0
    )
    assert "every-other" in (tmp_path / "speed" / "speed.json").read_text()
    assert (
        main(
            ["generate", "--model", str(saved_tiny_model), "--method", "every-other", "--window", "4", "--prompt", "z"]
        )
        == 2
    )
    assert (
        "method 'every-other' does not take --window; it takes: --budget, --ratio, --heads, --head-floor, "
        "--layers, --layer-floor, --pyramid-beta, --decode-budget, --every, --decode-window, --kv-bytes, --stride, "
        "--kv-bits, --kv-format"
    ) in capsys.readouterr().err


@dataclass
class MeanKeys(SparseMethod):
    """A toy decoding-time method written the way a newcomer would: nothing is dropped; the prompt is cut into chunks
    of ``chunk`` tokens, and every decoding step attends the ``budget`` tokens of the chunks whose mean key its query
    scores highest (docs/architecture.md, "Adding a decoding-time method")."""

    name: ClassVar[str] = "mean-keys"
    unit_setting: ClassVar[tuple[str, str]] = ("chunk", "chunk")  # (the budget holds at least one)
    chunk: int = param(8, "tokens per chunk", minimum=1)

    def make_layer(self, layer_idx: int, model) -> KVLayer:
        return KVLayer(layer_idx, MeanKeysPolicy(self, unit=self.chunk, offload=False))


class MeanKeysPolicy(SparseDecodePolicy):
    SAVED_AS = "MeanKeysLayer"
    means: torch.Tensor | None = hold(rows=True, index=True)  # [b, h, chunks, d]: each chunk's mean key

    def region_chunks(self, lengths: torch.Tensor) -> torch.Tensor:
        return torch.div(lengths, self.unit, rounding_mode="floor")  # whole chunks; the rest stays dense

    def prepare(self, keys: torch.Tensor, valid: torch.Tensor, chunks: torch.Tensor) -> None:
        batch, heads, tokens, dim = keys.shape
        self.means = keys.view(batch, heads, tokens // self.unit, self.unit, dim).mean(dim=3)

    def chunk_scores(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        (means,) = present(self.means)
        logits = grouped_logits(query, means, scaling)  # [b, q_heads, q, chunks]
        return logits.view(means.shape[0], means.shape[1], -1, means.shape[2]).amax(dim=2)


@pytest.fixture
def toy_decoding_method():
    kvc.register_method(MeanKeys)
    yield MeanKeys
    METHODS.pop(MeanKeys.name)


def test_a_decoding_time_method_is_two_small_classes_and_a_registry_line(
    toy_decoding_method, saved_tiny_model, tmp_path, capsys
):
    """The decoding-time toy runs everywhere the scorer toy does: the library (a budget over the whole prompt attends
    every chunk: the full cache's answer, exactly; a small one selects its budget each step), the command line, bench
    accuracy and bench speed."""
    model, tok = tiny_model(), char_tokenizer()
    prompt = random_text(300)
    full = kvc.generate(model, tok, prompt, method=kvc.FullKV(), max_new_tokens=6)
    whole = kvc.generate(model, tok, prompt, method=MeanKeys(budget=512, chunk=8), max_new_tokens=6)
    assert whole.token_ids == full.token_ids
    sparse = kvc.generate(model, tok, prompt, method=MeanKeys(budget=32, chunk=8), max_new_tokens=6)
    assert sparse.stats["selected_tokens_per_step"] == 32 and sparse.stats["kv_kept_fraction"] == 1.0  # none dropped

    argv = ["--model", str(saved_tiny_model), "--method", "mean-keys", "--budget", "24", "--chunk", "8"]
    assert main(["generate", *argv, "--raw", "--prompt", "y" * 80, "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "mean-keys(budget=24, chunk=8)"
    accuracy = [
        "--tasks",
        "niah",
        "--budgets",
        "64",
        "--lengths",
        "300",
        "--depths",
        "0.5",
        "--out",
        str(tmp_path / "a"),
    ]
    assert (
        main(["bench", "accuracy", "--model", str(saved_tiny_model), "--methods", "mean-keys:chunk=4", *accuracy]) == 0
    )
    labels = {json.loads(line)["label"] for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()}
    assert labels == {"mean-keys:chunk=4@64"}
    speed = ["--lengths", "200", "--batches", "1", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "s")]
    assert (
        main(["bench", "speed", "--model", str(saved_tiny_model), "--methods", "mean-keys", "--budget", "32", *speed])
        == 0
    )
    assert "mean-keys" in (tmp_path / "s" / "speed.json").read_text()


def test_every_layer_attribute_is_born_in_its_init():
    """A layer's state is what its ``__init__`` declares: nothing appears later (a saved file's
    entries, docs/file-format.md, are named from it), for every method, a batch, after decoding."""
    from .test_batches import METHODS

    model, tok = tiny_model(), char_tokenizer()
    for method in METHODS:
        declared = {type(layer): set(vars(layer)) for layer in method.make_cache(model, tok).layers}
        result = kvc.generate(
            model, tok, ["one short prompt", "and a longer one, " * 20], method=method, max_new_tokens=3
        )
        for layer in result.cache.layers:
            assert set(vars(layer)) == declared[type(layer)], (
                f"{method.label()}: {type(layer).__name__} gained {set(vars(layer)) - declared[type(layer)]}"
            )


def test_every_public_name_resolves_from_the_package():
    """``import kvcompress as kvc`` hands out every name it lists, wherever the layers put them."""
    for name in kvc.__all__:
        assert getattr(kvc, name) is not None, name
    assert issubclass(kvc.CacheMisuseError, ValueError) and issubclass(kvc.UnsupportedModelError, ValueError)
    from kvcompress import serving  # docs/vllm.md's offline API, without vLLM

    assert "enable_prefix_caching" not in serving.engine_options(kvc.SnapKV(budget=256))  # vLLM's default: on
    assert {"method_of", "scorable", "check_servable", "SERVABLE"} <= set(vars(serving))


MAX_CLASS_LINES, MAX_CLASS_METHODS, MAX_FUNCTION_LINES = 250, 30, 60


def package_classes() -> dict[str, tuple[ast.ClassDef, str]]:
    """Every class of the package by name, with the file it is in."""
    classes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (node, str(path.relative_to(PACKAGE.parent)))
    return classes


def mixed_in(node: ast.ClassDef, classes: dict[str, tuple[ast.ClassDef, str]]) -> list[ast.ClassDef]:
    """The class and, where it has more than one base of the package's own, those bases (its mixins) and theirs:
    a class split into mixins is read as one."""
    own = [classes[base.id][0] for base in node.bases if isinstance(base, ast.Name) and base.id in classes]
    if len(own) < 2:
        return [node]
    return [node, *(part for base in own for part in mixed_in(base, classes))]


def members(node: ast.ClassDef, module: ast.Module) -> int:
    """A class's methods counted honestly: its functions, its members made with ``property(...)``, and the functions
    of its module that take it first (``def f(layer: KVLayer, ...)``: a method in all but name)."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    own = sum(isinstance(item, functions) for item in node.body)
    properties = sum(
        isinstance(item, (ast.Assign, ast.AnnAssign))
        and isinstance(item.value, ast.Call)
        and ast.unparse(item.value.func) == "property"
        for item in node.body
    )
    taking = sum(
        isinstance(item, functions)
        and bool(item.args.args)
        and item.args.args[0].annotation is not None
        and ast.unparse(item.args.args[0].annotation).strip("'\"") == node.name
        for item in module.body
    )
    return own + properties + taking


def test_no_class_or_function_outgrows_a_reading():
    """A class a newcomer can read in one sitting (at most 250 lines, 30 methods, counted with what it inherits from
    its own mixins, its properties and its module's functions that take it), a function on one screen (60 lines)."""
    too_big = []
    classes = package_classes()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ast.parse(path.read_text())
        for node in ast.walk(module):
            size = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef):
                parts = mixed_in(node, classes)
                size = sum(part.end_lineno - part.lineno + 1 for part in parts)
                modules = {part.name: ast.parse((PACKAGE.parent / classes[part.name][1]).read_text()) for part in parts}
                methods = sum(members(part, modules[part.name]) for part in parts)
                if size > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS:
                    too_big.append(f"class {where}: {size} lines, {methods} methods")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION_LINES:
                too_big.append(f"function {where}: {size} lines")
    assert not too_big, "\n".join(too_big)


def drawn_modules() -> set[str]:
    """The files docs/architecture.md's tree names under src/kvcompress/ (a folder named alone: all of it)."""
    text = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    tree = next(block for block in text.split("```")[1::2] if block.lstrip("\n").startswith("src/kvcompress/"))
    drawn, folders = set(), []
    for line in tree.splitlines()[1:]:
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0] if line.strip() else ""
        if indent < 2 or indent > 8 or not name.endswith((".py", "/")):
            continue  # a description's continuation, or the tests and scripts below the package
        depth = indent // 2 - 1
        folders[depth:] = [name] if name.endswith("/") else []
        drawn.add("".join(folders[:depth]) + name)
    return drawn


def test_the_architecture_drawing_names_every_module_of_the_tree_and_no_other():
    drawn = drawn_modules()
    files = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    folders = {name for name in drawn if name.endswith("/")}
    missing = {
        f
        for f in files
        if f not in drawn
        and not f.endswith("__init__.py")
        and not any(
            f.startswith(folder) and not any(other.startswith(folder) and other != folder for other in drawn)
            for folder in folders
        )
    }
    assert not missing, f"docs/architecture.md's tree does not name {sorted(missing)}"
    gone = {name for name in drawn if not (PACKAGE / name).exists()}
    assert not gone, f"docs/architecture.md's tree names {sorted(gone)}, which src/kvcompress/ does not hold"
