"""Where a search's trials run: in a resident model (the default when it can), or on disk.

``trials: memory`` merges each trial into one resident model and scores the live model
(:mod:`mergekit_bmm.search.resident`); ``trials: disk`` has mergekit write each trial's
folder and the evaluator load it. ``auto`` takes memory whenever the evaluator can score a
live model, bmm's factor cache is on and ε is not searched, and says why when it cannot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.search.experiment import Experiment, middle_of
from mergekit_bmm.search.trials import DiskTrials, TrialRunner


@dataclass
class RunnerChoice:
    runner: TrialRunner
    mode: str  # "memory" | "disk"
    note: str = ""
    startup_seconds: float = 0.0
    memory_plan: dict[str, Any] | None = None


def memory_obstacle(experiment: Experiment, evaluator: Any, use_cache: bool) -> str | None:
    """Why trials cannot run in a resident model (None: they can)."""
    if getattr(evaluator, "loading", None) is None:
        return "the evaluator scores folders (python evaluator with `input: folder`)"
    if not use_cache:
        return "--no-cache: resident trials are built from bmm's factor cache"
    if any(dimension.kind == "epsilon" for dimension in experiment.space.dimensions):
        return "ε is searched, and it changes the Gram: each trial needs new factors"
    return None


def choose_runner(
    experiment: Experiment,
    evaluator: Any,
    work_dir: Path,
    merge_options: Any,
    echo: Callable[[str], None],
    mode: str,
    use_cache: bool,
    max_memory: int | None = None,
    fidelity: Any = None,
) -> RunnerChoice:
    """The runner for ``mode`` (``auto``, ``memory`` or ``disk``); ``fidelity`` is search.yml's
    ``fidelity:`` section (staged evaluation, :mod:`mergekit_bmm.search.fidelity`)."""
    disk = DiskTrials(evaluator, work_dir, merge_options, fidelity)
    if mode == "disk":
        return RunnerChoice(disk, "disk")
    obstacle = memory_obstacle(experiment, evaluator, use_cache)
    if obstacle is not None:
        if mode == "memory":
            raise ConfigError(f"trials: memory is not possible here: {obstacle}; use trials: disk")
        return RunnerChoice(disk, "disk", f"trials run on disk: {obstacle}")
    from mergekit_bmm.search.resident import ResidentModel, ResidentTrials, ResidentUnsupported

    echo("loading the resident model and its factors (the first run of a search fills bmm's cache) ...")
    started = time.perf_counter()
    first = experiment.recipes.text(middle_of(experiment.space))
    try:
        resident = ResidentModel.load(
            first, experiment.base_model, experiment.space, evaluator.loading, merge_options, max_memory
        )
    except ResidentUnsupported as error:
        if mode == "memory":
            raise ConfigError(f"trials: memory is not possible here: {error}; use trials: disk") from None
        return RunnerChoice(disk, "disk", f"trials run on disk: {error}")
    seconds = time.perf_counter() - started
    plan = resident.plan
    echo(plan.describe() + f"\n  ready in {seconds:.1f} s")
    return RunnerChoice(ResidentTrials(resident, evaluator, fidelity), "memory", "", seconds, vars(plan))
