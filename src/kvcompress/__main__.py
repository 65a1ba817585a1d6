"""``kvcompress`` (the console script) and ``python -m kvcompress``: the command line, with Ctrl-C
during its imports (torch, transformers: seconds, and libraries that turn an interrupted import into
other errors) answered by one line instead of a traceback."""

from __future__ import annotations

import os
import signal
import sys

from .io.version import versions_line  # (metadata only: light)


def _stop_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write("kvcompress: interrupted while starting; nothing was done\n")
    sys.stderr.flush()
    os._exit(130)  # nothing has run yet: no state to unwind, and no import left half done to trip over


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # read from metadata: no need to load torch
        print(versions_line())
        return 0
    previous = signal.signal(signal.SIGINT, _stop_while_starting)
    try:
        from .cli import main as run  # noqa: PLC0415 - after the handler: Ctrl-C during the heavy imports is one line
    finally:
        signal.signal(signal.SIGINT, previous)
    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
