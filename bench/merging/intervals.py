"""Bootstrap intervals of test accuracies and of differences between models.

The benchmark's score is the mean over tasks of each task's accuracy. An interval
resamples the test examples of every task with replacement (stratified by task, so each
task keeps its size) and recomputes that mean; a difference between two models resamples
the same examples for both (paired), so what the two share cancels. Percentile intervals
at 95 % from :data:`REPLICATES` replicates with a fixed seed: the same numbers every run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

REPLICATES = 2000
LEVEL = 0.95
SEED = 0


def _replicates(per_task: Mapping[str, np.ndarray], seed: int = SEED) -> np.ndarray:
    """Bootstrap replicates of the mean over tasks of each task's mean (one value per replicate)."""
    rng = np.random.default_rng(seed)
    total = np.zeros(REPLICATES)
    for values in per_task.values():
        values = np.asarray(values, dtype=float)
        draws = rng.integers(0, len(values), size=(REPLICATES, len(values)))
        total += values[draws].mean(axis=1)
    return total / len(per_task)


def interval(per_task: Mapping[str, Sequence[float]]) -> tuple[float, float, float]:
    """(estimate, low, high) of the mean over tasks; values per example (1/0 correct, or averages)."""
    arrays = {task: np.asarray(values, dtype=float) for task, values in per_task.items()}
    estimate = float(np.mean([values.mean() for values in arrays.values()]))
    low, high = np.quantile(_replicates(arrays), [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return estimate, float(low), float(high)


def paired_difference(
    first: Mapping[str, Sequence[float]], second: Mapping[str, Sequence[float]]
) -> tuple[float, float, float]:
    """(estimate, low, high) of mean(first) − mean(second), resampling the same examples for both."""
    differences = {
        task: np.asarray(first[task], dtype=float) - np.asarray(second[task], dtype=float) for task in first
    }
    return interval(differences)


def seed_mean(flags: Sequence[Mapping[str, Sequence[bool]]]) -> dict[str, np.ndarray]:
    """Per example, the share of seeds whose model got it right (a search's expected accuracy)."""
    tasks = flags[0].keys()
    return {task: np.mean([np.asarray(run[task], dtype=float) for run in flags], axis=0) for task in tasks}
