"""Write the saved-file fixtures ``tests/test_file_format.py`` loads: one small ``.kvc`` file per
storage kind, from tiny models with fixed weights, and the tokens each answers its question with.

Run it only when docs/file-format.md changes (and ``result.VERSION`` with it): the files of every
earlier version stay, and the test loads them all, each with its recorded tokens, or checks that
this version refuses it by version. ``PYTHONPATH=src:. python tests/data/make_format_fixtures.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import kvcompress as kvc
from kvcompress.generation.result import VERSION
from tests.fixtures import char_tokenizer, family_model, fixed_weights, random_text

HERE = Path(__file__).parent
QUESTION = "which word?"
# name: (model family, method spec, tokens generated before saving: 0 saves the compressed context alone)
CASES = {
    "dense": ("llama", "snapkv:budget=24:window=8", 0),
    "dense-continued": ("llama", "snapkv:budget=24:window=8", 5),
    "ring": ("mistral-sliding", "full", 4),
    "packed": ("llama", "snapkv:budget=24:window=8:heads=adaptive", 0),
    "packed-global": ("llama", "kvzip:budget=24:chunk=40", 0),
    "scores": ("llama", "h2o:budget=24:evict_during_decoding=true", 3),
    "chunks": ("llama", "shadowkv:budget=16:chunk=4:rank=4:local_chunks=1:outliers=1", 0),
    "chunks-offloaded": ("llama", "quest:budget=16:page_size=4:offload=true", 0),
    "projected": ("llama", "loki:budget=16", 0),
    "dense-int4": ("llama", "snapkv:budget=24:window=8:kv_bits=4:key_bits=4", 3),
    "ring-int8": ("mistral-sliding", "full:kv_bits=8", 4),
    "packed-fp8": ("llama", "snapkv:budget=24:window=8:heads=adaptive:kv_bits=8:kv_format=fp8", 0),
    "chunks-int4": ("llama", "quest:budget=16:page_size=4:offload=true:kv_bits=4", 0),
    "bounded": ("llama", "snapkv:budget=24:window=8:decode_budget=16:every=4:decode_window=8", 12),
}


def fixture_model(family: str):
    return fixed_weights(family_model(family))


def write_case(name: str, path: Path) -> list[int]:
    """Save case ``name`` to ``path``; return the tokens the saved file answers ``QUESTION`` with."""
    family, spec, before = CASES[name]
    model, tok, method = fixture_model(family), char_tokenizer(), kvc.method_from_spec(spec)
    document = random_text(90, seed=len(name))
    if before:
        result = kvc.generate(model, tok, document, method=method, max_new_tokens=before)
    else:
        result = kvc.compress(model, tok, document, method=method)
    result.save(path)
    return kvc.generate(model, tok, QUESTION, past=kvc.load(path, model, tok), max_new_tokens=8).token_ids[0]


def main() -> None:
    record = {}
    for name, (family, spec, _) in CASES.items():
        path = HERE / f"v{VERSION}-{name}.kvc"
        tokens = write_case(name, path)
        record[name] = {"family": family, "method": spec, "question": QUESTION, "tokens": tokens}
        print(f"{path.name}: {path.stat().st_size} bytes, answers {tokens}")
    (HERE / f"v{VERSION}-answers.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
