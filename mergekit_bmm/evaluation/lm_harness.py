"""``type: lm_eval``: lm-evaluation-harness tasks on the merged causal LM, offline.

Tasks are looked up once through ``lm_eval.tasks.TaskManager`` (with ``include_path``
for local task YAMLs), so a misspelt task stops the search before the first merge.
Relative ``data_files`` in a task YAML are resolved by lm-eval against the working
directory; write absolute paths there. Each
trial loads the merged model, wraps it in ``HFLM`` and runs ``simple_evaluate``; a
task's score is its configured metric (``acc`` by default; ``acc_norm``,
``exact_match,strict-match``, ... as lm-eval names them).
"""

from __future__ import annotations

import difflib
import logging
import math
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.base import ModelLoading, evaluate_folder
from mergekit_bmm.evaluation.config import LMEvalEvaluatorConfig


def _quiet_lm_eval() -> None:
    for name in ("lm-eval", "lm_eval", "lm_eval.evaluator", "lm_eval.tasks", "lm_eval.models"):
        logging.getLogger(name).setLevel(logging.ERROR)


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

    def evaluate_model(self, model: Any, tokenizer: Any) -> dict[str, float]:
        """lm-eval's ``HFLM`` wrapped around the live model (no folder is read)."""
        import lm_eval
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(
            pretrained=model, tokenizer=tokenizer, batch_size=self.config.batch_size, device=self.device
        )
        try:
            output = lm_eval.simple_evaluate(
                model=lm,
                tasks=[task.name for task in self.config.tasks],
                task_manager=self.task_manager,
                limit=self.config.limit,
                num_fewshot=self.config.num_fewshot,
                log_samples=False,
                bootstrap_iters=0,
                verbosity="ERROR",
            )
        finally:
            del lm
        return self.extract(output)

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
