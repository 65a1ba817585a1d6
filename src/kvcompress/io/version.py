"""This kvcompress's version, read from its installed metadata (no heavy import: ``kvcompress.__version__``)."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    """This kvcompress's version, as installed (``unknown`` when it runs from a source tree only)."""
    try:
        return metadata.version("kvcompress")
    except metadata.PackageNotFoundError:
        return "unknown"
