"""One trial: its recipe becomes a model (resident or on disk), the evaluator scores it in its time limit.

A trial runs as named *stages* (``merge``, then ``evaluate``), each timed. A stage that
raises fails the trial: the error becomes one line in the trial's record and its
traceback goes to ``errors.log``; the search goes on. An error of the user's making
(:class:`~mergekit_bmm.errors.BMMError`, e.g. a misconfigured evaluator) stops the
search instead, since every later trial would fail the same way.

:class:`DiskTrials` is the ``trials: disk`` route: mergekit writes the trial's model
folder and the evaluator loads it.
"""

from __future__ import annotations

import math
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mergekit_bmm.errors import error_summary, find_bmm_error
from mergekit_bmm.evaluation.base import evaluate_folder
from mergekit_bmm.plugin import run as recipe_run
from mergekit_bmm.search.fidelity import Incumbent, StagedScores, evaluate_trial
from mergekit_bmm.search.space import text_sha256


@dataclass(frozen=True)
class PlannedTrial:
    """A proposed point with its recipe, before it runs."""

    index: int
    values: dict[str, float]
    text: str  # the recipe (YAML)
    yaml: str  # where the recipe is written, relative to OUT_PATH
    incumbent: Incumbent | None = None  # the best full trial when it was planned (staged evaluation)
    timeout: float | None = None  # seconds it may run (search/timeouts.py)

    @property
    def sha256(self) -> str:
        return text_sha256(self.text)


@dataclass
class TrialOutcome:
    """What running a trial gave: per-task scores, or the error that stopped it (and its traceback,
    which the search writes to ``errors.log``)."""

    per_task: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    times: dict[str, float] = field(default_factory=dict)
    traceback: str | None = None
    fidelity: dict[str, Any] | None = None  # how far a staged evaluation went (search/fidelity.py)


class TrialRunner(Protocol):
    """Turns a planned trial into an outcome (disk, resident, or a worker pool)."""

    def run(self, trial: PlannedTrial) -> TrialOutcome: ...

    def close(self) -> None: ...


class ErrorLog:
    """``errors.log``: full tracebacks of failed trials, appended (by the search's driver only)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, where: str, error: BaseException) -> None:
        self.write_text(where, "".join(traceback.format_exception(type(error), error, error.__traceback__)))

    def write_text(self, where: str, text: str) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(f"--- {where} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
            handle.write(text if text.endswith("\n") else text + "\n")


def run_stages(label: str, stages: Sequence[tuple[str, Callable[[], Any]]]) -> TrialOutcome:
    """Run ``stages`` in order, timing each; the last one returns the per-task scores.

    ``cpu`` is the CPU time of the process running the trial (every thread; a worker runs one
    trial at a time): what a trial costs on a machine busy with other work, where wall time
    says little."""
    clock = time.perf_counter
    outcome = TrialOutcome(times={name: 0.0 for name, _ in stages})
    cpu_start = time.process_time()
    result: Any = None
    for name, stage in stages:
        tick = clock()
        try:
            result = stage()
        except Exception as caught:
            ours = find_bmm_error(caught)
            if ours is not None:
                raise ours from None
            outcome.times[name] = clock() - tick
            outcome.error = f"{name}: {error_summary(caught)}"
            outcome.traceback = f"{label} ({name})\n" + "".join(
                traceback.format_exception(type(caught), caught, caught.__traceback__)
            )
            outcome.times["cpu"] = time.process_time() - cpu_start
            return outcome
        outcome.times[name] = clock() - tick
    outcome.times["cpu"] = time.process_time() - cpu_start
    if isinstance(result, StagedScores):
        outcome.per_task, outcome.fidelity = dict(result.per_task), result.record()
    else:
        outcome.per_task = dict(result)
    return outcome


def score_of(per_task: Mapping[str, float], weights: Mapping[str, float]) -> tuple[float | None, str | None]:
    """The trial's score (the weighted mean over tasks, paper eq. 10), or why there is none."""
    from mergekit_bmm.evaluation import weighted_mean

    score = weighted_mean(dict(per_task), dict(weights))
    if math.isfinite(score):
        return score, None
    bad = [task for task, value in per_task.items() if not math.isfinite(value)] or ["the mean"]
    return None, f"evaluate: non-finite score for {', '.join(bad)}"


class DiskTrials:
    """``trials: disk``: mergekit writes each trial's model folder; the evaluator loads it."""

    def __init__(self, evaluator: Any, work_dir: Path, options: Any, fidelity: Any = None) -> None:
        self.evaluator = evaluator
        self.work_dir = Path(work_dir)
        self.options = options
        self.fidelity = fidelity

    def _evaluate(self, folder: Path, incumbent: Incumbent | None) -> Any:
        evaluator = self.evaluator
        if getattr(evaluator, "loading", None) is None:
            return evaluator.evaluate(folder)
        return evaluate_folder(
            evaluator,
            folder,
            evaluator.device,
            lambda model, tokenizer: evaluate_trial(evaluator, model, tokenizer, incumbent, self.fidelity),
        )

    def run(self, trial: PlannedTrial) -> TrialOutcome:
        folder = self.work_dir / f"trial-{trial.index:04d}"
        shutil.rmtree(folder, ignore_errors=True)
        try:
            return run_stages(
                f"trial {trial.index}",
                [
                    ("merge", lambda: recipe_run.merge_recipe_text(trial.text, folder, self.options)),
                    ("evaluate", lambda: self._evaluate(folder, trial.incumbent)),
                ],
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        pass


# -- How long a trial may run before it is stopped, and stopping it in this process.
AUTO_FACTOR = 10.0
AUTO_FLOOR_SECONDS = 300.0


def time_left(started_and_limits: Iterable[tuple[float, float | None]]) -> float | None:
    """Seconds until the first running trial reaches its limit, from each trial's start
    (``time.perf_counter``) and limit; None when none has a limit (a pool's wait timeout)."""
    now = time.perf_counter()
    left = [started + limit - now for started, limit in started_and_limits if limit]
    return max(0.0, min(left)) if left else None


class TrialTimeout(BaseException):
    """Raised in the search's own process when a trial runs past its limit (a BaseException,
    so an evaluator's ``except Exception`` cannot swallow it)."""


def trial_limit(setting: float | str | None, records: Sequence[Any]) -> float | None:
    """The limit, in seconds, for the next trials given ``trial_timeout`` and the trials so far."""
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    times = [record.time.get("total", 0.0) for record in records if record.ok]
    if not times:
        return None
    return max(AUTO_FLOOR_SECONDS, AUTO_FACTOR * max(times))


def timeout_error(limit: float, restarted: bool) -> str:
    """The one-line reason a trial past its limit is recorded with."""
    what = "its worker was stopped and restarted" if restarted else "it was interrupted"
    return f"timeout: the trial ran past its limit of {limit:.0f} s ({what}); set trial_timeout in search.yml"


@contextmanager
def alarm(seconds: float | None) -> Iterator[None]:
    """Raise :class:`TrialTimeout` in this (main) thread after ``seconds``; no-op elsewhere."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TrialTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
