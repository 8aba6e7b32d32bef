"""Cheap-then-full evaluation on a known objective: what it saves and what it costs, per rule.

A GP search (scikit-optimize, EI, the search's own ``staged_scores``) over a 5-dimensional box
whose true score per task is known: each of ``--tasks`` tasks has ``--docs`` validation examples,
and a trial at ``x`` gets example ``j`` of task ``t`` right when ``u_tj < p_t(x)`` for a fixed
difficulty ``u_tj ~ U(0, 1)`` (two trials disagree only on the examples between their two
accuracies, as nearby merges of one model mostly do). ``p_t`` is a bowl of height
``--spread`` above a task baseline: a small spread is a flat landscape, where every trial is
within a few points of the best. Each seed runs the search twice, with full evaluation and with
the rule (``--cheap``, ``--chunk``, ``--promote-z``), and the table gives the cost ratio
(examples scored plus ``--fixed`` per trial, a trial's cost outside scoring) and the *true*
score of each search's best trial, paired by seed.

    python bench/fidelity_simulation.py --docs 200 --chunk 64 --chunk 16 --seeds 6

It needs no model and no data: minutes on one core.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from tqdm.auto import tqdm

from mergekit_bmm.evaluation.base import TaskExamples
from mergekit_bmm.search.fidelity import FULL, Incumbent, staged_scores

DIMENSIONS = 5


class KnownObjective:
    """Tasks with fixed example difficulties and a bowl-shaped true accuracy each."""

    def __init__(self, seed: int, tasks: int, docs: int, spread: float) -> None:
        rng = np.random.default_rng(100 + seed)
        self.names = [f"task{index}" for index in range(tasks)]
        self.difficulty = {name: rng.random(docs) for name in self.names}
        self.centre = {name: rng.random(DIMENSIONS) for name in self.names}
        self.baseline = {name: 0.86 + 0.04 * rng.random() for name in self.names}
        self.spread = spread
        self.examples = {name: TaskExamples(docs) for name in self.names}

    def accuracy(self, x, task: str) -> float:
        distance = float(np.sum((np.asarray(x) - self.centre[task]) ** 2)) / DIMENSIONS
        return min(1.0, max(0.0, self.baseline[task] + self.spread * (1 - 3 * distance)))

    def true_score(self, x) -> float:
        return sum(self.accuracy(x, task) for task in self.names) / len(self.names)

    def scorer(self, x):
        def score(task: str, indices) -> list[float]:
            level = self.accuracy(x, task)
            return [float(self.difficulty[task][index] < level) for index in indices]

        return score


def search(
    objective: KnownObjective, seed: int, budget: int, rule: dict | None, fixed: int
) -> tuple[float, float]:
    """(cost, true score of the best fully scored trial) of one GP search."""
    from skopt import Optimizer

    optimizer = Optimizer(
        [(0.0, 1.0)] * DIMENSIONS,
        base_estimator="GP",
        acq_func="EI",
        acq_optimizer="sampling",
        n_initial_points=10,
        random_state=seed,
    )
    full = {"cheap": None, "promote_z": 0.0, "early_stop": False, "chunk": 10**9}
    incumbent, best_true, cost = None, math.nan, 0.0
    for _ in range(budget):
        x = optimizer.ask()
        result = staged_scores(objective.examples, objective.scorer(x), {}, incumbent, **(rule or full))
        cost += result.scored + fixed
        value = (
            sum(result.per_task.values()) / len(result.per_task) if result.level == FULL else result.estimate
        )
        optimizer.tell(x, -value)
        if result.level == FULL and (incumbent is None or value > incumbent.score):
            values = {task: [by[i] for i in range(len(by))] for task, by in result.values.items()}
            incumbent, best_true = Incumbent(value, values), objective.true_score(x)
    return cost, best_true


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=200, help="validation examples per task")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--spread", type=float, default=0.05, help="height of the bowl (0.05: 5 points)")
    parser.add_argument("--budget", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--cheap", type=float, default=0.25)
    parser.add_argument("--promote-z", type=float, default=1.0)
    parser.add_argument("--chunk", type=int, action="append", help="repeat for several rules (default 64)")
    parser.add_argument("--fixed", type=int, default=10, help="a trial's cost outside scoring, in examples")
    args = parser.parse_args()
    chunks = args.chunk or [64]
    rows = []
    for chunk in chunks:
        rule = {"cheap": args.cheap, "promote_z": args.promote_z, "early_stop": True, "chunk": chunk}
        costs, gaps = [0.0, 0.0], []
        for seed in tqdm(range(args.seeds), desc=f"chunk {chunk}", leave=False):
            objective = KnownObjective(seed, args.tasks, args.docs, args.spread)
            full_cost, full_true = search(objective, seed, args.budget, None, args.fixed)
            staged_cost, staged_true = search(objective, seed, args.budget, rule, args.fixed)
            costs[0] += full_cost
            costs[1] += staged_cost
            gaps.append(staged_true - full_true)
        mean = float(np.mean(gaps))
        error = float(np.std(gaps, ddof=1) / math.sqrt(len(gaps))) if len(gaps) > 1 else math.nan
        rows.append((chunk, costs[0] / costs[1], mean, error))
    print(
        f"{args.tasks} tasks x {args.docs} examples, spread {args.spread}, K = {args.budget}, "
        f"cheap {args.cheap}, promote_z {args.promote_z}, {args.seeds} seeds"
    )
    print(f"{'chunk':>6}  {'cost full/staged':>16}  {'true best, staged - full (points)':>34}")
    for chunk, ratio, mean, error in rows:
        print(f"{chunk:>6}  {ratio:>15.2f}x  {100 * mean:>+26.2f} ± {100 * error:.2f}")


if __name__ == "__main__":
    main()
