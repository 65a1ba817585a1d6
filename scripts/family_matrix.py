"""The support table (family x method) from the family matrix that tests/test_models.py checks.

    python scripts/family_matrix.py                      # runs the cells, writes docs/img/family_matrix.json,
                                                         # prints the table
    python scripts/family_matrix.py --table              # prints the table from the JSON (what docs/usage.md shows)

Each cell runs as the test's does, on the same tiny random-weight models: the method at a budget
covering the prompt (or attending every token) against the full cache (its tokens, and its
log-probabilities along the full cache's answer within the test's tolerance), then at a small budget
in a batch of two rows of very different lengths against each row alone; or the one-line refusal.
A cell reads ``exact`` (both hold), or ``no: <reason>`` (refused), or ``FAILS`` (it neither runs nor is
refused: never in a committed table; tests/test_models.py would fail too).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

RESULTS = ROOT / "docs/img/family_matrix.json"
# what a refusal's message names, as the table says it
REASONS = (("rotary", "RoPE it cannot invert"), ("sinks", "learned sinks"))


def run_cells() -> dict[str, dict[str, str]]:
    import kvcompress as kvc  # the cells only
    from tests import test_models
    from tests.fixtures import FAMILIES, char_tokenizer, family_model

    COVERING, LOGPROB_TOLERANCE, PROMPT, SMALL = (
        test_models.COVERING,
        test_models.LOGPROB_TOLERANCE,
        test_models.PROMPT,
        test_models.SMALL,
    )
    full_logprobs, full_reference = test_models.full_logprobs, test_models.full_reference

    tok = char_tokenizer()
    table: dict[str, dict[str, str]] = {}
    for family in FAMILIES:
        model = family_model(family)  # its own attention implementation until a kvcompress cache attaches it
        full, record = full_reference(family)
        row = table.setdefault(family, {})
        inputs = tok(PROMPT, return_tensors="pt")
        plain = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)[
            0, inputs["input_ids"].shape[1] :
        ].tolist()
        # the full cache through kvcompress is the model's own generate
        row["full"] = "exact" if plain == full.token_ids[0] else "FAILS"
        for name, covering in COVERING.items():
            try:
                same = kvc.generate(model, tok, PROMPT, method=covering, max_new_tokens=8).token_ids == full.token_ids
                close = (
                    kvc.teacher_forced_logprobs(model, record, covering, full.token_ids[0]) - full_logprobs(family)
                ).abs().max() <= LOGPROB_TOLERANCE
                batch = kvc.generate(model, tok, [PROMPT, PROMPT[:30]], method=SMALL[name], max_new_tokens=6)
                alone = [
                    kvc.generate(model, tok, p, method=SMALL[name], max_new_tokens=6).token_ids[0]
                    for p in (PROMPT, PROMPT[:30])
                ]
                row[name] = "exact" if same and bool(close) and batch.token_ids == alone else "FAILS"
            except kvc.UnsupportedModelError as refused:
                row[name] = "no: " + next((word for key, word in REASONS if key in str(refused).lower()), str(refused))
            print(f"{family:20s} {name:16s} {row[name]}", flush=True)
    return table


def markdown(table: dict[str, dict[str, str]]) -> str:
    """The table as docs/usage.md shows it: a row per family, a column per method (its test label); ``yes``: exact
    where the math says so and compressing in batches as alone, ``no (reason)``: refused in one line."""
    methods = list(next(iter(table.values())))

    def cell(outcome: str) -> str:
        return "yes" if outcome == "exact" else f"no ({outcome[4:]})" if outcome.startswith("no: ") else outcome

    lines = ["| family | " + " | ".join(methods) + " |", "| --- |" + " :---: |" * len(methods)]
    lines += [
        f"| {family} | " + " | ".join(cell(outcome) for outcome in row.values()) + " |" for family, row in table.items()
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the table from the committed JSON, run nothing")
    args = parser.parse_args()
    if not args.table:
        warnings.filterwarnings("ignore")
        RESULTS.write_text(json.dumps(run_cells(), indent=1) + "\n")
    print(markdown(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
