"""Wall time per stage, summed over every invocation of a run (a run may span sessions).

``<cache>/runs/<name>/stage_seconds.json`` keeps, per stage, the seconds of every invocation
that did real work (a stage replayed from its cache in under ``REPLAY_SECONDS`` is not
counted). A running stage writes its time so far every ``HEARTBEAT_SECONDS``, so a run that
is killed (a session that ends) loses at most that much of its clock. Stages built before
the clock existed, or whose earlier invocations were killed before it wrote as it went, are
filled in from their own records (expert training time, head fitting, the searches' own
clocks), marked as such.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.merging.cache import read_json, write_json

REPLAY_SECONDS = 5.0
HEARTBEAT_SECONDS = 60.0


class StageClock:
    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / "stage_seconds.json"
        self.entries: dict[str, Any] = read_json(self.path) if self.path.is_file() else {}
        self._lock = threading.Lock()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        before = dict(self.entries.get(name) or {"seconds": 0.0, "invocations": 0})
        started = time.time()
        done = threading.Event()

        def record() -> None:
            seconds = time.time() - started
            with self._lock:
                if seconds >= REPLAY_SECONDS:
                    entry = {**before, "seconds": round(before["seconds"] + seconds, 1)}
                    entry["invocations"] = before["invocations"] + 1
                    self.entries[name] = entry
                    write_json(self.path, self.entries)

        def beat() -> None:
            while not done.wait(HEARTBEAT_SECONDS):
                record()

        heart = threading.Thread(target=beat, name=f"stage-clock-{name}", daemon=True)
        heart.start()
        try:
            yield
        finally:
            done.set()
            heart.join()
            record()

    def fill_from_records(self, name: str, seconds: float | None) -> None:
        """A stage built before the clock: its own records' time, if the clock has none."""
        if name not in self.entries and seconds and seconds >= REPLAY_SECONDS:  # not a cached replay
            self.entries[name] = {"seconds": round(seconds, 1), "invocations": 0, "from_records": True}
            write_json(self.path, self.entries)

    def at_least(self, name: str, seconds: float | None) -> None:
        """A stage whose own records (e.g. its searches' clocks) show more time than the clock
        kept: invocations killed before the clock wrote as it went. Takes the records' time."""
        entry = self.entries.get(name)
        if entry is not None and seconds and seconds > entry["seconds"]:
            self.entries[name] = {**entry, "seconds": round(seconds, 1), "from_records": True}
            write_json(self.path, self.entries)

    def table(self) -> dict[str, Any]:
        return dict(self.entries)
