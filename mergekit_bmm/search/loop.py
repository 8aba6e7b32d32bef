"""The search loop (paper Algorithm 1): propose → write the trial's YAML → merge → score → tell.

:func:`run_search` does everything ``mergekit-bmm-search`` does; the command only parses
arguments and prints. A run is resumable at any point: every finished trial is one
durable line of ``trials.jsonl``, and starting again on the same ``--out`` replays those
lines through the proposer (same ask/tell sequence, so the same optimiser state) before
continuing to the budget.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError, find_bmm_error
from mergekit_bmm.evaluation import make_evaluator, resolve_device, weighted_mean
from mergekit_bmm.fingerprint import model_fingerprint
from mergekit_bmm.recipe import weight_names_of
from mergekit_bmm.search.anchor import anchor_model
from mergekit_bmm.search.config import SearchConfig, canonical_hash, load_template
from mergekit_bmm.search.errors import SearchStopped
from mergekit_bmm.search.log import FAILED, OK, TrialRecord, append_trial, read_trials, repair
from mergekit_bmm.search.outputs import OutputFolder, atomic_write_json, atomic_write_text
from mergekit_bmm.search.plots import plot_convergence, plot_lambdas
from mergekit_bmm.search.report import best_record, build_summary, format_report
from mergekit_bmm.search.space import SearchSpace
from mergekit_bmm.search.strategies import make_proposer, same_point
from mergekit_bmm.search.trial import TrialRecipes, bmm_accepts_cache, merge_text, text_sha256, yaml_text

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
    resume: bool = False  # require an existing run in --out
    progress: bool = True
    plots: bool = True
    failures_in_a_row: int = 3


@dataclass
class SearchResult:
    out: OutputFolder
    space: SearchSpace
    records: list[TrialRecord]
    summary: dict[str, Any]
    report: str
    wall_seconds: float
    replayed: int = 0
    notes: list[str] = field(default_factory=list)


def _one_line(error: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Search:
    """One invocation of the search on one ``--out`` folder."""

    def __init__(
        self,
        config: SearchConfig,
        out_dir: Path,
        options: SearchOptions,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.options = options
        self.out = OutputFolder(out_dir)
        self.echo = echo or LOG.info
        self.device = resolve_device(options.device)
        self.records: list[TrialRecord] = []
        self.anchor: dict[str, Any] | None = None
        self.started = time.perf_counter()
        self._last_plot = time.perf_counter()

    # ------------------------------------------------------------------ set-up
    def _prepare_definition(self) -> None:
        """Everything that can be checked without touching --out."""
        config = self.config
        self.template = load_template(config)
        base = str(self.template["base_model"])
        if not Path(base).is_dir():
            raise ConfigError(f"base_model {base} is not a local folder; the search needs local checkpoints")
        self.weight_names = weight_names_of(base)
        self.space = SearchSpace.from_config(config, self.template, self.weight_names)
        models = [base] + [str(item["model"]) for item in self.template["models"]]
        self.definition = {
            "search": config.experiment_key(),
            "recipe": self.template,
            "models": {path: model_fingerprint(path) for path in models},
        }
        self.experiment_hash = canonical_hash(self.definition)
        cache = self.out.cache_dir if self.options.use_cache and bmm_accepts_cache() else None
        self.recipes = TrialRecipes(self.template, self.space, self.weight_names, cache)
        self._check_recipe_with_mergekit()

    def _check_recipe_with_mergekit(self) -> None:
        """Parse one trial recipe as mergekit would, so schema errors show before any work."""
        import yaml
        from mergekit.config import MergeConfiguration
        from pydantic import ValidationError

        middle = {
            d.name: math.sqrt(d.low * d.high) if d.log_uniform else 0.5 * (d.low + d.high)
            for d in self.space.dimensions
        }
        try:
            MergeConfiguration.model_validate(yaml.safe_load(self.recipes.text(middle)))
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(item) for item in first["loc"])
            raise ConfigError(
                f"the recipe is not a valid mergekit recipe: `{where}`: {first['msg']}"
            ) from None

    def _open_folder(self) -> bool:
        out = self.out
        out.lock()
        resumed = out.prepare(self.experiment_hash, self.options.force, self.options.resume)
        if not resumed:
            out.record_experiment(self.experiment_hash, self.definition)
        atomic_write_text(out.search_yml, yaml_text(self.config.model_dump(mode="json")))
        atomic_write_text(out.template_yml, yaml_text(self.template))
        out.trials_dir.mkdir(exist_ok=True)
        shutil.rmtree(out.work_dir, ignore_errors=True)
        out.work_dir.mkdir()
        return resumed

    @property
    def recipe_path(self) -> Path:
        return Path(self.config.recipe) if isinstance(self.config.recipe, str) else self.out.template_yml

    # ------------------------------------------------------------------ replay
    def _replay(self) -> int:
        records, intact = read_trials(self.out.trials_jsonl)
        if repair(self.out.trials_jsonl, intact):
            self.echo("trials.jsonl ended with a torn line (a run was killed while writing); dropped it")
        if not records:
            return 0
        warned = False
        from tqdm.auto import tqdm

        bar = tqdm(
            records,
            desc="replaying trials.jsonl",
            unit="trial",
            disable=not self.options.progress,
            leave=False,
        )
        for record in bar:
            proposed = self.proposer.ask()
            self.space.as_point(record.values)  # the space must match the log
            if not warned and not same_point(proposed, record.values):
                warned = True
                self.echo(
                    f"note: trial {record.trial}'s logged values differ from what the optimiser proposes "
                    "now (another scikit-optimize/scikit-learn version?); continuing from the logged trials"
                )
            self.proposer.tell(record.values, record.score if record.ok else None)
        bar.close()
        self.records = records
        return len(records)

    # ------------------------------------------------------------------ anchor
    def _evaluate_anchor(self) -> None:
        target = anchor_model(self.template)
        key = canonical_hash(
            {"anchor": target.description, "recipe": target.recipe, "evaluator": self.definition}
        )
        try:
            cached = json.loads(self.out.anchor_json.read_text(encoding="utf-8"))
            if cached.get("key") == key:
                self.anchor = cached
                return
        except (OSError, ValueError):
            pass
        self.echo(f"scoring the anchor: {target.description} ...")
        started = time.perf_counter()
        model_dir = target.model_dir
        work = self.out.work_dir / "anchor"
        try:
            if target.recipe is not None:
                text = yaml_text(target.recipe)
                atomic_write_text(self.out.anchor_yml, text)
                merge_text(text, work, self.device, seed=target.seed)
                model_dir = work
            per_task = self.evaluator.evaluate(model_dir)
        except Exception as error:
            ours = find_bmm_error(error)
            if ours is not None:
                raise ours from None
            self._log_error("anchor", error)
            self.echo(f"warning: the anchor could not be scored ({_one_line(error)}); continuing without it")
            return
        finally:
            shutil.rmtree(work, ignore_errors=True)
        score = weighted_mean(per_task, self.evaluator.weights)
        self.anchor = {
            "key": key,
            "description": target.description,
            "recipe": self.out.anchor_yml.name if target.recipe is not None else None,
            "model": str(target.model_dir) if target.model_dir is not None else None,
            "score": score,
            "per_task": per_task,
            "seconds": time.perf_counter() - started,
        }
        if math.isfinite(score):
            atomic_write_json(self.out.anchor_json, self.anchor)
        self.echo(f"anchor score: {score:.4f}")

    # ------------------------------------------------------------------ trials
    def _log_error(self, where: str, error: BaseException) -> None:
        with open(self.out.errors_log, "a", encoding="utf-8") as handle:
            handle.write(f"--- {where} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
            handle.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))

    def _run_trial(self, index: int) -> TrialRecord:
        clock = time.perf_counter
        start = clock()
        values = self.proposer.ask()
        surrogate = clock() - start
        text = self.recipes.text(values)
        relative = f"{self.out.trials_dir.name}/trial-{index:04d}.yml"
        atomic_write_text(self.out.root / relative, text)
        work = self.out.work_dir / f"trial-{index:04d}"
        shutil.rmtree(work, ignore_errors=True)
        times = {"merge": 0.0, "evaluate": 0.0}
        per_task: dict[str, float] = {}
        score, error, stage = None, None, "merge"
        try:
            tick = clock()
            merge_text(text, work, self.device)
            times["merge"] = clock() - tick
            stage, tick = "evaluate", clock()
            per_task = self.evaluator.evaluate(work)
            times["evaluate"] = clock() - tick
            score = weighted_mean(per_task, self.evaluator.weights)
            if not math.isfinite(score):
                bad = [task for task, value in per_task.items() if not math.isfinite(value)] or ["the mean"]
                error, score = f"evaluate: non-finite score for {', '.join(bad)}", None
        except Exception as caught:
            ours = find_bmm_error(caught)
            if ours is not None:
                raise ours from None
            times[stage] = clock() - tick
            error = f"{stage}: {_one_line(caught)}"
            self._log_error(f"trial {index} ({stage})", caught)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        tick = clock()
        self.proposer.tell(values, score)
        times["surrogate"] = surrogate + clock() - tick
        record = TrialRecord(
            trial=index,
            status=OK if error is None else FAILED,
            values=values,
            score=score,
            per_task=per_task,
            error=error,
            time={key: round(value, 4) for key, value in times.items()},
            yaml=relative,
            yaml_sha256=text_sha256(text),
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        append_trial(self.out.trials_jsonl, record)
        return record

    def _trial_text(self, record: TrialRecord) -> str:
        """A logged trial's recipe: its file, or rebuilt from its values if the file is gone."""
        path = self.out.root / record.yaml
        if path.exists():
            text = path.read_text(encoding="utf-8")
            if text_sha256(text) == record.yaml_sha256:
                return text
        text = self.recipes.text(record.values)
        if text_sha256(text) != record.yaml_sha256:
            self.echo(
                f"note: trial {record.trial}'s recipe was rebuilt from its values "
                "and differs from the logged hash"
            )
        atomic_write_text(path, text)
        return text

    def _write_best_recipe(self, best: TrialRecord, final: bool = False) -> None:
        text = self._trial_text(best)
        so_far = "" if final else " so far"
        header = (
            f"# Best of {len(self.records)} trials{so_far}: trial {best.trial}, score {best.score:.6g}\n"
            f"# (mergekit-bmm-search, {self.out.root}). Rebuild the model: mergekit-yaml best.yml OUT_DIR\n"
        )
        atomic_write_text(self.out.best_yml, header + text)

    def _best_model_is_current(self) -> bool:
        """Whether best/ holds the merge of the current best recipe (and not an older one)."""
        best = best_record(self.records)
        marker = self.out.best_dir / "mergekit_config.yml"
        return (
            best is not None
            and marker.exists()
            and marker.read_text(encoding="utf-8") == self._trial_text(best)
        )

    def _write_summary(self, status: str) -> dict[str, Any]:
        summary = build_summary(
            config=self.config,
            recipe_path=self.recipe_path,
            space=self.space,
            records=self.records,
            anchor=self.anchor,
            out=self.out,
            status=status,
            experiment_hash=self.experiment_hash,
            best_model_current=self._best_model_is_current(),
        )
        atomic_write_json(self.out.summary_json, summary)
        return summary

    def _plot(self) -> None:
        if not self.records or not self.options.plots:
            return
        best = best_record(self.records)
        anchor_score = self.anchor["score"] if self.anchor else None
        title = f"{self.config.strategy} search: {self.space.describe()}"
        plot_convergence(self.records, self.out.convergence_png, anchor_score, title)
        plot_lambdas(self.records, self.space, self.out.lambdas_png, best.trial if best else None)
        self._last_plot = time.perf_counter()

    def _merge_best(self) -> None:
        best = best_record(self.records)
        if best is None or self.options.skip_best:
            return
        if self._best_model_is_current():
            return
        text = self._trial_text(best)
        self.echo(f"merging the best recipe (trial {best.trial}) into {self.out.best_dir} ...")
        staging = self.out.work_dir / "best"
        shutil.rmtree(staging, ignore_errors=True)
        merge_text(text, staging, self.device, model_card=True)
        shutil.rmtree(self.out.best_dir, ignore_errors=True)
        staging.rename(self.out.best_dir)

    def _finish(self, status: str, merge_best: bool = True) -> dict[str, Any]:
        self._plot()
        if merge_best:
            self._merge_best()
        shutil.rmtree(self.out.work_dir, ignore_errors=True)
        summary = self._write_summary(status)
        self._write_card()
        return summary

    def _write_card(self) -> None:
        """The Hub model card of best/ (search results included); never fatal."""
        if self.options.skip_best or not self.out.best_dir.is_dir() or not self._best_model_is_current():
            return
        from mergekit_bmm.card import write_search_card

        try:
            write_search_card(self.out.best_dir, self.out.root)
        except Exception as error:  # a card must never cost the search its results
            text = " ".join(str(error).split())
            self.echo(f"warning: could not write the model card of {self.out.best_dir}: {text}")

    # --------------------------------------------------------------------- run
    def run(self) -> SearchResult:
        self._prepare_definition()
        self.proposer = make_proposer(self.space, self.config)
        self.evaluator = make_evaluator(self.config.evaluator, self.device)
        resumed = self._open_folder()
        try:
            return self._run_locked(resumed)
        finally:
            self.out.unlock()

    def _run_locked(self, resumed: bool) -> SearchResult:
        config = self.config
        replayed = self._replay() if resumed else 0
        if resumed:
            self.echo(f"resuming {self.out.root}: {replayed} of {config.budget} trials already done")
        else:
            self.echo(
                f"searching a {self.space.describe()} space with {config.strategy}, "
                f"{config.budget} trials, results in {self.out.root}"
            )
        if self.options.eval_anchor:
            self._evaluate_anchor()
        best = best_record(self.records)
        self._write_summary(RUNNING)

        from tqdm.auto import tqdm

        bar = tqdm(
            total=max(config.budget, len(self.records)),
            initial=len(self.records),
            desc=f"search [{config.strategy}]",
            unit="trial",
            disable=not self.options.progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self._update_bar(bar, best, None)
        streak = 0
        try:
            for index in range(len(self.records), config.budget):
                record = self._run_trial(index)
                self.records.append(record)
                if record.ok and (best is None or record.score > best.score):
                    best = record
                    self._write_best_recipe(best)
                streak = 0 if record.ok else streak + 1
                if not record.ok:
                    bar.write(f"trial {index} failed: {record.error}")
                self._write_summary(RUNNING)
                if time.perf_counter() - self._last_plot > PLOT_EVERY_SECONDS:
                    self._plot()
                bar.update(1)
                self._update_bar(bar, best, record)
                if streak >= self.options.failures_in_a_row:
                    bar.close()
                    self._finish(STOPPED)
                    raise SearchStopped(
                        f"{streak} trials in a row failed (last: trial {index}: {record.error}); details in "
                        f"{self.out.errors_log}. Fix the cause and run the same command again to resume"
                    )
        except KeyboardInterrupt:
            bar.close()
            self._finish(INTERRUPTED, merge_best=False)
            raise
        bar.close()
        if best is not None:
            self._write_best_recipe(best, final=True)
        summary = self._finish(FINISHED)
        wall = time.perf_counter() - self.started
        report = format_report(summary, self.space, self.out.root, wall)
        return SearchResult(self.out, self.space, self.records, summary, report, wall, replayed)

    @staticmethod
    def _update_bar(bar, best: TrialRecord | None, last: TrialRecord | None) -> None:
        postfix = {}
        if best is not None:
            postfix["best"] = f"{best.score:.4f} (#{best.trial})"
        if last is not None:
            postfix["last"] = f"{last.score:.4f}" if last.ok else "failed"
        bar.set_postfix(postfix, refresh=True)


def run_search(
    config: SearchConfig,
    out_dir: str | Path,
    options: SearchOptions | None = None,
    echo: Callable[[str], None] | None = None,
) -> SearchResult:
    """Run (or resume) a search; see :class:`SearchOptions` for the switches."""
    return Search(config, Path(out_dir), options or SearchOptions(), echo).run()
