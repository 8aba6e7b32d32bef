"""Resuming: the logged trials are replayed through a fresh proposer, batch by batch.

A proposer is deterministic given its seed and the sequence of batches it is asked for
and told, so asking for each logged batch (its logged size) and telling it the logged
scores in trial order reproduces the optimiser's state exactly, whatever order the
trials finished in. The next proposal is then the one the interrupted run would have
made. A parallel run killed mid-batch leaves that batch *open*: its missing trials are
proposed again (the same points) and run before the search goes on. The cost is the
surrogate fits of the logged batches (one per batch after the initial points), unless a
snapshot of the proposer (:mod:`mergekit_bmm.search.snapshot`) matches the log: then the
batches it covers are only checked, and the proposer is restored as it was after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.search.box import BoxChange
from mergekit_bmm.search.log import TrialRecord, batch_of, read_events, read_trials, repair
from mergekit_bmm.search.run_folder import RunFolder
from mergekit_bmm.search.snapshot import Snapshot, log_digest
from mergekit_bmm.search.space import SearchSpace
from mergekit_bmm.search.strategies import Proposer, same_point


@dataclass
class OpenBatch:
    """A batch whose trials did not all finish: the points, and the trials already logged."""

    batch: int
    start: int  # trial index of its first point
    points: list[dict[str, float]]
    done: dict[int, TrialRecord] = field(default_factory=dict)

    @property
    def missing(self) -> list[int]:
        return [self.start + i for i in range(len(self.points)) if self.start + i not in self.done]


@dataclass
class Replayed:
    records: list[TrialRecord]  # the trials of complete batches, in order
    open_batch: OpenBatch | None = None
    batches: int = 0  # batches proposed so far (the next one's number)
    box_changes: list[BoxChange] = field(default_factory=list)
    restored: int = 0  # trials covered by the proposer's snapshot (told without a fit)


def _covered(batches: list[list[TrialRecord]], snapshot: Snapshot | None) -> int:
    """How many leading batches ``snapshot`` stands for (0 when it matches none of the log)."""
    if snapshot is None:
        return 0
    told: list[TrialRecord] = []
    for count, members in enumerate(batches, start=1):
        if len(members) < members[0].batch_size:
            break
        told.extend(sorted(members, key=lambda record: record.trial))
        if len(told) == snapshot.trials:
            return count if log_digest(told) == snapshot.digest else 0
    return 0


def replay(
    folder: RunFolder,
    proposer: Proposer,
    space: SearchSpace,
    echo: Callable[[str], None],
    progress: bool = True,
    snapshot: Snapshot | None = None,
) -> Replayed:
    """Tell ``proposer`` every logged batch; return the records and any open batch."""
    from tqdm.auto import tqdm

    records, intact = read_trials(folder.trials_jsonl)
    if repair(folder.trials_jsonl, intact):
        echo("trials.jsonl ended with a torn line (a run was killed while writing); dropped it")
    changes = [
        BoxChange(**{k: v for k, v in event.items() if k != "event"})
        for event in read_events(folder.trials_jsonl)
        if event.get("event") == "box"
    ]
    groups: dict[int, list[TrialRecord]] = {}
    for record in records:
        groups.setdefault(batch_of(record), []).append(record)
    result = Replayed(records=[])
    warned = False
    bar = tqdm(
        total=len(records), desc="replaying trials.jsonl", unit="trial", disable=not progress, leave=False
    )
    ordered_batches = sorted(groups.items(), key=lambda item: item[1][0].trial)
    covered = _covered([members for _, members in ordered_batches], snapshot)
    for position, (batch, members) in enumerate(ordered_batches):
        start, size = len(result.records), members[0].batch_size
        if position < covered:  # the snapshot stands for this batch: check it, tell nothing
            _check_batch(folder, space, batch, members, start, size)
            result.batches = batch + 1
            result.records.extend(sorted(members, key=lambda record: record.trial))
            for change in changes:
                if change.after_trial == result.records[-1].trial:
                    space.widen(change.dimension, change.low, change.high)
                    result.box_changes.append(change)
            bar.update(len(members))
            if position == covered - 1:
                proposer.restore(snapshot.state)
                result.restored = len(result.records)
            continue
        points = proposer.ask_batch(size)
        done = {record.trial: record for record in members}
        _check_batch(folder, space, batch, members, start, size)
        for record in members:
            offset = record.trial - start
            if not warned and not same_point(points[offset], record.values):
                warned = True
                echo(
                    f"note: trial {record.trial}'s logged values differ from what the optimiser proposes now "
                    "(another version of scikit-optimize, scikit-learn or mergekit-bmm?); "
                    "continuing from the logged trials"
                )
            points[offset] = dict(record.values)
        result.batches = batch + 1
        bar.update(len(members))
        if len(members) < size:
            result.open_batch = OpenBatch(batch, start, points, done)
            break
        ordered = [done[start + i] for i in range(size)]
        proposer.tell_batch([(record.values, record.score if record.ok else None) for record in ordered])
        result.records.extend(ordered)
        widened = [change for change in changes if change.after_trial == ordered[-1].trial]
        for change in widened:  # the box as the run widened it, at the same point
            space.widen(change.dimension, change.low, change.high)
        if widened:
            proposer.rebuild()
            result.box_changes.extend(widened)
    bar.close()
    return result


def _check_batch(
    folder: RunFolder, space: SearchSpace, batch: int, members: list[TrialRecord], start: int, size: int
) -> None:
    """The logged trials of a batch must lie in the space and in the batch's places."""
    for record in members:
        space.as_point(record.values)  # the space must match the log
        if not 0 <= record.trial - start < size:
            raise ConfigError(
                f"{folder.trials_jsonl}: trial {record.trial} does not fit batch {batch}; "
                "the log was edited: restore it or start a new OUT_PATH"
            )
