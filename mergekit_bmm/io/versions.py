"""The versions records, cards and cache keys store: this plugin's and mergekit's."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def mergekit_version() -> str:
    """The installed mergekit's version ("unknown" when its metadata is missing)."""
    try:
        return version("mergekit")
    except PackageNotFoundError:
        return "unknown"


def versions() -> dict[str, str]:
    """The plugin's and mergekit's versions, as records and cache keys store them."""
    from mergekit_bmm import __version__

    return {"mergekit_bmm": __version__, "mergekit": mergekit_version()}
