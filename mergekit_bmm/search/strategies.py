"""Where the next trial's values come from (GP-EI ``bo``, ``random``, shared-λ ``grid``), kept and replayed.

``bo`` is scikit-optimize's ``Optimizer`` (a Gaussian process with the chosen
acquisition); ``random`` draws from the same skopt space and priors, so their difference
is exactly what the surrogate buys. scikit-optimize minimises; it is told ``-score``.

A proposer is deterministic given the seed and the sequence of (point, score) it was
told, and the random state also advances when it is asked. Resuming therefore *replays*
the log through the same ask/tell calls, which reproduces the optimiser's state exactly
and lets the proposals continue as if the run had never stopped.

Failed trials are told as the worst score seen so far, which steers the surrogate away
from them without inventing a scale; failures before any success are told the first
successful score once there is one. Replay repeats these rules, so it stays exact.

Replaying costs a surrogate fit per logged batch, so ``bo`` also keeps a snapshot of its
state after every batch (:mod:`mergekit_bmm.search.strategies`): a resume that finds one
matching the log restores it instead, with no fit at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.atomic import replacing
from mergekit_bmm.search.config import SearchConfig
from mergekit_bmm.search.log import TrialRecord, batch_of, read_events, read_trials, repair
from mergekit_bmm.search.space import BoxChange, SearchSpace

if TYPE_CHECKING:  # annotations only: experiment imports this module
    from mergekit_bmm.search.experiment import RunFolder


class Proposer(Protocol):
    def ask(self) -> dict[str, float]: ...

    def tell(self, values: Mapping[str, float], score: float | None) -> None: ...

    def ask_batch(self, count: int) -> list[dict[str, float]]: ...

    def tell_batch(self, results: Sequence[tuple[Mapping[str, float], float | None]]) -> None: ...

    def rebuild(self) -> None: ...

    def state(self) -> bytes | None:
        """The proposer's whole state, for a snapshot (None: replaying it is cheap)."""
        ...

    def restore(self, state: bytes) -> None: ...


class SequentialBatches:
    """Batches of a proposer whose points do not depend on each other: ask and tell in turn."""

    def state(self) -> bytes | None:
        return None  # no surrogate: replaying the log costs nothing

    def restore(self, state: bytes) -> None:
        raise NotImplementedError

    def ask_batch(self, count: int) -> list[dict[str, float]]:
        return [self.ask() for _ in range(count)]

    def tell_batch(self, results: Sequence[tuple[Mapping[str, float], float | None]]) -> None:
        for values, score in results:
            self.tell(values, score)


class SkoptProposer:
    """``bo``: scikit-optimize's ``Optimizer`` with a Gaussian process and the acquisition.

    With ``start``, the first point asked is ``start`` (the anchor start: the first of the
    ``n_initial`` points), the others come from the optimiser.
    """

    def __init__(
        self, space: SearchSpace, config: SearchConfig, start: Mapping[str, float] | None = None
    ) -> None:
        self.space = space
        self.config = config
        self.optimizer = self._optimizer(config.n_initial, config.seed)
        self._worst: float | None = None
        self._provisional: list[int] = []
        self._rebuilt = 0
        self._start = dict(start) if start else None

    def _optimizer(self, n_initial: int, seed: int):
        from skopt import Optimizer

        config = self.config
        return Optimizer(
            self.space.skopt_dimensions(),
            base_estimator="GP",
            n_initial_points=n_initial,
            initial_point_generator=config.initial_point_generator,
            acq_func=config.acquisition,
            acq_optimizer=config.acq_optimizer,
            random_state=seed,
            model_queue_size=1,  # keeps only the latest fitted surrogate (proposals use no other)
        )

    def state(self) -> bytes:
        return pickle.dumps((self.optimizer, self._worst, self._provisional, self._rebuilt, self._start))

    def restore(self, state: bytes) -> None:
        loaded = pickle.loads(state)
        self.optimizer, self._worst, self._provisional, self._rebuilt = loaded[:4]
        self._start = loaded[4] if len(loaded) > 4 else None  # snapshots written before the anchor start

    def rebuild(self) -> None:
        """Take the space's new ranges: a new optimiser, told every point so far (one fit)."""
        told_points, told = list(self.optimizer.Xi), list(self.optimizer.yi)
        self._rebuilt += 1
        remaining = max(0, self.config.n_initial - len(told))
        self.optimizer = self._optimizer(remaining, self.config.seed + 1000 * self._rebuilt)
        if told_points:
            self.optimizer.tell(told_points, told)

    def ask(self) -> dict[str, float]:
        return self.ask_batch(1)[0]

    def ask_batch(self, count: int) -> list[dict[str, float]]:
        """``count`` points at once: scikit-optimize's constant liar (``cl_min``) for a batch."""
        points = [_take_start(self)] if self._start is not None and count > 0 else []
        count -= len(points)
        if count == 1:
            points.append(self.space.as_values(self.optimizer.ask()))
        elif count > 1:
            asked = self.optimizer.ask(n_points=count, strategy="cl_min")
            points.extend(self.space.as_values(point) for point in asked)
        return points

    def tell(self, values: Mapping[str, float], score: float | None) -> None:
        self.tell_batch([(values, score)])

    def tell_batch(self, results: Sequence[tuple[Mapping[str, float], float | None]]) -> None:
        """Tell a batch in order (one surrogate fit for the whole batch)."""
        points, objectives = [], []
        for values, score in results:
            points.append(self.space.as_point(values))
            objectives.append(self._objective(score, len(self.optimizer.yi) + len(objectives), objectives))
        if len(points) == 1:
            self.optimizer.tell(points[0], objectives[0])
        else:
            self.optimizer.tell(points, objectives)

    def _objective(self, score: float | None, position: int, pending: list[float]) -> float:
        """What scikit-optimize (a minimiser) is told for ``score`` at ``position`` in its log."""
        if score is None or not math.isfinite(score):
            if self._worst is None:
                self._provisional.append(position)
                return 0.0
            return -self._worst
        if self._worst is None:
            told = len(self.optimizer.yi)
            for index in self._provisional:
                if index < told:
                    self.optimizer.yi[index] = -score
                else:
                    pending[index - told] = -score
            self._provisional.clear()
        self._worst = score if self._worst is None else min(self._worst, score)
        return -score


class RandomProposer(SequentialBatches):
    """``random``: independent draws from the same skopt space and priors as ``bo`` (after
    ``start``, when given, as ``bo`` does)."""

    def __init__(
        self, space: SearchSpace, config: SearchConfig, start: Mapping[str, float] | None = None
    ) -> None:
        self.space = space
        self.rng = np.random.RandomState(config.seed)
        self._start = dict(start) if start else None
        self.rebuild()

    def rebuild(self) -> None:
        """Draw from the space's current ranges."""
        from skopt.space import Space

        self.skopt_space = Space(self.space.skopt_dimensions())

    def ask(self) -> dict[str, float]:
        if self._start is not None:
            return _take_start(self)
        return self.space.as_values(self.skopt_space.rvs(n_samples=1, random_state=self.rng)[0])

    def tell(self, values: Mapping[str, float], score: float | None) -> None:
        pass


class GridProposer(SequentialBatches):
    """One λ shared by every group and block, ``budget`` points log-spaced over the range."""

    def __init__(self, space: SearchSpace, config: SearchConfig) -> None:
        low, high = space.kind_range("lambda")
        count = config.budget
        grid = np.geomspace(low, high, count) if count > 1 else np.array([math.sqrt(low * high)])
        self.points = [space.shared_lambda_values(float(lam), config.grid_scale) for lam in grid]
        self._next = 0

    def rebuild(self) -> None:
        """A grid is fixed by design (the ablation's baseline): its box never widens."""

    def ask(self) -> dict[str, float]:
        return dict(self.points[min(self._next, len(self.points) - 1)])

    def tell(self, values: Mapping[str, float], score: float | None) -> None:
        self._next += 1


def _take_start(proposer: SkoptProposer | RandomProposer) -> dict[str, float]:
    """The start point, once."""
    start, proposer._start = proposer._start, None
    return start


def make_proposer(
    space: SearchSpace, config: SearchConfig, start: Mapping[str, float] | None = None
) -> Proposer:
    """The config's strategy; ``bo`` and ``random`` ask ``start`` first when given (a grid has
    its own points)."""
    if config.strategy == "grid":
        return GridProposer(space, config)
    if config.strategy == "random":
        return RandomProposer(space, config, start)
    return SkoptProposer(space, config, start)


def same_point(left: Mapping[str, float], right: Mapping[str, float], tolerance: float = 1e-9) -> bool:
    """Whether two proposals agree (to rounding in the JSON round trip)."""
    if set(left) != set(right):
        return False
    return all(abs(left[k] - right[k]) <= tolerance * max(1.0, abs(right[k])) for k in left)


# -- The proposer as it stood after the last finished batch, so that a resume needs no surrogate fit.
SNAPSHOT_FILE = "proposer.pkl"
FORMAT = "mergekit-bmm-proposer/1"
LIBRARIES = ("scikit-optimize", "scikit-learn", "scipy", "numpy")


@dataclass(frozen=True)
class Snapshot:
    trials: int  # trials told, in order: the finished batches of the log
    digest: str
    state: bytes


def log_digest(records: Sequence[TrialRecord]) -> str:
    """What the proposer was told: each trial's index, values and score (None when it failed)."""
    told = [[r.trial, sorted(r.values.items()), r.score if r.ok else None] for r in records]
    return hashlib.sha256(json.dumps(told).encode()).hexdigest()


def _versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = ""
    return found


def save_snapshot(path: Path, proposer: Proposer, records: Sequence[TrialRecord]) -> None:
    """Write the proposer's state after ``records`` (nothing for proposers that replay for free)."""
    state = proposer.state()
    if state is None:
        return
    payload = {
        "format": FORMAT,
        "versions": _versions(),
        "trials": len(records),
        "digest": log_digest(records),
        "state": state,
    }
    with replacing(path, fsync=False) as temporary:
        temporary.write_bytes(pickle.dumps(payload))


def load_snapshot(path: Path) -> Snapshot | None:
    """The snapshot in ``path`` if it is readable and was written by these library versions."""
    try:
        payload = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError):
        return None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return None
    if payload.get("versions") != _versions():
        return None
    return Snapshot(payload["trials"], payload["digest"], payload["state"])


# -- Resuming: the logged trials are replayed through a fresh proposer, batch by batch.
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
