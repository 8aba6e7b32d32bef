"""``trials.jsonl``: the append-only record of finished trials (resuming from it is in ``strategies``).

Each finished trial is one JSON line, written with a single ``write`` on an ``O_APPEND``
descriptor and ``fsync``-ed before the next trial starts. A process killed at any moment
therefore leaves complete lines plus, at worst, one torn last line (a write cut short),
which :func:`read_trials` drops and :func:`repair` truncates. Nothing else is ever
rewritten, so a crash cannot lose finished trials.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergekit_bmm.errors import ConfigError

OK = "ok"
FAILED = "failed"

if TYPE_CHECKING:  # annotations only: experiment imports this module
    pass


@dataclass
class TrialRecord:
    """One finished trial."""

    trial: int
    status: str
    values: dict[str, float]
    score: float | None
    per_task: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    time: dict[str, float] = field(default_factory=dict)  # merge, evaluate, surrogate (seconds)
    yaml: str = ""  # the trial's recipe, relative to OUT_PATH
    yaml_sha256: str = ""
    finished_at: str = ""
    batch: int | None = None  # the batch of proposals it belongs to (None: its own, as in a serial run)
    batch_size: int = 1
    worker: str = ""  # where it ran (parallel searches)
    fidelity: dict[str, Any] | None = None  # staged evaluation: level (cheap/stopped/full), examples scored

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def full(self) -> bool:
        """Scored on every validation example (only such a trial can be the best)."""
        return self.fidelity is None or self.fidelity.get("level") == "full"

    def to_line(self) -> bytes:
        data = asdict(self)
        # JSON has no NaN; a failed trial's score is null and its error says why.
        if data["score"] is not None and not math.isfinite(data["score"]):
            data["score"] = None
        data["per_task"] = {k: (v if math.isfinite(v) else None) for k, v in data["per_task"].items()}
        return (json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n").encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRecord:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        per_task = {
            k: (math.nan if v is None else float(v)) for k, v in (known.get("per_task") or {}).items()
        }
        known["per_task"] = per_task
        return cls(**known)


def read_trials(path: Path) -> tuple[list[TrialRecord], int]:
    """The logged trials and the byte length of the intact part of the file.

    A last line without its newline is a write that a kill interrupted: it is ignored
    (that trial is run again). Any other damage is reported, never guessed around.
    """
    path = Path(path)
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    intact = data.rfind(b"\n") + 1
    records: dict[int, TrialRecord] = {}
    for number, line in enumerate(data[:intact].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if isinstance(data, dict) and "event" in data:
                continue  # not a trial (see read_events)
            record = TrialRecord.from_dict(data)
        except (ValueError, TypeError) as error:
            raise ConfigError(
                f"{path} line {number} is not a trial record ({error}); the log was edited or damaged: "
                "restore it or start a new OUT_PATH"
            ) from None
        if record.trial in records:
            raise ConfigError(
                f"{path} line {number} holds trial {record.trial} a second time; the log was edited: "
                "restore it or start a new OUT_PATH"
            )
        records[record.trial] = record
    ordered = [records[index] for index in sorted(records)]
    _check_complete(path, ordered)
    return ordered, intact


def batch_of(record: TrialRecord) -> int:
    """The record's batch; a serial run's trials are each their own."""
    return record.trial if record.batch is None else record.batch


def _check_complete(path: Path, records: list[TrialRecord]) -> None:
    """Trials are numbered without gaps, except inside the last batch (a parallel run killed mid-batch)."""
    last_batch = batch_of(records[-1]) if records else None
    for expected, record in enumerate(records):
        if record.trial != expected and batch_of(record) != last_batch:
            raise ConfigError(
                f"{path} holds trial {record.trial} where trial {expected} was expected; the log was "
                "edited: restore it or start a new OUT_PATH"
            )


def read_events(path: Path) -> list[dict[str, Any]]:
    """The log's event lines (e.g. ``event: box``, a widened search box), in order."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    events = []
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and "event" in item:
            events.append(item)
    return events


def append_event(path: Path, event: dict[str, Any]) -> None:
    """Append one event line durably, like a trial."""
    _append_line(path, (json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n").encode())


def repair(path: Path, intact: int) -> bool:
    """Cut a torn last line off the log; True if something was cut."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == intact:
        return False
    with open(path, "r+b") as handle:
        handle.truncate(intact)
        handle.flush()
        os.fsync(handle.fileno())
    return True


def append_trial(path: Path, record: TrialRecord) -> None:
    """Append one line durably: one write, then fsync."""
    _append_line(path, record.to_line())


def _append_line(path: Path, line: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(descriptor, line)
        while written < len(line):  # regular files write fully; be safe anyway
            written += os.write(descriptor, line[written:])
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
