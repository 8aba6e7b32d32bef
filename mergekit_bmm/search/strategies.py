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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from mergekit_bmm.search.config import SearchConfig
from mergekit_bmm.search.space import SearchSpace


class Proposer(Protocol):
    def ask(self) -> dict[str, float]: ...

    def tell(self, values: Mapping[str, float], score: float | None) -> None: ...


class SkoptProposer:
    """``bo``: scikit-optimize's ``Optimizer`` with a Gaussian process and the acquisition."""

    def __init__(self, space: SearchSpace, config: SearchConfig) -> None:
        from skopt import Optimizer

        self.space = space
        self.optimizer = Optimizer(
            space.skopt_dimensions(),
            base_estimator="GP",
            n_initial_points=config.n_initial,
            initial_point_generator=config.initial_point_generator,
            acq_func=config.acquisition,
            acq_optimizer=config.acq_optimizer,
            random_state=config.seed,
        )
        self._worst: float | None = None
        self._provisional: list[int] = []

    def ask(self) -> dict[str, float]:
        return self.space.as_values(self.optimizer.ask())

    def tell(self, values: Mapping[str, float], score: float | None) -> None:
        point = self.space.as_point(values)
        if score is None or not math.isfinite(score):
            if self._worst is None:
                self._provisional.append(len(self.optimizer.yi))
                objective = 0.0
            else:
                objective = -self._worst
        else:
            if self._worst is None:
                for index in self._provisional:
                    self.optimizer.yi[index] = -score
                self._provisional.clear()
            self._worst = score if self._worst is None else min(self._worst, score)
            objective = -score
        self.optimizer.tell(point, objective)


class RandomProposer:
    """``random``: independent draws from the same skopt space and priors as ``bo``."""

    def __init__(self, space: SearchSpace, config: SearchConfig) -> None:
        from skopt.space import Space

        self.space = space
        self.skopt_space = Space(space.skopt_dimensions())
        self.rng = np.random.RandomState(config.seed)

    def ask(self) -> dict[str, float]:
        return self.space.as_values(self.skopt_space.rvs(n_samples=1, random_state=self.rng)[0])

    def tell(self, values: Mapping[str, float], score: float | None) -> None:
        pass


class GridProposer:
    """One λ shared by every group and block, ``budget`` points log-spaced over the range."""

    def __init__(self, space: SearchSpace, config: SearchConfig) -> None:
        low, high = config.lambda_range
        count = config.budget
        grid = np.geomspace(low, high, count) if count > 1 else np.array([math.sqrt(low * high)])
        self.points = [space.shared_lambda_values(float(lam), config.grid_scale) for lam in grid]
        self._next = 0

    def ask(self) -> dict[str, float]:
        return dict(self.points[min(self._next, len(self.points) - 1)])

    def tell(self, values: Mapping[str, float], score: float | None) -> None:
        self._next += 1


def make_proposer(space: SearchSpace, config: SearchConfig) -> Proposer:
    if config.strategy == "grid":
        return GridProposer(space, config)
    if config.strategy == "random":
        return RandomProposer(space, config)
    return SkoptProposer(space, config)


def same_point(left: Mapping[str, float], right: Mapping[str, float], tolerance: float = 1e-9) -> bool:
    """Whether two proposals agree (to rounding in the JSON round trip)."""
    if set(left) != set(right):
        return False
    return all(abs(left[k] - right[k]) <= tolerance * max(1.0, abs(right[k])) for k in left)
