"""Scores of encoders on task splits, through the shared classification evaluator.

Every score goes through :func:`mergekit_bmm.evaluation.classification.task_logits`, the
same function the search's classification evaluator uses, and is cached by the model's
identity (weights fingerprint, or a merge recipe's key), the task data, the head, the
split and the token length: re-running a benchmark never scores a model twice. The cache
keeps, besides the accuracy, which examples the model got right (``correct``, one
character per example in data order), so intervals can be bootstrapped and two models
compared example by example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.merging.cache import ScoreCache
from bench.merging.tasks import TaskData
from mergekit_bmm.evaluation.classification import ClassificationTask, accuracy, task_logits


@dataclass(frozen=True)
class ScoredTask:
    """A task with its head: what an evaluator needs."""

    data: TaskData
    head: Path
    head_sha: str

    @property
    def name(self) -> str:
        return self.data.name

    def evaluator_task(self, split: str, limit: int | None = None) -> ClassificationTask:
        return ClassificationTask(
            name=self.name, head=str(self.head), data=str(self.data.data), split=split, limit=limit
        )


def score_key(
    model_id: str, task: ScoredTask, split: str, max_length: int, limit: int | None = None
) -> dict[str, Any]:
    key = {
        "model": model_id,
        "task": task.name,
        "data": task.data.sha256,
        "head": task.head_sha,
        "split": split,
        "max_length": max_length,
    }
    if limit is not None:
        key["limit"] = limit
    return key


def score_model(
    model_id: str,
    load: Callable[[], tuple[Any, Any]],
    jobs: Sequence[tuple[ScoredTask, str]],
    max_length: int,
    batch_size: int,
    cache: ScoreCache,
    label: str = "",
    limits: dict[str, int | None] | None = None,
) -> dict[tuple[str, str], float]:
    """Accuracy per ``(task, split)``; ``load()`` runs only if a score is missing.

    ``limits`` maps a split to the size of its fixed subset (the evaluator's ``limit``).
    """
    limits = limits or {}
    from tqdm.auto import tqdm

    scores: dict[tuple[str, str], float] = {}
    missing = []
    for task, split in jobs:
        record = cache.get(score_key(model_id, task, split, max_length, limits.get(split)))
        if record is None or "correct" not in record:
            missing.append((task, split))
        else:
            scores[(task.name, split)] = record["accuracy"]
    if missing:
        model, tokenizer = load()
        for task, split in tqdm(missing, desc=f"score {label}".strip(), leave=False):
            limit = limits.get(split)
            logits, labels = task_logits(
                model, tokenizer, task.evaluator_task(split, limit), max_length, batch_size
            )
            value = accuracy(logits, labels)
            right = "".join("1" if hit else "0" for hit in (logits.argmax(dim=-1) == labels).tolist())
            cache.put(
                score_key(model_id, task, split, max_length, limit),
                {"accuracy": value, "n": len(labels), "correct": right},
            )
            scores[(task.name, split)] = value
    return scores


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def correct_flags(
    model_id: str,
    task: ScoredTask,
    split: str,
    max_length: int,
    cache: ScoreCache,
    limit: int | None = None,
) -> list[bool]:
    """Which examples of ``task``'s ``split`` a scored model got right (from the score cache)."""
    record = cache.get(score_key(model_id, task, split, max_length, limit))
    if record is None or "correct" not in record:
        raise KeyError(f"no per-example score of {model_id} on {task.name}/{split}; score it first")
    return [flag == "1" for flag in record["correct"]]
