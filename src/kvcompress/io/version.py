"""This kvcompress's version, read from its installed metadata (no heavy import: ``kvcompress.__version__``, and
``kvcompress --version`` answered before the command line loads torch)."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    """This kvcompress's version, as installed (``unknown`` when it runs from a source tree only)."""
    try:
        return metadata.version("kvcompress")
    except metadata.PackageNotFoundError:
        return "unknown"


def versions_line() -> str:
    """kvcompress's version, and torch's and transformers' as installed (read without importing them)."""
    versions = {}
    for name in ("kvcompress", "torch", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return f"kvcompress {versions['kvcompress']} (torch {versions['torch']}, transformers {versions['transformers']})"
