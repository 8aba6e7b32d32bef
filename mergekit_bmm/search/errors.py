"""Errors of the search command (one line each, like every :class:`BMMError`)."""

from __future__ import annotations

from mergekit_bmm.errors import BMMError


class SearchStopped(BMMError):
    """The search cannot go on (too many failed trials, an evaluator that is misconfigured)."""

    exit_code = 3


class OutputFolderError(BMMError):
    """``OUT_PATH`` holds something this run must not touch (another experiment, a running search)."""
