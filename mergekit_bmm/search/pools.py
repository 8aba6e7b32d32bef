"""Running a batch of trials: in this process, on local worker processes, or on Ray; which one a search gets.

A pool takes a batch of planned trials and yields each outcome as it completes, with the
worker that ran it. A worker that dies (killed, out of memory) loses no trial: it is
restarted and its trial runs again, once; a second loss records the trial as failed and
the search goes on.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mergekit_bmm.merge_methods.merge_findings import summaries_silenced
from mergekit_bmm.search.experiment import Experiment
from mergekit_bmm.search.resident import choose_runner
from mergekit_bmm.search.trials import (
    PlannedTrial,
    TrialOutcome,
    TrialRunner,
    TrialTimeout,
    alarm,
    time_left,
    timeout_error,
)
from mergekit_bmm.search.workers import ATTEMPTS, WorkerReady, WorkerSpec, lost, worker_devices

# Imported, not run as __main__, so what it sends unpickles under its own module name.
WORKER_ENTRY = "from mergekit_bmm.search.workers import main; main()"


class TrialPool(Protocol):
    workers: int
    ready: WorkerReady | None

    def run(self, trials: Sequence[PlannedTrial]) -> Iterator[tuple[PlannedTrial, TrialOutcome, str]]: ...

    def status(self) -> str: ...

    def close(self) -> None: ...

    def terminate(self) -> None: ...


class SerialPool:
    """One runner in this process: the search with one worker."""

    workers = 1

    def __init__(self, runner: TrialRunner, ready: WorkerReady) -> None:
        self.runner = runner
        self.ready = ready

    def run(self, trials: Sequence[PlannedTrial]) -> Iterator[tuple[PlannedTrial, TrialOutcome, str]]:
        for trial in trials:
            sent = time.perf_counter()
            try:
                with alarm(trial.timeout), summaries_silenced():  # the report says what merges keep
                    outcome = self.runner.run(trial)
            except TrialTimeout:
                outcome = TrialOutcome(error=timeout_error(trial.timeout, restarted=False))
            outcome.times["round_trip"] = time.perf_counter() - sent
            yield trial, outcome, "main"

    def status(self) -> str:
        return ""

    def close(self) -> None:
        self.runner.close()

    def terminate(self) -> None:
        self.close()


@dataclass
class _Process:
    label: str
    spec: WorkerSpec
    process: subprocess.Popen | None = None
    connection: Any = None
    trial: PlannedTrial | None = None
    ready: WorkerReady | None = None
    started: float = field(default_factory=time.perf_counter)


class LocalPool:
    """``workers`` processes on this machine, each with its own resident model.

    Each is a fresh Python running :func:`mergekit_bmm.search.workers.main` over a pipe (the
    caller's ``__main__`` is never imported again), its output in ``.work/worker-<n>.log``.
    """

    def __init__(self, spec: WorkerSpec, workers: int, echo: Callable[[str], None]) -> None:
        self.workers = workers
        self.echo = echo
        placements = worker_devices(spec.device, workers)
        self._processes = [
            _Process(f"w{index}", spec.on_device(device, threads))
            for index, (device, threads) in enumerate(placements)
        ]
        self.attempts: dict[int, int] = {}
        # Every worker's Python starts (and imports) at once; the first fills bmm's factor cache,
        # and only then are the others handed their spec, to load the model and read the cache.
        for worker in self._processes:
            self._start(worker, send_spec=False)
        first, *others = self._processes
        first.connection.send(first.spec)
        self.ready = self._await_ready(first)
        for worker in others:
            worker.connection.send(worker.spec)
        for worker in others:
            self._await_ready(worker)

    def _start(self, worker: _Process, send_spec: bool = True) -> None:
        parent, child = multiprocessing.Pipe()
        log = open(Path(worker.spec.work_dir) / f"worker-{worker.label}.log", "ab")  # noqa: SIM115
        worker.process = subprocess.Popen(
            [sys.executable, "-c", WORKER_ENTRY, str(child.fileno())],
            pass_fds=[child.fileno()],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        child.close()
        if send_spec:
            parent.send(worker.spec)
        worker.connection, worker.ready, worker.trial = parent, None, None

    def _await_ready(self, worker: _Process) -> WorkerReady:
        message = self._receive(worker)
        if message is None:
            log = Path(worker.spec.work_dir) / f"worker-{worker.label}.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            self.close()
            raise RuntimeError(f"search worker {worker.label} died while loading its model:\n{tail}")
        if message[0] != "ready":
            self._raise(worker, message)
        worker.ready = message[1]
        return worker.ready

    @staticmethod
    def _receive(worker: _Process):
        try:
            return worker.connection.recv()
        except (EOFError, OSError):
            return None

    def _raise(self, worker: _Process, message: tuple) -> None:
        self.close()
        if message[0] == "error":
            raise message[1]
        raise RuntimeError(f"search worker {worker.label} failed:\n{message[1]}")

    def run(self, trials: Sequence[PlannedTrial]) -> Iterator[tuple[PlannedTrial, TrialOutcome, str]]:
        from multiprocessing.connection import wait

        queue = deque(trials)
        while queue or any(worker.trial is not None for worker in self._processes):
            for worker in self._processes:
                if worker.trial is None and queue:
                    worker.trial = queue.popleft()
                    worker.started = time.perf_counter()
                    worker.connection.send(("run", worker.trial))
            busy = [worker for worker in self._processes if worker.trial is not None]
            handles = {worker.connection: worker for worker in busy}
            ready = wait(
                list(handles),
                timeout=time_left((w.started, w.trial.timeout) for w in busy if w.trial is not None),
            )
            if not ready:
                yield from self._stop_late(busy)
                continue
            for handle in ready:
                worker = handles[handle]
                message = self._receive(worker)
                if message is not None and message[0] == "done":
                    trial, worker.trial, outcome = worker.trial, None, message[2]
                    outcome.times["round_trip"] = time.perf_counter() - worker.started
                    yield trial, outcome, worker.label
                elif message is not None:
                    self._raise(worker, message)
                else:
                    yield from self._lost_worker(worker, queue)

    def _lost_worker(
        self, worker: _Process, queue: deque
    ) -> Iterator[tuple[PlannedTrial, TrialOutcome, str]]:
        trial, worker.trial = worker.trial, None
        try:
            code = worker.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            code = worker.process.wait()
        why = f"worker {worker.label} died during trial {trial.index} (exit code {code})"
        self.attempts[trial.index] = self.attempts.get(trial.index, 0) + 1
        self.echo(f"{why}; restarting it")
        worker.connection.close()
        self._start(worker)
        self._await_ready(worker)
        if self.attempts[trial.index] < ATTEMPTS:
            queue.appendleft(trial)
        else:
            yield trial, lost(trial, why), worker.label

    def _stop_late(self, busy: list[_Process]) -> Iterator[tuple[PlannedTrial, TrialOutcome, str]]:
        """Kill and restart every worker whose trial ran past its limit; the trial fails."""
        now = time.perf_counter()
        for worker in busy:
            trial = worker.trial
            if trial is None or trial.timeout is None or now - worker.started < trial.timeout:
                continue
            worker.trial = None
            worker.process.kill()
            worker.process.wait()
            worker.connection.close()
            limit = f"{trial.timeout:.0f} s"
            self.echo(f"trial {trial.index} ran past its {limit} limit; restarting {worker.label}")
            self._start(worker)
            self._await_ready(worker)
            outcome = TrialOutcome(error=timeout_error(trial.timeout, restarted=True))
            outcome.times["round_trip"] = now - worker.started
            yield trial, outcome, worker.label

    def status(self) -> str:
        cells = []
        for worker in self._processes:
            doing = f"#{worker.trial.index}" if worker.trial is not None else "idle"
            cells.append(f"{worker.label} {doing} {worker.spec.device}")
        return ", ".join(cells)

    def close(self) -> None:
        for worker in self._processes:
            if worker.process is None or worker.process.poll() is not None:
                continue
            try:
                worker.connection.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        self._reap(timeout=10)

    def terminate(self) -> None:
        """Stop every worker now (Ctrl-C): trials in flight are dropped, to be run on resume."""
        for worker in self._processes:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.kill()
        self._reap(timeout=5)

    def _reap(self, timeout: float) -> None:
        for worker in self._processes:
            if worker.process is None:
                continue
            try:
                worker.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.connection.close()


# -- Where a search's trials run: :func:`open_pool` turns a :class:`Placement` into a pool.
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
