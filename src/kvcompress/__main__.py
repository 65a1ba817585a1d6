"""``kvcompress`` (the console script) and ``python -m kvcompress``: the command line, with Ctrl-C
during its imports (torch, transformers: seconds, and libraries that turn an interrupted import into
other errors) answered by one line instead of a traceback."""

from __future__ import annotations

import sys

from .cli.common import starting
from .io.version import versions_line  # (metadata only: light)


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # read from metadata: no need to load torch
        print(versions_line())
        return 0
    with starting():
        from .cli import main as run  # noqa: PLC0415 - within the handler: Ctrl-C while it loads is one line
    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
