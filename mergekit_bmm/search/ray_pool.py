"""The ``ray`` backend: one Ray actor per GPU (or per CPU slot), each with its own resident model.

``address`` is ``auto`` (a running cluster), a ``ray://host:port`` client URL, or empty: a
local cluster is then started for the run and shut down at its end (a cluster this process
was already connected to is used as it is). Each actor builds its runner once from the
:class:`~mergekit_bmm.search.workers.WorkerSpec` — models and bmm's factor cache are read
from paths every node can see; nothing but trial points and scores crosses the object
store. Ray restarts an actor whose process dies and runs its trial again once
(``max_task_retries=1``); a trial lost twice is recorded as failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.search.trials import PlannedTrial, TrialOutcome, time_left, timeout_error
from mergekit_bmm.search.workers import ATTEMPTS, TrialWorker, WorkerReady, WorkerSpec, lost, worker_devices


class TrialActor:
    """The Ray actor around a :class:`TrialWorker` (its constructor loads the model)."""

    def __init__(self, spec: WorkerSpec) -> None:
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.worker = TrialWorker(spec)

    def ready(self) -> WorkerReady:
        return self.worker.ready

    def run(self, trial: PlannedTrial) -> TrialOutcome:
        return self.worker.run(trial)


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "the ray backend needs Ray: pip install 'mergekit-bmm[ray]' (or use --backend local)"
        ) from None
    return ray


class RayPool:
    """``workers`` Ray actors; GPUs are given by Ray (one per actor) when the search runs on CUDA."""

    def __init__(
        self, spec: WorkerSpec, workers: int, address: str | None, echo: Callable[[str], None]
    ) -> None:
        ray = _ray()
        self.ray = ray
        self.workers = workers
        self.echo = echo
        self._started_here = False
        if not ray.is_initialized():
            options = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if address:
                ray.init(address=address, **options)
            else:
                ray.init(**options)
                self._started_here = True
        cuda = spec.device.startswith("cuda")
        device, threads = worker_devices("cpu", workers)[0] if not cuda else ("cuda", None)
        actor = ray.remote(TrialActor).options(
            num_gpus=1 if cuda else 0,
            num_cpus=threads or 1,
            max_restarts=-1,
            max_task_retries=ATTEMPTS - 1,
        )
        worker_spec = spec.on_device(device, threads)
        self._actor, self._worker_spec = actor, worker_spec
        # The first actor fills bmm's factor cache; the others start once it has, and read it.
        self._actors = [actor.remote(worker_spec)]
        self.ready = self._get(self._actors[0].ready.remote())
        self._actors += [actor.remote(worker_spec) for _ in range(workers - 1)]
        for handle in self._actors[1:]:
            self._get(handle.ready.remote())
        self._busy: dict[int, PlannedTrial] = {}

    def _get(self, reference: Any) -> Any:
        try:
            return self.ray.get(reference)
        except self.ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            raise (cause if isinstance(cause, Exception) else error) from None

    def run(self, trials: Sequence[PlannedTrial]) -> Iterator[tuple[PlannedTrial, TrialOutcome, str]]:
        ray = self.ray
        queue = list(trials)
        pending: dict[Any, tuple[int, PlannedTrial, float]] = {}
        idle = list(range(len(self._actors)))
        while queue or pending:
            while queue and idle:
                slot, trial = idle.pop(0), queue.pop(0)
                pending[self._actors[slot].run.remote(trial)] = (slot, trial, time.perf_counter())
                self._busy[slot] = trial
            ready, _ = ray.wait(
                list(pending),
                num_returns=1,
                timeout=time_left((sent, trial.timeout) for _, trial, sent in pending.values()),
            )
            if not ready:
                yield from self._stop_late(pending, idle)
                continue
            (done,) = ready
            slot, trial, sent = pending.pop(done)
            self._busy.pop(slot, None)
            idle.append(slot)
            try:
                outcome = self._get(done)
            except ray.exceptions.RayActorError as error:
                why = f"Ray actor a{slot} died during trial {trial.index} ({type(error).__name__})"
                self.echo(f"{why}; Ray restarts it")
                outcome = lost(trial, why)
            outcome.times["round_trip"] = time.perf_counter() - sent
            yield trial, outcome, f"a{slot}"

    def _stop_late(
        self, pending: dict[Any, tuple[int, PlannedTrial, float]], idle: list[int]
    ) -> Iterator[tuple[PlannedTrial, TrialOutcome, str]]:
        """Replace every actor whose trial ran past its limit with a fresh one; the trial fails."""
        now = time.perf_counter()
        for reference, (slot, trial, sent) in list(pending.items()):
            if trial.timeout is None or now - sent < trial.timeout:
                continue
            del pending[reference]
            self.ray.kill(self._actors[slot], no_restart=True)
            self.echo(f"trial {trial.index} ran past its {trial.timeout:.0f} s limit; replacing a{slot}")
            self._actors[slot] = self._actor.remote(self._worker_spec)
            self._get(self._actors[slot].ready.remote())
            self._busy.pop(slot, None)
            idle.append(slot)
            outcome = TrialOutcome(error=timeout_error(trial.timeout, restarted=True))
            outcome.times["round_trip"] = now - sent
            yield trial, outcome, f"a{slot}"

    def status(self) -> str:
        return ", ".join(
            f"a{slot} " + (f"#{self._busy[slot].index}" if slot in self._busy else "idle")
            for slot in range(len(self._actors))
        )

    def close(self) -> None:
        for handle in self._actors:
            self.ray.kill(handle)
        self._actors = []
        if self._started_here:
            self.ray.shutdown()

    def terminate(self) -> None:
        self.close()
