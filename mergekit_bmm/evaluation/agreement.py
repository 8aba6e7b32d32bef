"""``type: agreement``: score a merge with no labels, by how closely it reproduces each expert.

On task t's unlabelled text the merged model should predict what expert t predicts. A text's
divergence ``D`` is the mean over its positions (:mod:`mergekit_bmm.evaluation.divergence`:
``KL(expert ‖ merged)`` by default); a task's score is the mean over its texts of

- ``scale: base`` (default): ``1 − D / D_base``, with ``D_base`` the base model's mean divergence on
  the same texts: 0 is the base, 1 the expert itself, so every task is on the scale "share of the
  base's gap closed" and no task counts more because its divergences are larger;
- ``scale: none``: ``−D``.

``objective: entropy`` is AdaMerging's: ``D`` is the merged model's own prediction entropy (no
expert needed), scaled the same way. Every text's score is ≤ 1, so cheap-then-full evaluation
works as for accuracy. The experts' references are computed once per search
(:mod:`mergekit_bmm.evaluation.references`); a trial is one forward pass of the merged model
over the texts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.agreement_tasks import TextTask, load_tasks, match_recipe
from mergekit_bmm.evaluation.base import ModelLoading, TaskExamples, evaluate_folder
from mergekit_bmm.evaluation.classification import pad_token_id
from mergekit_bmm.evaluation.config import AgreementEvaluatorConfig
from mergekit_bmm.evaluation.divergence import divergence
from mergekit_bmm.evaluation.predictions import log_probs_per_text
from mergekit_bmm.evaluation.references import References, TaskData

LOG = logging.getLogger("mergekit_bmm.search")
SMALLEST_GAP = 1e-9  # a base that already reproduces its expert leaves nothing to scale by


class AgreementEvaluator:
    """Scores merged models on the experts' own predictions; no labels, no evaluator code."""

    scores_examples = True

    def __init__(self, config: AgreementEvaluatorConfig, device: str) -> None:
        self.config = config
        self.device = device
        self.tasks: list[TextTask] = load_tasks(config)  # texts read and checked now, not at trial 1
        self.weights = {task.name: task.weight for task in self.tasks}
        has_heads = any(task.head for task in self.tasks)
        self.loading = ModelLoading("AutoModel" if has_heads else "auto", config.dtype)
        self.references = References(Path(config.references) if config.references else None)
        self._data: dict[str, TaskData] | None = None

    # ------------------------------------------------------------ preparation
    def check_recipe(self, template: dict[str, Any]) -> None:
        """Every task's expert is merged by the recipe, and every expert has a task (else one line)."""
        match_recipe(self.tasks, template)

    def prepare(
        self,
        template: dict[str, Any] | None = None,
        echo: Callable[[str], None] = LOG.info,
        progress: bool = True,
    ) -> None:
        """Check the tasks against the recipe, then read or compute the experts' references."""
        self.references.progress = progress
        if template is not None:
            self.check_recipe(template)
        base = self.config.base_model or (template or {}).get("base_model")
        if not base:
            raise ConfigError("the agreement evaluator needs `base_model:` (a search takes the recipe's)")
        self._data = self.references.prepare(
            self.tasks,
            str(base),
            self.config.top_k,
            self.config.batch_size,
            self.config.dtype,
            self.device,
            echo,
            self.config.positions,
        )
        for task in self.tasks:
            gap = self._data[task.name].base_divergence.get(self.config.objective, math.nan)
            if self.config.scale == "base" and not gap > SMALLEST_GAP:
                raise ConfigError(
                    f"task {task.name!r}: the base model already matches expert {task.model} on its text "
                    f"({self.config.objective} {gap:.3g}), so `scale: base` has nothing to divide by; "
                    "use `scale: none`, or text on which the expert differs from the base"
                )

    def base_divergence(self, objective: str | None = None) -> dict[str, float]:
        """Per task, the base model's mean divergence under ``objective`` (default: this evaluator's;
        ``scale: base`` divides by it)."""
        objective = objective or self.config.objective
        return {name: data.base_divergence[objective] for name, data in self._ready().items()}

    def _ready(self) -> dict[str, TaskData]:
        if self._data is None:
            self.prepare()
        assert self._data is not None
        return self._data

    # ----------------------------------------------------------------- scoring
    def evaluate(self, model_dir: Path) -> dict[str, float]:
        return evaluate_folder(self, model_dir, self.device)

    def evaluate_model(self, model: Any, tokenizer: Any) -> dict[str, float]:
        score = self.example_scorer(model, tokenizer)
        data = self._ready()
        return {
            task.name: math.fsum(score(task.name, range(len(data[task.name].rows))))
            / len(data[task.name].rows)
            for task in self.tasks
        }

    def divergences(
        self, model: Any, tokenizer: Any, objectives: Sequence[str]
    ) -> dict[str, dict[str, float]]:
        """Per objective, each task's mean raw divergence (what ``scale: none`` negates), from one
        forward pass over the texts: a study that reads a model under every objective pays for one."""
        data, last_only = self._ready(), self.config.positions == "last"
        pad_id = pad_token_id(tokenizer) if tokenizer is not None else 0
        out: dict[str, dict[str, float]] = {objective: {} for objective in objectives}
        for task in self.tasks:
            own = data[task.name]
            values: dict[str, list[float]] = {objective: [] for objective in objectives}
            indices = list(range(len(own.rows)))
            for index, log_probs in log_probs_per_text(
                model, own.kind, own.rows, indices, pad_id, self.config.batch_size, own.head, last_only
            ):
                for objective in objectives:
                    reference = None if objective == "entropy" else own.of_text(index)
                    values[objective].append(float(divergence(log_probs, reference, objective).mean()))
            for objective in objectives:
                out[objective][task.name] = math.fsum(values[objective]) / len(own.rows)
        return out

    def examples(self) -> dict[str, TaskExamples]:
        """Each task's texts; a classification task is stratified by the class its expert predicts."""
        data = self._ready()
        out = {}
        for name, task in data.items():
            strata = None
            if task.kind != "causal_lm":
                strata = tuple(
                    int(task.reference.top_index[task.offsets[i], 0]) for i in range(len(task.rows))
                )
            out[name] = TaskExamples(len(task.rows), strata)
        return out

    def example_scorer(self, model: Any, tokenizer: Any) -> Callable[[str, Sequence[int]], list[float]]:
        """``score(task, indices)``: each text's score (≤ 1; see the module's docstring)."""
        data = self._ready()
        objective, scaled = self.config.objective, self.config.scale == "base"
        pad_id = pad_token_id(tokenizer) if tokenizer is not None else 0

        def score(task: str, indices: Sequence[int]) -> list[float]:
            own = data[task]
            gap = own.base_divergence[objective]
            values = dict.fromkeys(indices, math.nan)
            last_only = self.config.positions == "last"
            for index, log_probs in log_probs_per_text(
                model, own.kind, own.rows, list(indices), pad_id, self.config.batch_size, own.head, last_only
            ):
                reference = None if objective == "entropy" else own.of_text(index)
                value = float(divergence(log_probs, reference, objective).mean())
                values[index] = 1.0 - value / gap if scaled else -value
            return [values[index] for index in indices]

        return score

    def describe(self) -> str:
        """One line for the report and the card: what was read, and that no labels were."""
        texts = ", ".join(
            f"{task.name} ({len(task.samples)} texts of {task.plan.task.data})" for task in self.tasks
        )
        return (
            f"label-free: agreement with each expert ({self.config.objective}, scale {self.config.scale}) "
            f"on unlabelled text: {texts}"
        )
