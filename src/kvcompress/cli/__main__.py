"""``python -m kvcompress.cli``: the command line (``python -m kvcompress`` also answers Ctrl-C while starting)."""

from .main import main

raise SystemExit(main())
