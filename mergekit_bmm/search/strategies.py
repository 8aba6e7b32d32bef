"""Where the next trial's values come from: GP-EI (``bo``), ``random``, or a shared-λ ``grid``.

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
state after every batch (:mod:`mergekit_bmm.search.snapshot`): a resume that finds one
matching the log restores it instead, with no fit at all.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from mergekit_bmm.search.config import SearchConfig
from mergekit_bmm.search.space import SearchSpace


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
