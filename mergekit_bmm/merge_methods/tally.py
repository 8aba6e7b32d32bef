"""A per-merge, thread-safe record that tensor kernels add to and the merge's end reads.

mergekit calls a method once per tensor and may do so from several threads; what a merge
should report at its end (the tensors kept at the anchor, the λ the evidence chose) is
gathered here, emptied at each merge's start so it does not grow over a search's trials.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

Value = TypeVar("Value")


class Tally(Generic[Value]):
    """``key -> value`` in the order first added; :meth:`drained` hands it over and empties it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Value] = {}

    def add(self, key: str, value: Value) -> None:
        """Record ``value`` under ``key`` (the first value for a key stays)."""
        with self._lock:
            self._entries.setdefault(key, value)

    def reset(self) -> None:
        with self._lock:
            self._entries.clear()

    def drained(self) -> dict[str, Value]:
        with self._lock:
            entries = dict(self._entries)
            self._entries.clear()
        return entries
