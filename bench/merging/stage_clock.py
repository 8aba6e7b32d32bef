"""Wall time per stage, summed over every invocation of a run (a run may span sessions).

``<cache>/runs/<name>/stage_seconds.json`` keeps, per stage, the seconds of every invocation
that did real work (a stage replayed from its cache in under ``REPLAY_SECONDS`` is not
counted). Stages built before the clock existed are filled in from their own records
(expert training time, head fitting, the anchor grids), marked as such.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.merging.cache import read_json, write_json

REPLAY_SECONDS = 5.0


class StageClock:
    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / "stage_seconds.json"
        self.entries: dict[str, Any] = read_json(self.path) if self.path.is_file() else {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.time()
        try:
            yield
        finally:
            seconds = time.time() - started
            if seconds >= REPLAY_SECONDS:
                entry = self.entries.setdefault(name, {"seconds": 0.0, "invocations": 0})
                entry["seconds"] = round(entry["seconds"] + seconds, 1)
                entry["invocations"] += 1
                write_json(self.path, self.entries)

    def fill_from_records(self, name: str, seconds: float | None) -> None:
        """A stage built before the clock: its own records' time, if the clock has none."""
        if name not in self.entries and seconds and seconds >= REPLAY_SECONDS:  # not a cached replay
            self.entries[name] = {"seconds": round(seconds, 1), "invocations": 0, "from_records": True}
            write_json(self.path, self.entries)

    def table(self) -> dict[str, Any]:
        return dict(self.entries)
