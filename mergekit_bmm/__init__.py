"""Bayesian Model Merging (BMM) for mergekit.

Importing the package has no side effects: the mathematics of every merge
(``mergekit_bmm.core``) works without mergekit. mergekit learns about ``bmm`` through
the start-up hook an installed wheel ships, or through :func:`activate`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mergekit_bmm.plugin import activate

try:
    __version__ = version("mergekit-bmm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "activate"]
