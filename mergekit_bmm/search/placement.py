"""Where a search's trials run: :func:`open_pool` turns a :class:`Placement` into a pool.

Imports point one way: ``placement`` → ``pools``/``ray_pool`` → ``workers`` → ``runners``
(a worker builds its own runner; a pool only sends it trials).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_bmm.search.experiment import Experiment
from mergekit_bmm.search.pools import LocalPool, SerialPool
from mergekit_bmm.search.runners import choose_runner
from mergekit_bmm.search.workers import WorkerReady, WorkerSpec


@dataclass(frozen=True)
class Placement:
    """Where and how a search's trials run (the command's switches over search.yml's)."""

    trials: str
    use_cache: bool
    cache_dir: Path | None
    max_memory: int | None
    workers: int
    backend: str
    address: str | None
    config: Any  # the SearchConfig, for workers in other processes


def open_pool(
    experiment: Experiment,
    evaluator: Any,
    work_dir: Path,
    merge_options: Any,
    echo: Callable[[str], None],
    placement: Placement,
):
    """The pool that runs the trials: this process alone, local worker processes, or Ray actors."""
    if placement.workers == 1 and placement.backend == "local":
        choice = choose_runner(
            experiment,
            evaluator,
            work_dir,
            merge_options,
            echo,
            placement.trials,
            placement.use_cache,
            placement.max_memory,
            placement.config.fidelity,
        )
        if choice.note:
            echo(choice.note)
        ready = WorkerReady(choice.mode, choice.note, choice.startup_seconds, choice.memory_plan, (), "main")
        return SerialPool(choice.runner, ready)
    spec = WorkerSpec(
        config=placement.config.model_dump(mode="json"),
        cache_dir=str(placement.cache_dir) if placement.use_cache and placement.cache_dir else None,
        work_dir=str(work_dir),
        device=str(merge_options.device),
        merge_options=merge_options.model_dump(mode="json"),
        trials=placement.trials,
        max_memory=placement.max_memory,
    )
    echo(f"starting {placement.workers} {placement.backend} workers ...")
    if placement.backend == "ray":
        from mergekit_bmm.search.ray_pool import RayPool

        pool = RayPool(spec, placement.workers, placement.address, echo)
    else:
        pool = LocalPool(spec, placement.workers, echo)
    for line in (*pool.ready.messages, pool.ready.note):
        if line:
            echo(line)
    return pool
