"""A benchmark's rows as it measures them, one JSON line each, so a rerun with the same settings resumes where the
last one stopped (and refuses another run's settings in the same folder)."""

from __future__ import annotations

import json
from pathlib import Path


class Journal:
    """Rows measured so far, one JSON line each in ``rows.jsonl``, so an interrupted run resumes.
    The first line holds the settings; a rerun with other settings is refused, not mixed in."""

    def __init__(self, path: Path, settings: dict) -> None:
        self.path, self.rows = path, {}
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and json.loads(lines[0]).get("settings") != json.loads(json.dumps(settings)):
            raise ValueError(
                f"{path} holds a run with other settings; use another --out folder (or delete it) to start a new run"
            )
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interrupt: measured again
                continue
            self.rows[self.key(row)] = row
        path.write_text("".join(json.dumps(x) + "\n" for x in [{"settings": settings}, *self.rows.values()]))

    @staticmethod
    def key(row: dict) -> tuple:
        return row.get("search"), row["method"], row["prompt_tokens"], row["batch"], row.get("repeat", 0)

    def measure(self, key: tuple, run) -> dict:
        """The row for ``key`` (search, method, prompt tokens, batch, repeat): from the journal, or ``run()`` and
        recorded."""
        if key not in self.rows:
            row = run()
            if key[0]:
                row = {"search": key[0], **row}
            if key[4]:
                row["repeat"] = key[4]
            self.rows[key] = row
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        return self.rows[key]
