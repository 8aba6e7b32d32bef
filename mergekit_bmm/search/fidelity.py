"""Cheap-then-full evaluation: spend validation examples only where a trial can still win.

Most trials of a search are clearly worse than the incumbent (the best fully scored trial)
after a fraction of their examples. For an evaluator that can score single examples
(:class:`~mergekit_bmm.evaluation.base.ExampleScoring`; per-example scores in [0, 1] whose
mean is the task's score, e.g. accuracy), a trial is scored in two stages:

1. **cheap**: a fixed, stratified ``cheap`` share of every task's examples (the same
   examples for every trial). The trial is compared with the incumbent *on those same
   examples* (a paired difference ``d``: what the two models share cancels, so nearby
   trials are told apart with few examples) and its full score is estimated as
   ``incumbent + d``. Unless ``d + promote_z · se(d) > 0`` the trial ends here (a trial that
   agrees with the incumbent on every cheap example is not promoted: at best it would beat
   it by a hair). (Without the
   incumbent's per-example scores, e.g. a log written before they were kept, the rule is
   unpaired: ``cheap + promote_z · se < incumbent``.) Standard errors are
   finite-population corrected: the full score is a mean over a fixed set.
2. **full**: the remaining examples, in chunks taken from every task in turn. With
   ``early_stop`` scoring stops as soon as the trial could not beat the incumbent even if
   every remaining example were right (its score is then certainly below the incumbent).

Only fully scored trials can become the best; the first trial, with no incumbent, is
always scored in full. A trial that ended early is told to the optimiser with its
estimated full score (capped by the bound that stopped it): it sits below the incumbent,
where the surrogate needs little precision.
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
    """The best fully scored trial so far: its score and its per-example cheap-stage scores."""

    score: float
    cheap_values: dict[str, list[float]] | None = None  # per task, in cheap-subset order
    cheap: float | None = None  # the cheap share those values belong to

    @classmethod
    def of(cls, record: Any) -> Incumbent | None:
        if record is None:
            return None
        fidelity = record.fidelity or {}
        packed = fidelity.get("cheap_values")
        values = {task: unpack(text) for task, text in packed.items()} if packed else None
        return cls(record.score, values, fidelity.get("cheap"))


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
    cheap_values: dict[str, list[float]] = field(default_factory=dict)
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
        if self.level == FULL and self.cheap_values:  # a full trial may become the incumbent
            out["cheap_values"] = {task: pack(values) for task, values in self.cheap_values.items()}
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


@dataclass
class _Tally:
    """Running sums of one task's per-example scores."""

    total: int
    values: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values) if self.values else math.nan

    def upper_bound(self) -> float:
        """The task's score if every example not yet scored were right (scores are ≤ 1)."""
        return (math.fsum(self.values) + (self.total - len(self.values))) / self.total

    def standard_error(self) -> float:
        n = len(self.values)
        if n == 0:
            return math.inf
        mean = self.mean
        variance = math.fsum((v - mean) ** 2 for v in self.values) / max(n - 1, 1)
        correction = max(0.0, 1.0 - n / self.total)  # the full score is a mean over a finite set
        return math.sqrt(variance / n * correction)


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
    tallies = {task: _Tally(spec.count) for task, spec in examples.items()}
    total = sum(spec.count for spec in examples.values())
    first = cheap_subset(examples, cheap) if cheap is not None and cheap < 1 else {}
    result = StagedScores(per_task={}, total=total, cheap=cheap if first else None)
    shares = _shares(weights, tallies)
    if first:
        for task, indices in first.items():
            result.cheap_values[task] = [float(v) for v in score(task, indices)]
            tallies[task].values.extend(result.cheap_values[task])
        result.cheap_score = sum(shares[t] * tally.mean for t, tally in tallies.items())
        result.cheap_se = _standard_error(tallies, shares)
        if incumbent is not None:
            estimate, margin = _compare(result, incumbent, tallies, shares, first)
            if estimate + promote_z * margin <= incumbent.score:
                result.estimate = round(estimate, 6)
                return _finish(result, tallies, CHEAP)
            result.promoted = True
    rest = {}
    for task, spec in examples.items():
        taken = set(first.get(task, ()))
        rest[task] = [i for i in range(spec.count) if i not in taken]
    for task, indices in _round_robin({task: _chunks(indices, chunk) for task, indices in rest.items()}):
        tallies[task].values.extend(float(v) for v in score(task, indices))
        if early_stop and incumbent is not None:
            bound = sum(shares[t] * tally.upper_bound() for t, tally in tallies.items())
            if bound <= incumbent.score:
                done = len(tallies[task].values)
                result.stopped_at = f"{task} after {done} of {tallies[task].total} examples"
                seen = sum(shares[t] * tally.mean for t, tally in tallies.items() if tally.values)
                if result.cheap_score is not None:
                    seen = _compare(result, incumbent, tallies, shares, first)[0]
                result.estimate = round(min(seen, bound), 6)
                return _finish(result, tallies, STOPPED)
    return _finish(result, tallies, FULL)


def _shares(weights: Mapping[str, float], tasks: Mapping[str, Any]) -> dict[str, float]:
    total = sum(weights.get(task, 1.0) for task in tasks)
    return {task: weights.get(task, 1.0) / total for task in tasks}


def _standard_error(tallies: Mapping[str, _Tally], shares: Mapping[str, float]) -> float:
    return math.sqrt(sum((shares[t] * tally.standard_error()) ** 2 for t, tally in tallies.items()))


def _compare(
    result: StagedScores,
    incumbent: Incumbent,
    tallies: Mapping[str, _Tally],
    shares: Mapping[str, float],
    first: Mapping[str, list[int]],
) -> tuple[float, float]:
    """(estimated full score, its standard error) from the cheap stage: paired with the
    incumbent's cheap-stage scores when they belong to the same subset, else unpaired."""
    theirs = incumbent.cheap_values
    same = (
        theirs is not None
        and incumbent.cheap == result.cheap
        and all(len(theirs.get(task, ())) == len(indices) for task, indices in first.items())
    )
    if not same:
        return result.cheap_score, result.cheap_se
    differences = {}
    for task in first:
        tally = _Tally(tallies[task].total)
        tally.values = [a - b for a, b in zip(result.cheap_values[task], theirs[task])]
        differences[task] = tally
    result.paired = True
    gap = sum(shares[t] * tally.mean for t, tally in differences.items())
    return incumbent.score + gap, _standard_error(differences, shares)


def _finish(result: StagedScores, tallies: Mapping[str, _Tally], level: str) -> StagedScores:
    result.level = level
    result.per_task = {task: tally.mean for task, tally in tallies.items() if tally.values}
    result.scored = sum(len(tally.values) for tally in tallies.values())
    return result


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start : start + size] for start in range(0, len(indices), size)]


def _round_robin(chunks: Mapping[str, list[list[int]]]) -> list[tuple[str, list[int]]]:
    """One chunk of every task in turn, so every task is covered early (a tighter bound)."""
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
        max(rule.chunk, getattr(evaluator, "example_chunk", 0)),
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
        f"({summary['promoted']} promoted after the cheap stage), {summary['cheap_only']} stopped after it, "
        f"{summary['stopped_early']} stopped early; {100 * share:.0f}% of validation examples scored, "
        f"about {summary['evaluation_seconds_saved']:.0f} s of evaluation saved"
    )
