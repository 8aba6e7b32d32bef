"""The label-free evaluator's tasks: per task an expert, its unlabelled text and how to read its output.

The tasks are a ``stats.yml``'s, or the same schema inline, so the calibration text a
data-assisted merge already names is what the search scores on. Each is located and
fingerprinted the way ``mergekit-bmm-stats`` does it (:func:`mergekit_bmm.stats.plan.plan_tasks`:
local folders, Hub ids from the cache, ``BASE+ADAPTER``), and matched to the recipe's experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.config import AgreementEvaluatorConfig
from mergekit_bmm.io.fingerprint import file_fingerprint, reference_fingerprint, same_path
from mergekit_bmm.stats.config import StatsConfig, load_stats_config, parse_stats_config
from mergekit_bmm.stats.plan import TaskPlan, plan_tasks, task_samples
from mergekit_bmm.stats.samples import Sample

INLINE_ONLY = ("head", "weight")


@dataclass
class TextTask:
    """One task as the evaluator uses it: its expert, texts, optional head and weight."""

    plan: TaskPlan
    head: str | None
    weight: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.plan.task.name

    @property
    def model(self) -> str:
        return self.plan.task.model

    def identity(self, top_k: int, dtype: str, positions: str = "all") -> dict[str, Any]:
        """What decides this task's reference besides the expert's weights (``positions`` only when it
        is not the default, so references made before the setting existed stay valid)."""
        found = {
            **self.plan.settings,
            "head": file_fingerprint(self.head) if self.head else None,
            "top_k": top_k,
            "forward_dtype": dtype,
        }
        return found if positions == "all" else {**found, "positions": positions}


def stats_config_of(config: AgreementEvaluatorConfig) -> tuple[StatsConfig, dict[str, dict[str, Any]]]:
    """The tasks as a statistics config, with the evaluator's overrides, and each task's inline extras."""
    extras: dict[str, dict[str, Any]] = {}
    if config.stats is not None:
        stats = load_stats_config(config.stats)
        source = config.stats
    else:
        tasks = []
        for raw in config.tasks or []:
            task = {key: value for key, value in raw.items() if key not in INLINE_ONLY}
            extras[str(raw.get("name"))] = {key: raw[key] for key in INLINE_ONLY if key in raw}
            tasks.append(task)
        stats = parse_stats_config({"tasks": tasks}, "/", source="evaluator tasks")
        source = "the evaluator's tasks"
    for name, path in config.heads.items():
        extras.setdefault(name, {})["head"] = path
    names = {task.name for task in stats.tasks}
    unknown = sorted(set(extras) - names)
    if unknown:
        raise ConfigError(
            f"evaluator heads: no task named {unknown[0]!r} in {source} (tasks: {sorted(names)})"
        )
    for task in stats.tasks:
        if config.split is not None:
            task.split = config.split
        if config.max_samples is not None:
            task.max_samples = config.max_samples
        if config.max_length is not None:
            task.max_length = config.max_length
    return stats, extras


def load_tasks(config: AgreementEvaluatorConfig) -> list[TextTask]:
    """Every task located, its texts read and checked (a task with no usable text is one line)."""
    stats, extras = stats_config_of(config)
    tasks = []
    for plan in plan_tasks(stats):
        extra = extras.get(plan.task.name, {})
        head = extra.get("head")
        if head is not None and not Path(head).is_file():
            raise ConfigError(f"task {plan.task.name!r}: head file {head} does not exist")
        weight = float(extra.get("weight", 1.0))
        if not weight > 0:
            raise ConfigError(f"task {plan.task.name!r}: weight must be > 0; got {weight}")
        try:
            samples = task_samples(plan)
        except ConfigError as error:
            raise ConfigError(f"task {plan.task.name!r}: {error}") from None
        tasks.append(TextTask(plan, head, weight, samples))
    heads = {task.head is not None for task in tasks}
    if len(heads) > 1:
        raise ConfigError(
            "some tasks give a classification head and some do not; the merged model is read one way "
            "(give every task a `head:` for an encoder, or none for a causal LM)"
        )
    return tasks


def _experts_of(template: dict[str, Any]) -> list[str]:
    """The recipe's experts (inputs marked ``anchor: true`` are not)."""
    return [
        str(item["model"])
        for item in template.get("models") or []
        if isinstance(item, dict) and not (item.get("parameters") or {}).get("anchor")
    ]


def _same_model(left: str, right: str) -> bool:
    if left == right:
        return True
    left_parts, right_parts = left.split("+", 1), right.split("+", 1)
    if len(left_parts) == len(right_parts) and all(
        Path(a).expanduser().exists() and same_path(a, b) for a, b in zip(left_parts, right_parts)
    ):
        return True
    fingerprint = reference_fingerprint(left)
    return bool(fingerprint) and fingerprint == reference_fingerprint(right)


def match_recipe(tasks: list[TextTask], template: dict[str, Any]) -> None:
    """Each task's expert is one the recipe merges, and each expert has a task (else one line)."""
    experts = _experts_of(template)
    for task in tasks:
        if not any(_same_model(task.model, expert) for expert in experts):
            raise ConfigError(
                f"agreement task {task.name!r} names the expert {task.model}, which the recipe does not "
                f"merge; its experts are {', '.join(experts)} (name each task's expert as the recipe does)"
            )
    for expert in experts:
        if not any(_same_model(task.model, expert) for task in tasks):
            raise ConfigError(
                f"the recipe merges {expert}, but no agreement task names it; add a task with that expert "
                "and some of its text (the merge is scored on every expert it merges)"
            )
    if template.get("tokenizer_source") or template.get("tokenizer"):
        raise ConfigError(
            "the recipe sets a tokenizer (tokenizer_source/tokenizer); the agreement evaluator compares "
            "predictions over the base model's vocabulary: remove it, or score with another evaluator"
        )
