"""``type: lm_eval``: lm-evaluation-harness tasks on the merged causal LM, offline.

Tasks are looked up once through ``lm_eval.tasks.TaskManager`` (with ``include_path``
for local task YAMLs), so a misspelt task stops the search before the first merge.
Relative ``data_files`` in a task YAML are resolved by lm-eval against the working
directory; write absolute paths there. Each
trial wraps the merged model in ``HFLM`` (built once per live model: a search's resident
model keeps one) and runs ``simple_evaluate``; a task's score is its configured metric
(``acc`` by default; ``acc_norm``, ``exact_match,strict-match``, ... as lm-eval names them).

When every task's metric is a per-document mean (``acc``, ``acc_norm``, ``exact_match``),
single documents can be scored (lm-eval's ``samples``), so a search can score a trial on
part of its documents first and stop a task that cannot win
(:mod:`mergekit_bmm.search.fidelity`).
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.base import ModelLoading, TaskExamples, evaluate_folder
from mergekit_bmm.evaluation.config import LMEvalEvaluatorConfig


def _quiet_lm_eval() -> None:
    for name in ("lm-eval", "lm_eval", "lm_eval.evaluator", "lm_eval.tasks", "lm_eval.models"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def _no_environment_report() -> Iterator[None]:
    """``simple_evaluate`` ends by collecting an environment report (torch's ``collect_env``
    runs ``pip list`` and more in subprocesses: about 1.3 s of wall time per call). A search
    calls it once per chunk of documents and keeps none of it, so it is skipped."""
    import lm_eval.evaluator

    original = getattr(lm_eval.evaluator, "add_env_info", None)
    if original is None:  # another lm-eval version: nothing to skip
        yield
        return
    lm_eval.evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = original


class LMEvalEvaluator:
    """Runs the configured lm-eval tasks on each merged model."""

    def __init__(self, config: LMEvalEvaluatorConfig, device: str) -> None:
        from lm_eval.tasks import TaskManager

        _quiet_lm_eval()
        self.config = config
        self.device = device
        self.loading = ModelLoading("AutoModelForCausalLM", config.dtype)
        self.weights = {task.name: task.weight for task in config.tasks}
        if config.include_path is not None and not Path(config.include_path).exists():
            raise ConfigError(f"lm_eval include_path {config.include_path} does not exist")
        self.task_manager = self._task_manager(TaskManager)
        known = set(self.task_manager.all_tasks)
        for task in config.tasks:
            if task.name not in known:
                close = difflib.get_close_matches(task.name, sorted(known), n=3)
                hint = (
                    f"; did you mean {', '.join(close)}?"
                    if close
                    else ("; for a local task set include_path to the folder with its YAML")
                )
                raise ConfigError(f"lm_eval has no task {task.name!r}{hint}")

    def _task_manager(self, task_manager_class):
        """Index only ``include_path`` when it has every task: lm-eval's own index of
        thousands of task YAMLs takes tens of seconds to build."""
        names = {task.name for task in self.config.tasks}
        if self.config.include_path is not None:
            local = task_manager_class(include_path=self.config.include_path, include_defaults=False)
            if names <= set(local.all_tasks):
                return local
        return task_manager_class(include_path=self.config.include_path)

    def evaluate(self, model_dir: Path) -> dict[str, float]:
        return evaluate_folder(self, model_dir, self.device)

    def _lm(self, model: Any, tokenizer: Any) -> Any:
        """lm-eval's ``HFLM`` around the live model, reused while the model object is the same
        (resident trials change its weights in place; HFLM keeps no outputs between calls)."""
        from lm_eval.models.huggingface import HFLM

        cached = getattr(self, "_wrapped", None)
        if cached is None or cached[0] is not model or cached[1] is not tokenizer:
            lm = HFLM(
                pretrained=model, tokenizer=tokenizer, batch_size=self.config.batch_size, device=self.device
            )
            self._wrapped = (model, tokenizer, lm)
        return self._wrapped[2]

    def _run(self, lm: Any, tasks: list[str], samples: dict[str, list[int]] | None = None) -> dict[str, Any]:
        import lm_eval

        with _no_environment_report():
            return lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                task_manager=self.task_manager,
                limit=None if samples is not None else self.config.limit,
                samples=samples,
                num_fewshot=self.config.num_fewshot,
                log_samples=samples is not None,
                bootstrap_iters=0,
                verbosity="ERROR",
            )

    def evaluate_model(self, model: Any, tokenizer: Any) -> dict[str, float]:
        """lm-eval's ``HFLM`` wrapped around the live model (no folder is read)."""
        output = self._run(self._lm(model, tokenizer), [task.name for task in self.config.tasks])
        return self.extract(output)

    @property
    def scores_examples(self) -> bool:
        """Whether every task's metric is a per-document mean, so documents can be scored alone."""
        if not hasattr(self, "_documents"):
            self._documents = self._document_counts()
        return self._documents is not None

    def _document_counts(self) -> dict[str, int] | None:
        from lm_eval.api.metrics import mean

        tasks = self.task_manager.load([task.name for task in self.config.tasks])["tasks"]
        counts = {}
        for spec in self.config.tasks:
            task = tasks.get(spec.name)
            metric = spec.metric.split(",")[0]
            if task is None or not hasattr(task, "aggregation") or task.aggregation().get(metric) is not mean:
                return None  # a group, or a corpus-level metric (f1, mcc, ...): score in full
            total = len(task.eval_docs)
            limit = self.config.limit
            if limit is not None:
                total = min(total, math.ceil(limit * total) if isinstance(limit, float) else int(limit))
            counts[spec.name] = total
        return counts

    def examples(self) -> dict[str, TaskExamples]:
        """Each task's documents (the first ``limit`` when a limit is set, as lm-eval takes them)."""
        assert self.scores_examples
        return {name: TaskExamples(count) for name, count in self._documents.items()}

    def example_scorer(self, model: Any, tokenizer: Any):
        """``score(task, indices)``: the task's metric on each of those documents."""
        lm = self._lm(model, tokenizer)
        metrics = {task.name: task.metric.split(",")[0] for task in self.config.tasks}

        def score(task: str, indices) -> list[float]:
            chosen = sorted(indices)
            if not chosen:
                return []
            output = self._run(lm, [task], {task: chosen})
            by_document = {
                sample["doc_id"]: float(sample[metrics[task]]) for sample in output["samples"][task]
            }
            return [by_document[index] for index in indices]

        return score

    def extract(self, output: dict[str, Any]) -> dict[str, float]:
        """Each task's configured metric from ``simple_evaluate``'s output."""
        tables = {**(output.get("groups") or {}), **(output.get("results") or {})}
        scores = {}
        for task in self.config.tasks:
            metrics = tables.get(task.name)
            if metrics is None:
                raise ConfigError(f"lm_eval returned no results for task {task.name!r}")
            value = metrics.get(task.metric_key)
            if value is None or isinstance(value, str):
                available = sorted(
                    k for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k
                )
                raise ConfigError(
                    f"lm_eval task {task.name!r} has no metric {task.metric!r}; "
                    f"it reports: {', '.join(available)}"
                )
            scores[task.name] = float(value) if value is not None else math.nan
        return scores
