"""``type: python``: a function of your own scores the merged model.

The function is named ``package.module:function``. With ``input: model`` (the default)
it is called as ``function(model, tokenizer, **args)``, the model already loaded on the
search's device (in a search: the live model its trials merge in place); with
``input: folder``, as ``function(model_dir, **args)``. It returns one number, or a
mapping of per-task numbers (the search's score is then their mean).

With ``examples:`` (a second function, ``examples(**args) -> {task: count or [label per
example]}``), the evaluator scores single examples, so a search can score a trial on part
of them first (cheap-then-full, :mod:`mergekit_bmm.search.fidelity`): ``callable`` is then
called as ``function(model, tokenizer, task=..., indices=[...], **args)`` and returns one
score in [0, 1] per index (e.g. 1.0 when the example is right); a task's score is their mean.
"""

from __future__ import annotations

import importlib
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.base import ModelLoading, TaskExamples, evaluate_folder
from mergekit_bmm.evaluation.config import PythonEvaluatorConfig

SINGLE_TASK = "score"


def import_callable(spec: str, python_path: list[str] | None = None) -> Callable[..., Any]:
    """``package.module:function`` → the function (one-line errors if it is not there)."""
    for folder in reversed(python_path or []):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"evaluator callable {spec!r}: cannot import {module_name!r} ({error}); install it or "
            "add its folder to evaluator.python_path"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(
            f"evaluator callable {spec!r}: module {module_name!r} has no function {attribute!r}"
        )
    return function


def _number(value: Any, where: str) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where} returned {type(value).__name__} {value!r}; return a number")
    return float(value)


def as_per_task(result: Any, spec: str) -> dict[str, float]:
    """A number or a ``{task: number}`` mapping → per-task floats."""
    if isinstance(result, Mapping):
        if not result:
            raise ConfigError(f"evaluator {spec!r} returned an empty mapping; return at least one task score")
        return {
            str(task): _number(value, f"evaluator {spec!r} for task {task!r}")
            for task, value in result.items()
        }
    return {SINGLE_TASK: _number(result, f"evaluator {spec!r}")}


class PythonEvaluator:
    """Calls the configured function on each merged model (or its folder)."""

    def __init__(self, config: PythonEvaluatorConfig, device: str) -> None:
        self.config = config
        self.device = device
        self.function = import_callable(config.callable, config.python_path)
        self.weights: dict[str, float] = {}
        self.loading = ModelLoading(config.load_model, config.dtype) if config.input == "model" else None
        self.scores_examples = config.examples is not None
        self._examples = _task_examples(config) if self.scores_examples else {}

    def examples(self) -> dict[str, TaskExamples]:
        """Each task's example count (and labels, to stratify), from the ``examples`` function."""
        return self._examples

    def example_scorer(self, model: Any, tokenizer: Any) -> Callable[[str, Sequence[int]], list[float]]:
        """``score(task, indices) -> [score per index]``, each checked to lie in [0, 1]."""
        where = f"evaluator {self.config.callable!r}"

        def score(task: str, indices: Sequence[int]) -> list[float]:
            found = self.function(model, tokenizer, task=task, indices=list(indices), **self.config.args)
            if isinstance(found, (str, bytes, Mapping)) or not hasattr(found, "__len__"):
                kind = type(found).__name__
                raise ConfigError(f"{where} for task {task!r} returned {kind}; return one score per index")
            values = [_number(value, f"{where} for task {task!r}") for value in found]
            if len(values) != len(indices) or any(not 0.0 <= v <= 1.0 for v in values):
                raise ConfigError(
                    f"{where} for task {task!r} returned {len(values)} scores for {len(indices)} examples "
                    "(or one outside [0, 1]); return one score in [0, 1] per index"
                )
            return values

        return score

    def evaluate(self, model_dir: Path) -> dict[str, float]:
        if self.loading is not None:
            return evaluate_folder(self, model_dir, self.device)
        return as_per_task(self.function(Path(model_dir), **self.config.args), self.config.callable)

    def evaluate_model(self, model: Any, tokenizer: Any) -> dict[str, float]:
        if self.scores_examples:
            score = self.example_scorer(model, tokenizer)
            counts = {task: found.count for task, found in self._examples.items()}
            return {task: sum(score(task, range(count))) / count for task, count in counts.items()}
        try:
            result = self.function(model, tokenizer, **self.config.args)
        except Exception as error:
            if expects_folder(self.function):
                raise ConfigError(
                    f"evaluator callable {self.config.callable!r} seems to expect a model folder (its first "
                    f"parameter is {first_parameter(self.function)!r}) but python evaluators now receive "
                    "(model, tokenizer); add `input: folder` to the evaluator section to be given a folder"
                ) from error
            raise
        return as_per_task(result, self.config.callable)


def _task_examples(config: PythonEvaluatorConfig) -> dict[str, TaskExamples]:
    """``examples(**args)`` → per task a count, or labels (the count is their number)."""
    function = import_callable(config.examples, config.python_path)
    found = function(**config.args)
    where = f"evaluator examples {config.examples!r}"
    if not isinstance(found, Mapping) or not found:
        raise ConfigError(f"{where} returned {type(found).__name__}; return {{task: count or [labels]}}")
    tasks = {}
    for task, value in found.items():
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            tasks[str(task)] = TaskExamples(value)
        elif isinstance(value, Sequence) and value and all(isinstance(v, int) for v in value):
            tasks[str(task)] = TaskExamples(len(value), tuple(value))
        else:
            raise ConfigError(
                f"{where} for task {task!r}: expected a positive count or a non-empty list of int labels; "
                f"got {value!r:.60}"
            )
    return tasks


FOLDER_WORDS = ("dir", "path", "folder", "checkpoint")


def first_parameter(function: Callable[..., Any]) -> str | None:
    import inspect

    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    return parameters[0].name if parameters else None


def expects_folder(function: Callable[..., Any]) -> bool:
    """Whether a function looks written to the folder contract ``fn(model_dir, ...)``: its first
    parameter is named like a path, or annotated as one."""
    import inspect

    name = first_parameter(function)
    if name is None:
        return False
    annotation = str(inspect.signature(function).parameters[name].annotation)
    return any(word in name.lower() for word in FOLDER_WORDS) or "Path" in annotation
