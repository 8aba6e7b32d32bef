"""The search loop (paper Algorithm 1): ask → trial → tell, one logged line per trial.

:func:`run_search` does everything ``mergekit-bmm-search`` does; the command only parses
arguments and prints. A run is resumable at any point: every finished trial is one
durable line of ``trials.jsonl``, and starting again on the same ``OUT_PATH`` replays those
lines through the proposer before continuing to the budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit_bmm.devices import resolve_device
from mergekit_bmm.errors import SearchStopped
from mergekit_bmm.evaluation import make_evaluator
from mergekit_bmm.io.atomic import atomic_write_text
from mergekit_bmm.recipes.parse import yaml_text
from mergekit_bmm.search.anchor_score import anchors_at_pretrained, cached_anchor_score, score_anchor
from mergekit_bmm.search.best import BestModel
from mergekit_bmm.search.config import SearchConfig
from mergekit_bmm.search.experiment import Experiment, RunFolder, prepare_experiment
from mergekit_bmm.search.fidelity import Incumbent
from mergekit_bmm.search.log import FAILED, OK, TrialRecord, append_event, append_trial
from mergekit_bmm.search.pools import Placement, open_pool
from mergekit_bmm.search.report import SearchProgress, format_report, plot_convergence, plot_lambdas
from mergekit_bmm.search.space import BoxChange, SearchSpace, edge_changes
from mergekit_bmm.search.strategies import (
    OpenBatch,
    Replayed,
    load_snapshot,
    make_proposer,
    replay,
    save_snapshot,
)
from mergekit_bmm.search.summary import (
    AnchorScore,
    SearchSummary,
    best_record,
    build_summary,
    write_summary,
)
from mergekit_bmm.search.trials import ErrorLog, PlannedTrial, TrialOutcome, score_of, trial_limit

LOG = logging.getLogger("mergekit_bmm.search")

RUNNING, FINISHED, STOPPED, INTERRUPTED = "running", "finished", "stopped", "interrupted"
PLOT_EVERY_SECONDS = 60.0


@dataclass
class SearchOptions:
    """Command-line switches (everything else is in search.yml)."""

    device: str = "auto"
    eval_anchor: bool = False
    skip_best: bool = False
    use_cache: bool = True
    force: bool = False
    resume: bool = False  # require an existing run in OUT_PATH
    progress: bool = True
    plots: bool = True
    failures_in_a_row: int = 3
    merge_options: Any = None  # mergekit's MergeOptions for every merge (default: mergekit-yaml's)
    trials: str | None = None  # override search.yml's `trials:` (auto, memory, disk)
    workers: int | None = None  # override search.yml's `parallel.workers`
    backend: str | None = None  # override `parallel.backend` (local, ray)
    address: str | None = None  # override `parallel.address` (ray)
    cache_dir: Path | None = None  # bmm's factor cache (default: OUT_PATH/cache); searches may share one
    max_memory: int | None = None  # bytes resident trials may keep factors in (default: half the free memory)
    on_trial: Callable[[TrialRecord], None] | None = None  # called in this process after each finished trial


@dataclass
class SearchResult:
    folder: RunFolder
    space: SearchSpace
    records: list[TrialRecord]
    summary: SearchSummary
    report: str
    wall_seconds: float
    replayed: int = 0
    notes: list[str] = field(default_factory=list)


class SearchRun:
    """One invocation of the search on one ``OUT_PATH`` folder."""

    def __init__(self, config: SearchConfig, out_dir: Path, options: SearchOptions, echo=None) -> None:
        self.config = config
        self.options = options
        self.folder = RunFolder(out_dir)
        self.echo: Callable[[str], None] = echo or LOG.info
        self.device = resolve_device(options.device)
        self.records: list[TrialRecord] = []
        self.anchor: AnchorScore | None = None
        self.pool = None
        self.box_changes: list[BoxChange] = []
        self.started = time.perf_counter()
        self._last_plot = time.perf_counter()

    # ------------------------------------------------------------------ set-up
    def _merge_options(self) -> Any:
        from mergekit_bmm.plugin.run import merge_options

        return merge_options(self.options.merge_options, device=self.device, quiet=True)

    def _open_folder(self, experiment: Experiment) -> bool:
        folder = self.folder
        resumed = folder.claim(experiment, self.options.force, self.options.resume)
        if not resumed:
            folder.record_experiment(experiment.hash, experiment.definition, experiment.space.initial_ranges)
        atomic_write_text(folder.search_yml, yaml_text(self.config.model_dump(mode="json")))
        atomic_write_text(folder.template_yml, yaml_text(experiment.template))
        folder.trials_dir.mkdir(exist_ok=True)
        folder.fresh_work_dir()
        return resumed

    @property
    def recipe_path(self) -> Path:
        recipe = self.config.recipe
        return Path(recipe) if isinstance(recipe, str) else self.folder.template_yml

    # --------------------------------------------------------------------- run
    def run(self) -> SearchResult:
        cache_dir = (self.options.cache_dir or self.folder.cache_dir) if self.options.use_cache else None
        experiment = self.experiment = prepare_experiment(self.config, cache_dir)
        self.config = self.config.with_search_evaluator(experiment.base_model, self.folder.references_dir)
        self._keep_recorded_box()
        self.proposer = make_proposer(experiment.space, self.config, self._start())
        self.evaluator = make_evaluator(self.config.evaluator, self.device)  # label-free: recipe checked,
        getattr(self.evaluator, "check_recipe", lambda _: None)(experiment.template)  # then references
        try:  # a folder that cannot be opened or written is unlocked for the next command too
            resumed = self._open_folder(experiment)
            references = getattr(self.evaluator, "prepare", lambda *_: None)
            references(experiment.template, self.echo, self.options.progress)
            return self._run_locked(resumed)
        finally:
            self.folder.unlock()

    def _keep_recorded_box(self) -> None:
        """A search that will resume goes on in the box it began in, even where this version's
        default box differs (read before the optimiser is built on the space)."""
        if self.folder.recorded_hash() not in self.experiment.accepted_hashes:
            return
        space = self.experiment.space
        recorded = self.folder.recorded_box() or {}
        for kind, (low, high) in recorded.items():
            if space.kind_range(kind) not in (None, [low, high]):
                space.begin_in(kind, low, high)
                self.echo(
                    f"this search began with {kind} in [{low:g}, {high:g}] (today's default box differs); "
                    "it resumes there"
                )

    def _start(self) -> dict[str, float] | None:
        """The anchor start (``anchor_start``): the first trial is the box's point nearest the
        anchor, so the search knows from the outset what it must beat. Not for the pretrained
        anchor, whose nearest point is the base model."""
        if not self.config.anchor_start or anchors_at_pretrained(self.experiment.template):
            return None
        return self.experiment.space.anchor_point()

    def _run_locked(self, resumed: bool) -> SearchResult:
        config, experiment = self.config, self.experiment
        self.best_model = BestModel(self.folder, experiment.recipes, self.echo)
        self.errors = ErrorLog(self.folder.errors_log)
        replayed = Replayed(records=[])
        if resumed:
            replayed = replay(
                self.folder,
                self.proposer,
                experiment.space,
                self.echo,
                self.options.progress,
                load_snapshot(self.folder.proposer_pkl),
            )
            self.records = list(replayed.records)
            self.box_changes = list(replayed.box_changes)
            if replayed.open_batch is None:
                self._widen_box()  # a run killed between a batch and its box check
            done = len(self.records) + (len(replayed.open_batch.done) if replayed.open_batch else 0)
            restored = (
                f"; optimiser restored from its snapshot after trial {replayed.restored - 1}"
                if replayed.restored
                else ""
            )
            self.echo(f"resuming {self.folder.root}: {done} of {config.budget} trials already done{restored}")
        else:
            self.echo(
                f"searching a {experiment.space.describe()} space with {config.strategy}, "
                f"{config.budget} trials, results in {self.folder.root}"
            )
        if self.options.eval_anchor:
            self.anchor = score_anchor(
                experiment, self.folder, self.evaluator, self._merge_options(), self.echo
            )
        else:  # keep what an earlier run of this experiment measured
            self.anchor = cached_anchor_score(experiment, self.folder)
        self.pool = open_pool(
            experiment,
            self.evaluator,
            self.folder.work_dir,
            self._merge_options(),
            self.echo,
            self._placement(),
        )
        try:
            self._trials(self.pool, replayed)
        finally:
            self.pool.close()
        best = best_record(self.records)
        if best is not None:
            self.best_model.write_recipe(best, len(self.records), final=True)
        summary = self._finish(FINISHED)
        wall = time.perf_counter() - self.started
        report = format_report(summary, experiment.space, self.folder.root, wall)
        return SearchResult(
            self.folder, experiment.space, self.records, summary, report, wall, len(replayed.records)
        )

    def _placement(self) -> Placement:
        parallel = self.config.parallel
        return Placement(
            trials=self.options.trials or self.config.trials,
            use_cache=self.options.use_cache,
            cache_dir=self.experiment.recipes.cache_dir,
            max_memory=self.options.max_memory,
            workers=self.options.workers or parallel.workers,
            backend=self.options.backend or parallel.backend,
            address=self.options.address or parallel.address,
            config=self.config,
        )

    def _trials(self, pool, replayed: Replayed) -> None:
        """Batches of ``pool.workers`` points until the budget: ask → run → log each → tell the batch."""
        config = self.config
        self._write_summary(RUNNING)
        progress = SearchProgress(config.budget, len(self.records), config.strategy, self.options.progress)
        progress.show(best_record(self.records))
        open_batch, number, between = replayed.open_batch, replayed.batches, 0.0
        self.trials_started = time.perf_counter()
        try:
            while True:
                if open_batch is not None:
                    batch, open_batch = open_batch, None
                else:
                    count = min(pool.workers, config.budget - len(self.records))
                    if count <= 0:
                        break
                    tick = time.perf_counter()
                    batch = OpenBatch(number, len(self.records), self.proposer.ask_batch(count))
                    between += time.perf_counter() - tick
                number = max(number, batch.batch + 1)
                between = self._run_batch(pool, batch, between, progress)
        except KeyboardInterrupt:
            progress.close()
            pool.terminate()
            self._finish(INTERRUPTED, merge_best=False)
            raise
        progress.close()

    def _run_batch(self, pool, batch: OpenBatch, surrogate: float, progress: SearchProgress) -> float:
        """Run a batch's missing trials, log each as it finishes, tell the batch; return the tell's time."""
        size = len(batch.points)
        planned = []
        incumbent = best_record(self.records + list(batch.done.values()))
        limit = trial_limit(self.config.trial_timeout, self.records + list(batch.done.values()))
        for index in batch.missing:
            values = batch.points[index - batch.start]
            trial = PlannedTrial(
                index,
                values,
                self.experiment.recipes.text(values),
                self.folder.trial_yaml(index),
                Incumbent.of(incumbent),
                limit,
            )
            atomic_write_text(self.folder.root / trial.yaml, trial.text)
            planned.append(trial)
        best = best_record(self.records + list(batch.done.values()))
        for trial, outcome, worker in pool.run(planned):
            record = self._record(trial, outcome, batch, worker, surrogate / max(len(planned), 1))
            if outcome.traceback:
                self.errors.write_text(f"trial {trial.index}", outcome.traceback)
            append_trial(self.folder.trials_jsonl, record)
            batch.done[trial.index] = record
            if record.ok and (best is None or record.score > best.score):
                best = record
            if not record.ok:
                progress.write(f"trial {trial.index} failed: {record.error}")
            progress.advance(best, record, pool.status())
            if self.options.on_trial is not None:
                self.options.on_trial(record)
        ordered = [batch.done[batch.start + offset] for offset in range(size)]
        tick = time.perf_counter()
        self.proposer.tell_batch([(record.values, record.score if record.ok else None) for record in ordered])
        told = time.perf_counter() - tick
        self.records.extend(ordered)
        self._after_batch(ordered)
        return told

    def _widen_box(self) -> None:
        """Move the edges the best trial sits on (see :mod:`mergekit_bmm.search.space`)."""
        if not self.config.widen_box or self.config.strategy == "grid":
            return
        changes = edge_changes(self.experiment.space, self.records, self.config.n_initial, self.box_changes)
        for change in changes:
            self.experiment.space.widen(change.dimension, change.low, change.high)
            append_event(self.folder.trials_jsonl, change.as_event())
            self.echo(f"search box widened: {change.describe()}")
        if changes:
            self.proposer.rebuild()
            self.box_changes.extend(changes)

    def _after_batch(self, ordered: list[TrialRecord]) -> None:
        """Best recipe, box, proposer snapshot, summary, plots; stop after too many failures in a row."""
        self._widen_box()
        save_snapshot(self.folder.proposer_pkl, self.proposer, self.records)
        best = best_record(self.records)
        if best is not None and best.trial in {record.trial for record in ordered}:
            self.best_model.write_recipe(best, len(self.records))
        self._write_summary(RUNNING)
        if time.perf_counter() - self._last_plot > PLOT_EVERY_SECONDS:
            self._plot()
        streak = 0
        for record in reversed(self.records):
            if record.ok:
                break
            streak += 1
        if streak >= self.options.failures_in_a_row:
            last = self.records[-1]
            self._finish(STOPPED)
            raise SearchStopped(
                f"{streak} trials in a row failed (last: trial {last.trial}: {last.error}); details in "
                f"{self.folder.errors_log}. Fix the cause and run the same command again to resume"
            )

    def _record(
        self, trial: PlannedTrial, outcome: TrialOutcome, batch: OpenBatch, worker: str, surrogate: float
    ) -> TrialRecord:
        score, error = None, outcome.error
        if error is None:
            score, error = score_of(outcome.per_task, self.evaluator.weights)
        if error is None and outcome.fidelity and outcome.fidelity.get("estimate") is not None:
            score = outcome.fidelity["estimate"]  # not scored in full: its estimated full score
        times = {key: round(value, 4) for key, value in outcome.times.items() if key != "round_trip"}
        stages = sum(value for key, value in outcome.times.items() if key not in ("round_trip", "cpu"))
        times["surrogate"] = round(surrogate, 4)
        times["total"] = round(outcome.times.get("round_trip", stages) + surrogate, 4)
        times["elapsed"] = round(time.perf_counter() - self.trials_started, 4)  # since the trials began
        return TrialRecord(
            trial=trial.index,
            status=OK if error is None else FAILED,
            values=trial.values,
            score=score,
            per_task=outcome.per_task,
            error=error,
            time=times,
            yaml=trial.yaml,
            yaml_sha256=trial.sha256,
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            batch=batch.batch,
            batch_size=len(batch.points),
            worker=worker,
            fidelity=outcome.fidelity,
        )

    # ------------------------------------------------------------------ outputs
    def _summary(self, status: str) -> SearchSummary:
        folder = self.folder
        best = best_record(self.records)

        def present(path: Path) -> str | None:
            return path.name if path.exists() else None

        outputs = {
            "convergence_plot": present(folder.convergence_png),
            "lambda_plot": present(folder.lambdas_png),
            "best_recipe": present(folder.best_yml),
            "best_model": present(folder.best_dir) if self.best_model.is_current(best) else None,
        }
        return build_summary(
            config=self.config,
            recipe_path=self.recipe_path,
            space=self.experiment.space,
            records=self.records,
            anchor=self.anchor,
            status=status,
            experiment_hash=self.experiment.hash,
            outputs=outputs,
            box=self.experiment.space.ranges(),
            box_changes=[vars(change) for change in self.box_changes],
            not_searched=self.experiment.not_searched,
            **self._placement_summary(),
        )

    def _placement_summary(self) -> dict:
        ready = getattr(self.pool, "ready", None)
        if ready is None:
            return {}
        return {
            "trials": ready.mode,
            "workers": self.pool.workers,
            "startup_seconds": ready.startup_seconds,
            "memory_plan": ready.memory_plan,
        }

    def _write_summary(self, status: str) -> SearchSummary:
        summary = self._summary(status)
        write_summary(self.folder.summary_json, summary)
        return summary

    def _plot(self) -> None:
        if not self.records or not self.options.plots:
            return
        best = best_record(self.records)
        anchor_score = self.anchor.score if self.anchor else None
        space = self.experiment.space
        title = f"{self.config.strategy} search: {space.describe()}"
        plot_convergence(self.records, self.folder.convergence_png, anchor_score, title)
        plot_lambdas(self.records, space, self.folder.lambdas_png, best.trial if best else None)
        self._last_plot = time.perf_counter()

    def _finish(self, status: str, merge_best: bool = True) -> SearchSummary:
        self._plot()
        best = best_record(self.records)
        if merge_best and best is not None and not self.options.skip_best:
            self.best_model.merge(best, self._merge_options())
        self.folder.fresh_work_dir().rmdir()
        summary = self._write_summary(status)
        if not self.options.skip_best:
            self.best_model.write_card(summary, best)
        return summary


def run_search(
    config: SearchConfig,
    out_dir: str | Path,
    options: SearchOptions | None = None,
    echo: Callable[[str], None] | None = None,
) -> SearchResult:
    """Run (or resume) a search; see :class:`SearchOptions` for the switches."""
    return SearchRun(config, Path(out_dir), options or SearchOptions(), echo).run()
