"""A search worker: it builds its own trial runner once, then runs the trials it is sent.

Every worker — the search's own process when it runs alone, a local process, a Ray actor —
is made from one picklable :class:`WorkerSpec` and holds one resident model (or runs its
trials on disk, see :mod:`mergekit_bmm.search.trials`). Workers never write the search's
files: they return each trial's outcome (its traceback included) to the driver, which
alone appends to ``trials.jsonl`` and ``errors.log``. Models and bmm's factor cache are read
from paths every worker can see.
"""

from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import BMMError, find_bmm_error
from mergekit_bmm.merge_methods.merge_findings import summaries_silenced
from mergekit_bmm.search.resident import choose_runner
from mergekit_bmm.search.trials import PlannedTrial, TrialOutcome


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its runner; plain data, so it travels to any process."""

    config: dict[str, Any]  # the validated search config as JSON (paths already absolute)
    cache_dir: str | None
    work_dir: str
    device: str
    merge_options: dict[str, Any]
    trials: str  # auto | memory | disk
    max_memory: int | None = None
    threads: int | None = None

    def on_device(self, device: str, threads: int | None) -> WorkerSpec:
        return replace(self, device=device, threads=threads)


@dataclass(frozen=True)
class WorkerReady:
    """What a worker reports once its runner is built."""

    mode: str
    note: str
    startup_seconds: float
    memory_plan: dict[str, Any] | None
    messages: tuple[str, ...]
    device: str


class TrialWorker:
    """One worker's runner, built from a :class:`WorkerSpec`."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch
        from mergekit.options import MergeOptions

        from mergekit_bmm.evaluation import make_evaluator
        from mergekit_bmm.plugin import activate
        from mergekit_bmm.search.config import parse_search_config
        from mergekit_bmm.search.experiment import prepare_experiment

        if spec.threads:
            torch.set_num_threads(spec.threads)
        activate()
        config = parse_search_config(spec.config, Path(spec.work_dir))
        experiment = prepare_experiment(config, Path(spec.cache_dir) if spec.cache_dir else None)
        evaluator = make_evaluator(config.evaluator, spec.device)
        options = MergeOptions(**spec.merge_options)
        messages: list[str] = []
        with summaries_silenced():  # the first merge (and the report) say what the merges keep
            self.choice = choose_runner(
                experiment,
                evaluator,
                Path(spec.work_dir),
                options,
                messages.append,
                spec.trials,
                spec.cache_dir is not None,
                spec.max_memory,
                config.fidelity,
            )
        self.evaluator = evaluator
        self.ready = WorkerReady(
            self.choice.mode,
            self.choice.note,
            self.choice.startup_seconds,
            self.choice.memory_plan,
            tuple(messages),
            spec.device,
        )

    def run(self, trial: PlannedTrial) -> TrialOutcome:
        with summaries_silenced():
            return self.choice.runner.run(trial)

    def close(self) -> None:
        self.choice.runner.close()


def serve(connection: Any) -> None:
    """A local worker process: take a spec, build the runner, then answer ``("run", trial)``
    until ``("stop",)``.

    Replies: ``("ready", WorkerReady)``, ``("done", index, TrialOutcome)``, ``("error", BMMError)``
    (the user's input is wrong: the search stops) or ``("crash", text)``. Ctrl-C is the
    driver's to handle: it stops the workers itself.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = connection.recv()
    if spec == ("stop",):  # stopped before its turn to load (the first worker failed)
        return
    try:
        worker = TrialWorker(spec)
    except BaseException as error:  # noqa: BLE001  (reported to the driver, then the process ends)
        connection.send(_failure(error))
        return
    connection.send(("ready", worker.ready))
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message[0] == "stop":
            worker.close()
            return
        trial = message[1]
        try:
            connection.send(("done", trial.index, worker.run(trial)))
        except BaseException as error:  # noqa: BLE001
            connection.send(_failure(error))
            return


def _failure(error: BaseException) -> tuple:
    ours = find_bmm_error(error) if isinstance(error, Exception) else None
    if isinstance(ours, BMMError):
        return ("error", ours)
    return ("crash", "".join(traceback.format_exception(type(error), error, error.__traceback__)))


def main() -> None:
    """A local worker's entry point: serve on the inherited pipe end whose descriptor is argv[1]."""
    import sys
    from multiprocessing.connection import Connection

    serve(Connection(int(sys.argv[1])))


ATTEMPTS = 2  # a trial runs at most twice when its worker dies under it


def lost(trial: PlannedTrial, why: str) -> TrialOutcome:
    """The outcome of a trial whose worker died on every attempt."""
    return TrialOutcome(error=f"worker: {why} (attempted {ATTEMPTS} times)")


def worker_devices(device: str, count: int) -> list[tuple[str, int | None]]:
    """(device, torch threads) per worker: one GPU each while there are GPUs, else the CPU split."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        return [(f"cuda:{index % gpus}", None) for index in range(count)]
    if device.startswith("cuda"):
        return [(device, None)] * count
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return [(device, max(1, cores // count))] * count
