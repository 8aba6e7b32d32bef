"""The ``evaluator:`` section of a search config: one pydantic model per evaluator type.

Validated once, when the search config is read; relative paths are resolved against the
folder of the file that names them (pass ``context={"base_dir": folder}``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def resolve_path(value: str | None, info: ValidationInfo) -> str | None:
    """An absolute path; relative ones are taken from the config file's folder."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_absolute():
        base = (info.context or {}).get("base_dir") or Path.cwd()
        path = Path(base) / path
    return str(path.resolve())


def _check_limit(value: int | float | None) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, float) and not value.is_integer():
        if not 0.0 < value < 1.0:
            raise ValueError(f"a fractional limit must lie in (0, 1); got {value}")
        return value
    if value < 1:
        raise ValueError(f"limit must be at least 1 example (or a fraction in (0, 1)); got {value}")
    return int(value)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PythonEvaluatorConfig(_Strict):
    """``type: python``: a function ``package.module:function`` scores each merged model.

    ``input: model`` (the default) calls ``function(model, tokenizer, **args)`` with the
    model loaded as ``load_model`` (a transformers class; ``auto`` = the checkpoint's own
    architecture) in ``dtype`` on the search's device — in a search, the live model its
    trials merge in place. ``input: folder`` calls ``function(model_dir, **args)`` with a
    folder mergekit wrote (the search then writes every trial to disk).
    """

    type: Literal["python"]
    callable: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    input: Literal["model", "folder"] = "model"
    load_model: str = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Extra keyword arguments for the function.
    args: dict[str, Any] = Field(default_factory=dict)
    # Scoring single examples (so a search can score a trial on part of them first): a second
    # function ``examples(**args) -> {task: count or [label per example]}``; ``callable`` is then
    # called as ``function(model, tokenizer, task=..., indices=[...], **args) -> [score per index]``.
    examples: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    # Folders put in front of sys.path so the module can be imported (relative: to search.yml).
    python_path: list[str] = Field(default_factory=list)

    @field_validator("python_path")
    @classmethod
    def _resolve(cls, value: list[str], info: ValidationInfo) -> list[str]:
        return [resolve_path(item, info) for item in value]

    @model_validator(mode="after")
    def _examples_need_a_model(self) -> PythonEvaluatorConfig:
        if self.examples is not None and self.input == "folder":
            raise ValueError(
                "`examples` scores single examples of a live model; it does not work with `input: folder` "
                "(remove one of them)"
            )
        return self


class LMEvalTask(_Strict):
    """One lm-eval task, the metric that scores it and its weight in the mean."""

    name: str = Field(min_length=1)
    metric: str = "acc"
    weight: float = Field(default=1.0, gt=0)

    @property
    def metric_key(self) -> str:
        """lm-eval's result key: ``metric,filter`` (filter ``none`` unless given)."""
        return self.metric if "," in self.metric else f"{self.metric},none"


class LMEvalEvaluatorConfig(_Strict):
    """``type: lm_eval``: lm-evaluation-harness on the merged model, offline."""

    type: Literal["lm_eval"]
    tasks: list[LMEvalTask] = Field(min_length=1)
    include_path: str | None = None
    limit: int | float | None = None
    batch_size: int | str = 8
    num_fewshot: int | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @field_validator("tasks", mode="before")
    @classmethod
    def _names_as_tasks(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("include_path")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return resolve_path(value, info)

    @field_validator("limit")
    @classmethod
    def _limit(cls, value: int | float | None) -> int | float | None:
        return _check_limit(value)

    @model_validator(mode="after")
    def _unique_names(self) -> LMEvalEvaluatorConfig:
        names = [task.name for task in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique; got {names}")
        return self


class ClassificationTask(_Strict):
    """A classification task: a fixed head over the encoder and a local JSONL data file."""

    name: str = Field(min_length=1)
    head: str
    data: str
    split: str | None = None
    limit: int | float | None = None
    text_field: str = "text"
    label_field: str = "label"
    weight: float = Field(default=1.0, gt=0)

    @field_validator("head", "data")
    @classmethod
    def _resolve(cls, value: str, info: ValidationInfo) -> str:
        return resolve_path(value, info)

    @field_validator("limit")
    @classmethod
    def _limit(cls, value: int | float | None) -> int | float | None:
        return _check_limit(value)


class ClassificationEvaluatorConfig(_Strict):
    """``type: classification``: accuracy of fixed heads on the merged encoder."""

    type: Literal["classification"]
    tasks: list[ClassificationTask] = Field(min_length=1)
    max_length: int = Field(default=128, ge=1)
    batch_size: int = Field(default=32, ge=1)

    @model_validator(mode="after")
    def _unique_names(self) -> ClassificationEvaluatorConfig:
        names = [task.name for task in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique; got {names}")
        return self


def _local_reference(value: str, info: ValidationInfo) -> str:
    """A path as an absolute one (from the config's folder); a Hub id (``ORG/NAME``) as it is."""
    base = Path((info.context or {}).get("base_dir") or Path.cwd())
    if value.startswith(("/", ".", "~")) or (base / value).exists():
        return resolve_path(value, info) or value
    return value


class AgreementEvaluatorConfig(_Strict):
    """``type: agreement``: no labels; how closely the merge reproduces each expert on its task's text.

    The tasks are a ``stats.yml``'s (``stats:``, by reference) or the same schema inline (``tasks:``):
    per task an expert (``model``) and unlabelled text (``data``: JSONL, a ``datasets`` folder or a Hub
    data set from the cache). Inline tasks may add a ``head:`` (a classification head file, for
    encoders) and a ``weight:``. ``references`` (default: the search's ``references/`` folder) keeps
    each expert's predictions; ``base_model`` (default: the recipe's) sets each task's scale.
    """

    type: Literal["agreement"]
    stats: str | None = None
    tasks: list[dict[str, Any]] | None = None
    objective: Literal["kl", "reverse_kl", "top1", "entropy"] = "kl"
    scale: Literal["base", "none"] = "base"
    split: str | None = None  # overrides every task's split (e.g. held-out text)
    max_samples: int | None = Field(default=None, ge=1)  # texts per task (default: the stats' 128)
    max_length: int | None = Field(default=None, ge=1)  # tokens per text (default: the stats')
    top_k: int = Field(default=64, ge=1, description="causal LMs: the expert's most likely tokens kept")
    positions: Literal["all", "last"] = Field(
        default="all",
        description="causal LMs: the next-token distribution at every token of a text, or at its last "
        "token only (where a prompt's answer is read)",
    )
    batch_size: int = Field(default=8, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    heads: dict[str, str] = Field(default_factory=dict)  # task name -> head file (with `stats:`)
    references: str | None = None
    base_model: str | None = None

    @field_validator("stats", "references")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return resolve_path(value, info)

    @field_validator("heads")
    @classmethod
    def _resolve_heads(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        return {name: resolve_path(path, info) for name, path in value.items()}

    @field_validator("tasks")
    @classmethod
    def _resolve_task_paths(cls, value: list[dict[str, Any]] | None, info: ValidationInfo) -> Any:
        if value is None:
            return None
        resolved = []
        for task in value:
            if not isinstance(task, dict):
                raise ValueError(f"each task is a mapping with name, model and data; got {task!r}")
            task = dict(task)
            if task.get("head") is not None:
                task["head"] = resolve_path(str(task["head"]), info)
            if isinstance(task.get("data"), str):
                task["data"] = _local_reference(task["data"], info)
            if isinstance(task.get("model"), str):
                task["model"] = "+".join(_local_reference(part, info) for part in task["model"].split("+", 1))
            resolved.append(task)
        return resolved

    @model_validator(mode="after")
    def _one_source(self) -> AgreementEvaluatorConfig:
        if (self.stats is None) == (self.tasks is None):
            raise ValueError(
                "give the tasks either as `stats: stats.yml` (a statistics config) or inline as `tasks:`, "
                "not both or neither"
            )
        if self.tasks is not None and not self.tasks:
            raise ValueError("`tasks:` is empty; list at least one task (name, model, data)")
        return self


EvaluatorConfig = Annotated[
    PythonEvaluatorConfig | LMEvalEvaluatorConfig | ClassificationEvaluatorConfig | AgreementEvaluatorConfig,
    Field(discriminator="type"),
]


def weighted_mean(per_task: dict[str, float], weights: dict[str, float]) -> float:
    """The score: the (weighted) mean over tasks, paper eq. 10. NaN if any task is NaN."""
    if not per_task:
        return math.nan
    total = sum(weights.get(name, 1.0) for name in per_task)
    return sum(weights.get(name, 1.0) * value for name, value in per_task.items()) / total
