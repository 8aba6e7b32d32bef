"""Cheap-then-full evaluation: spend validation examples only where a trial can still win.

Most trials of a search are clearly worse than the incumbent (the best fully scored trial)
after a fraction of their examples. For an evaluator that can score single examples
(:class:`~mergekit_bmm.evaluation.base.ExampleScoring`; per-example scores in [0, 1] whose
mean is the task's score, e.g. accuracy), a trial is scored in stages:

1. **cheap**: a fixed, stratified ``cheap`` share of every task's examples (the same
   examples for every trial), scored in chunks taken from every task in turn. The trial is
   compared with the incumbent *on the same examples* (a paired difference ``d``: what the
   two models share cancels, so nearby trials are told apart with few examples) and its full
   score is estimated as ``incumbent + d``. Unless ``d + promote_z · se(d) > 0`` the trial
   ends: after any chunk once every task has one (a trial far behind is told apart on a few
   hundred examples), and at the end of its cheap share, where passing promotes it (a trial
   that agrees with the incumbent on every cheap example is not promoted: at best it would
   beat it by a hair). Standard errors are finite-population corrected: the full score is
   a mean over a fixed set.
2. **full**: the other examples, in chunks taken from every task in turn. After each
   chunk the same comparison is made on every example scored so far (every task already
   has its cheap share, so each task's mean is estimated throughout), and the trial stops
   once it fails it. With ``early_stop`` it also stops as soon as it could not
   beat the incumbent even if every remaining example were right (then it is certainly
   below the incumbent).

The incumbent's per-example scores are kept in its trial record (``values``), so the paired
comparison survives a resume; without them (a log written before they were kept) the
comparison is unpaired: the trial's mean over the examples scored so far, with its standard
error. Only fully scored trials can become the best; the first trial, with no incumbent, is
always scored in full. A trial that ended early is told to the optimiser with its estimated
full score (capped by the bound when that stopped it): it sits below the incumbent, where the
surrogate needs little precision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mergekit_bmm.evaluation.base import TaskExamples

FULL, CHEAP, STOPPED = "full", "cheap", "stopped"
SUBSET_SEED = 0


@dataclass(frozen=True)
class Incumbent:
    """The best fully scored trial so far: its score and, when known, its per-example scores."""

    score: float
    values: dict[str, list[float]] | None = None  # per task, every example in index order

    @classmethod
    def of(cls, record: Any) -> Incumbent | None:
        if record is None:
            return None
        packed = (record.fidelity or {}).get("values")
        return cls(record.score, {task: unpack(text) for task, text in packed.items()} if packed else None)


@dataclass
class StagedScores:
    """What a staged evaluation gave: per-task scores on the examples scored, and how far it went."""

    per_task: dict[str, float]
    level: str = FULL  # full | cheap | stopped
    estimate: float | None = None  # the score told to the optimiser when not full
    cheap: float | None = None
    cheap_score: float | None = None
    cheap_se: float | None = None
    paired: bool = False
    promoted: bool = False  # passed the cheap stage against an incumbent
    values: dict[str, dict[int, float]] = field(default_factory=dict)  # per task, by example index
    scored: int = 0
    total: int = 0
    stopped_at: str | None = None

    def record(self) -> dict[str, Any]:
        """The trial record's ``fidelity`` entry."""
        out: dict[str, Any] = {"level": self.level, "scored": self.scored, "total": self.total}
        if self.cheap_score is not None:
            out.update(
                cheap=self.cheap,
                cheap_score=round(self.cheap_score, 6),
                cheap_se=round(self.cheap_se or 0.0, 6),
                paired=self.paired,
                promoted=self.promoted,
            )
        if self.estimate is not None:
            out["estimate"] = self.estimate
        if self.stopped_at:
            out["stopped_at"] = self.stopped_at
        if self.level == FULL:  # a full trial may become the incumbent: keep what pairing needs
            out["values"] = {
                task: pack([values[index] for index in range(len(values))])
                for task, values in self.values.items()
            }
        return out


def pack(values: Sequence[float]) -> str | list[float]:
    """Per-example scores for the log: 0/1 values as a hex bit string, others as rounded floats."""
    if all(v in (0.0, 1.0) for v in values):
        bits = "".join("1" if v else "0" for v in values)
        return f"{len(bits)}:" + (format(int(bits, 2), "x") if bits else "")
    return [round(float(v), 6) for v in values]


def unpack(packed: str | list[float]) -> list[float]:
    if isinstance(packed, list):
        return [float(v) for v in packed]
    length, _, digits = packed.partition(":")
    bits = format(int(digits, 16), "b").zfill(int(length)) if digits else ""
    return [float(bit == "1") for bit in bits]


def cheap_subset(examples: Mapping[str, TaskExamples], fraction: float) -> dict[str, list[int]]:
    """Per task, a fixed ``fraction`` of its examples, stratified by ``strata`` where given.

    Every stratum keeps at least one example; the choice is seeded, so every trial (and every
    worker) scores the same examples.
    """
    chosen: dict[str, list[int]] = {}
    for task, spec in examples.items():
        strata: dict[int, list[int]] = {}
        for index in range(spec.count):
            strata.setdefault(spec.strata[index] if spec.strata else 0, []).append(index)
        rng = random.Random(f"{SUBSET_SEED}:{task}")
        picked: list[int] = []
        for members in strata.values():
            size = min(len(members), max(1, round(fraction * len(members))))
            picked.extend(rng.sample(members, size))
        chosen[task] = sorted(picked)
    return chosen


def _mean_and_error(values: Sequence[float], total: int) -> tuple[float, float]:
    """Mean of ``values`` and its standard error as an estimate of the mean over ``total``
    examples (finite-population corrected: exact once every example is in)."""
    n = len(values)
    if n == 0:
        return math.nan, math.inf
    mean = math.fsum(values) / n
    variance = math.fsum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(variance / n * max(0.0, 1.0 - n / total))


class _Trial:
    """The examples scored so far, per task, and what they say against the incumbent."""

    def __init__(self, examples: Mapping[str, TaskExamples], weights: Mapping[str, float]) -> None:
        self.totals = {task: spec.count for task, spec in examples.items()}
        weight_sum = sum(weights.get(task, 1.0) for task in examples)
        self.shares = {task: weights.get(task, 1.0) / weight_sum for task in examples}
        self.values: dict[str, dict[int, float]] = {task: {} for task in examples}

    def add(self, task: str, indices: Sequence[int], scores: Sequence[float]) -> None:
        self.values[task].update((index, float(value)) for index, value in zip(indices, scores))

    def estimate(self, incumbent: Incumbent | None) -> tuple[float, float, bool]:
        """(estimated full score, its standard error, paired): ``incumbent + d`` from the paired
        differences on the examples scored when the incumbent's values are known, else the mean."""
        theirs = incumbent.values if incumbent is not None else None
        paired = theirs is not None and all(len(theirs.get(t, ())) == n for t, n in self.totals.items())
        estimate, variance = (incumbent.score if paired else 0.0), 0.0
        for task, scored in self.values.items():
            if not scored:
                continue
            values = [v - theirs[task][i] for i, v in scored.items()] if paired else list(scored.values())
            mean, error = _mean_and_error(values, self.totals[task])
            estimate += self.shares[task] * mean
            variance += (self.shares[task] * error) ** 2
        return estimate, math.sqrt(variance), paired

    def upper_bound(self) -> float:
        """The score if every example not yet scored were right (scores are ≤ 1)."""
        return sum(
            self.shares[task]
            * (math.fsum(scored.values()) + self.totals[task] - len(scored))
            / self.totals[task]
            for task, scored in self.values.items()
        )

    def means(self) -> dict[str, float]:
        return {
            task: math.fsum(scored.values()) / len(scored) for task, scored in self.values.items() if scored
        }


def staged_scores(
    examples: Mapping[str, TaskExamples],
    score: Callable[[str, Sequence[int]], Sequence[float]],
    weights: Mapping[str, float],
    incumbent: Incumbent | float | None,
    cheap: float | None,
    promote_z: float,
    early_stop: bool,
    chunk: int,
) -> StagedScores:
    """Score a trial in stages (see the module's docstring); ``cheap`` None scores in one stage."""
    if isinstance(incumbent, (int, float)):
        incumbent = Incumbent(float(incumbent))
    trial = _Trial(examples, weights)
    first = cheap_subset(examples, cheap) if cheap is not None and cheap < 1 else {}
    result = StagedScores(per_task={}, total=sum(trial.totals.values()), cheap=cheap if first else None)

    def behind() -> bool:
        """Whether the trial fails the comparison with the incumbent on what it has scored."""
        estimate, error, result.paired = trial.estimate(incumbent)
        result.estimate = round(min(estimate, trial.upper_bound()), 6)
        return estimate + promote_z * error <= incumbent.score

    if first:
        cheap_chunks = _round_robin({task: _chunks(indices, chunk) for task, indices in first.items()})
        cheap_total = sum(len(indices) for indices in first.values())
        for position, (task, indices) in enumerate(cheap_chunks):
            trial.add(task, indices, score(task, indices))
            every_task_in = all(trial.values[t] for t, chosen in first.items() if chosen)
            if incumbent is not None and every_task_in and behind():
                if position < len(cheap_chunks) - 1:  # before the end of the share: say where
                    done = sum(len(scored) for scored in trial.values.values())
                    result.stopped_at = f"after {done} of {cheap_total} cheap examples (estimate)"
                result.cheap_score, result.cheap_se, _ = trial.estimate(None)
                return _finish(result, trial, CHEAP)
        result.cheap_score, result.cheap_se, _ = trial.estimate(None)
        result.promoted = incumbent is not None
    rest = {}
    for task, total in trial.totals.items():
        taken = set(first.get(task, ()))
        rest[task] = [i for i in range(total) if i not in taken]
    for task, indices in _round_robin({task: _chunks(indices, chunk) for task, indices in rest.items()}):
        trial.add(task, indices, score(task, indices))
        if incumbent is None:
            continue
        if early_stop and trial.upper_bound() <= incumbent.score:
            result.stopped_at = (
                f"{task} after {len(trial.values[task])} of {trial.totals[task]} examples (bound)"
            )
            behind()
            return _finish(result, trial, STOPPED)
        if first and behind():
            done = sum(len(scored) for scored in trial.values.values())
            result.stopped_at = f"after {done} of {result.total} examples (estimate)"
            return _finish(result, trial, STOPPED)
    result.estimate = None
    return _finish(result, trial, FULL)


def _finish(result: StagedScores, trial: _Trial, level: str) -> StagedScores:
    result.level = level
    result.per_task = trial.means()
    result.values = trial.values
    result.scored = sum(len(scored) for scored in trial.values.values())
    return result


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start : start + size] for start in range(0, len(indices), size)]


def _round_robin(chunks: Mapping[str, list[list[int]]]) -> list[tuple[str, list[int]]]:
    """One chunk of every task in turn, so every task is covered early (a tighter comparison)."""
    order = []
    for position in range(max((len(c) for c in chunks.values()), default=0)):
        order.extend(
            (task, task_chunks[position])
            for task, task_chunks in chunks.items()
            if position < len(task_chunks)
        )
    return order


def evaluate_trial(evaluator: Any, model: Any, tokenizer: Any, incumbent: Incumbent | None, rule: Any) -> Any:
    """Score a live model: staged when ``rule`` (``fidelity:``) is on and the evaluator scores
    single examples, else the evaluator's plain per-task scores."""
    if rule is None or not rule.enabled or not getattr(evaluator, "scores_examples", False):
        return evaluator.evaluate_model(model, tokenizer)
    if not rule.early_stop and rule.cheap >= 1:
        return evaluator.evaluate_model(model, tokenizer)
    return staged_scores(
        evaluator.examples(),
        evaluator.example_scorer(model, tokenizer),
        evaluator.weights,
        incumbent,
        rule.cheap,
        rule.promote_z,
        rule.early_stop,
        rule.chunk,
    )


def fidelity_summary(records: Sequence[Any]) -> dict[str, Any] | None:
    """How a search spent its validation examples: trials per level, promotions, examples and
    (estimated) evaluation time saved. None when no trial was scored in stages."""
    staged = [r for r in records if r.ok and r.fidelity]
    if not staged:
        return None
    levels = [r.fidelity["level"] for r in staged]
    scored = sum(r.fidelity["scored"] for r in staged)
    total = sum(r.fidelity["total"] for r in staged)
    seconds = sum(r.time.get("evaluate", 0.0) for r in staged)
    per_example = seconds / scored if scored else 0.0
    summary = {
        "trials": len(staged),
        "full": levels.count(FULL),
        "cheap_only": levels.count(CHEAP),
        "stopped_early": levels.count(STOPPED),
        "promoted": sum(1 for r in staged if r.fidelity.get("promoted")),
        "paired": sum(1 for r in staged if r.fidelity.get("paired")),
        "examples_scored": scored,
        "examples_total": total,
        "evaluation_seconds": round(seconds, 2),
        "evaluation_seconds_saved": round(per_example * (total - scored), 2),
    }
    summary["description"] = describe(summary)
    return summary


def describe(summary: Mapping[str, Any]) -> str:
    """One line for the report and the card."""
    share = summary["examples_scored"] / max(summary["examples_total"], 1)
    return (
        f"cheap-then-full evaluation: {summary['full']} of {summary['trials']} trials scored in full "
        f"({summary['promoted']} promoted after the cheap stage), "
        f"{summary['cheap_only']} ended in the cheap stage, {summary['stopped_early']} stopped after it; "
        f"{100 * share:.0f}% of validation examples scored, "
        f"about {summary['evaluation_seconds_saved']:.0f} s of evaluation saved"
    )
