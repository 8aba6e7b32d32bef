"""Score an ensemble of model folders (e.g. ``mergekit-bmm-sample``'s members) on classification tasks.

The members are scored one at a time by ``logits_fn(model_dir) -> {task: (logits, labels)}``
(only one model is in memory at once); per task the ensemble prediction is the average
of the members' softmax probabilities (paper eq. 13), scored by accuracy, ECE (20 bins)
and NLL. ``logits_fn`` is where the classification evaluator plugs in: scoring a loaded
encoder with a task's head (``evaluation.classification.task_logits``) for every task;
:func:`classification_logits_fn` builds it from the search's classification evaluator
config, so ensembles are scored exactly like search trials.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mergekit_bmm.ensemble.metrics import (
    DEFAULT_BINS,
    accuracy,
    expected_calibration_error,
    negative_log_likelihood,
    softmax_probabilities,
)
from mergekit_bmm.errors import TensorInputError
from mergekit_bmm.evaluation.config import ClassificationEvaluatorConfig

LogitsFn = Callable[[Path], Mapping[str, tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class TaskCalibration:
    task: str
    examples: int
    members: int
    accuracy: float
    ece: float
    nll: float
    member_accuracy: float  # mean accuracy of the members scored alone

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate_ensemble(
    members: Sequence[str | Path],
    logits_fn: LogitsFn,
    bins: int = DEFAULT_BINS,
    progress: bool = True,
) -> dict[str, TaskCalibration]:
    """Per task: the ensemble's accuracy, ECE and NLL, and the members' mean accuracy."""
    if not members:
        raise TensorInputError("an ensemble needs at least one member")
    sums: dict[str, torch.Tensor] = {}
    labels_of: dict[str, torch.Tensor] = {}
    member_accuracy: dict[str, float] = {}
    for index, member in enumerate(tqdm(members, desc="Scoring members", disable=not progress)):
        outputs = logits_fn(Path(member))
        if index == 0:
            tasks = set(outputs)
        elif set(outputs) != tasks:
            raise TensorInputError(
                f"{member} was scored on tasks {sorted(outputs)}, the first member on {sorted(tasks)}"
            )
        for task, (logits, labels) in outputs.items():
            probabilities = softmax_probabilities(logits)
            labels = labels.detach().to("cpu").long()
            if index == 0:
                sums[task] = probabilities
                labels_of[task] = labels
                member_accuracy[task] = 0.0
            else:
                if probabilities.shape != sums[task].shape or not torch.equal(labels, labels_of[task]):
                    raise TensorInputError(
                        f"{member} gave task {task!r} other examples or classes than the first member; "
                        "score every member on the same data"
                    )
                sums[task] += probabilities
            member_accuracy[task] += accuracy(probabilities, labels)
    count = len(members)
    results = {}
    for task in sorted(sums):
        probabilities = sums[task] / count
        labels = labels_of[task]
        results[task] = TaskCalibration(
            task=task,
            examples=len(labels),
            members=count,
            accuracy=accuracy(probabilities, labels),
            ece=expected_calibration_error(probabilities, labels, bins),
            nll=negative_log_likelihood(probabilities, labels),
            member_accuracy=member_accuracy[task] / count,
        )
    return results


def mean_over_tasks(results: Mapping[str, TaskCalibration]) -> dict[str, float]:
    """Unweighted task averages of accuracy, ECE and NLL (the paper's multi-task average)."""
    if not results:
        raise TensorInputError("no task results to average")
    keys = ("accuracy", "ece", "nll", "member_accuracy")
    return {key: sum(getattr(r, key) for r in results.values()) / len(results) for key in keys}


def classification_logits_fn(config: ClassificationEvaluatorConfig, device: str = "cpu") -> LogitsFn:
    """``logits_fn`` scoring a model folder on every task of a classification evaluator config."""
    from mergekit_bmm.evaluation.base import load_model, load_tokenizer, release_memory
    from mergekit_bmm.evaluation.classification import ClassificationEvaluator, task_logits

    ClassificationEvaluator(config, device)  # checks heads and data now, not after the first member

    def logits_fn(model_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        model = load_model(model_dir, "AutoModel", device)
        tokenizer = load_tokenizer(model_dir)
        try:
            return {
                task.name: task_logits(model, tokenizer, task, config.max_length, config.batch_size)
                for task in config.tasks
            }
        finally:
            del model, tokenizer
            release_memory()

    return logits_fn
