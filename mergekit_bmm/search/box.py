"""A search box that notices it is too small, and widens.

When the best trial so far sits at an edge of a dimension's range — within
:data:`EDGE_FRACTION` of the range, measured in log space for λ — after the initial points,
that edge moves outwards: λ by a factor :data:`LAMBDA_FACTOR` (one decade), ``s`` by half
the range's width, each up to hard limits; ε never leaves [0, 1]. Each change is logged in
``trials.jsonl`` (an ``event: box`` line after the batch that prompted it), replayed as
logged on resume, and reported in the summary and the card. ``widen_box: false`` turns it off.

Expected improvement likes corners, so in a space of many dimensions a new best often sits
on some edge. Two rules keep the box from running away with the budget: after a widening the
search gets one trial per dimension to learn the new box before the next one
(:func:`cooldown_trials`), and an edge moves at most :data:`MAX_WIDENINGS` times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mergekit_bmm.search.log import TrialRecord
from mergekit_bmm.search.space import Dimension, SearchSpace

EDGE_FRACTION = 0.03
LAMBDA_FACTOR = 10.0
LAMBDA_LIMITS = (1e-6, 1e4)
SCALE_LIMITS = (0.05, 5.0)
EPSILON_LIMITS = (0.0, 1.0)
MAX_WIDENINGS = 2  # per edge: two decades of λ, or twice half the range of s


@dataclass(frozen=True)
class BoxChange:
    """One widened edge: ``dimension`` now spans [low, high] (it spanned [old_low, old_high])."""

    after_trial: int
    dimension: str
    old_low: float
    old_high: float
    low: float
    high: float
    best_trial: int
    best_value: float

    def describe(self) -> str:
        return (
            f"{self.dimension}: [{self.old_low:.4g}, {self.old_high:.4g}] -> "
            f"[{self.low:.4g}, {self.high:.4g}] after trial {self.after_trial} "
            f"(best trial {self.best_trial} at {self.best_value:.4g})"
        )

    def as_event(self) -> dict:
        return {"event": "box", **vars(self)}


def _position(dimension: Dimension, value: float) -> float:
    """Where ``value`` lies in the range, 0 (low) to 1 (high), in the prior's scale."""
    if dimension.log_uniform:
        low, high = math.log(dimension.low), math.log(dimension.high)
        return (math.log(value) - low) / (high - low)
    return (value - dimension.low) / (dimension.high - dimension.low)


def _limits(dimension: Dimension) -> tuple[float, float]:
    return {"lambda": LAMBDA_LIMITS, "scale": SCALE_LIMITS}.get(dimension.kind, EPSILON_LIMITS)


def _widened(dimension: Dimension, at_low: bool) -> tuple[float, float]:
    low, high = dimension.low, dimension.high
    floor, ceiling = _limits(dimension)
    if dimension.kind == "lambda":
        return (
            (max(floor, low / LAMBDA_FACTOR), high) if at_low else (low, min(ceiling, high * LAMBDA_FACTOR))
        )
    step = 0.5 * (high - low)
    return (max(floor, low - step), high) if at_low else (low, min(ceiling, high + step))


def cooldown_trials(space: SearchSpace) -> int:
    """Trials between two widenings: one per dimension, so the surrogate sees the new box."""
    return len(space.dimensions)


def edge_changes(
    space: SearchSpace, records: list[TrialRecord], n_initial: int, previous: list[BoxChange] = ()
) -> list[BoxChange]:
    """The edges to widen now, given every finished trial (none before the initial points) and
    the changes made so far."""
    finished = [record for record in records if record.ok and record.full and record.score is not None]
    if len(records) < n_initial or not finished:
        return []
    last = max(record.trial for record in records)
    if previous and last - max(change.after_trial for change in previous) < cooldown_trials(space):
        return []
    best = max(finished, key=lambda record: (record.score, -record.trial))
    changes = []
    for dimension in space.dimensions:
        value = best.values[dimension.name]
        position = _position(dimension, value)
        for at_low, near in ((True, position <= EDGE_FRACTION), (False, position >= 1 - EDGE_FRACTION)):
            moved = sum(
                change.dimension == dimension.name and (change.low < change.old_low) == at_low
                for change in previous
            )
            if not near or moved >= MAX_WIDENINGS:
                continue
            low, high = _widened(dimension, at_low)
            if (low, high) != (dimension.low, dimension.high):
                changes.append(
                    BoxChange(
                        last, dimension.name, dimension.low, dimension.high, low, high, best.trial, value
                    )
                )
    return changes
