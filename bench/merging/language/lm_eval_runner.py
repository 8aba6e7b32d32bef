"""Scoring causal LMs with lm-eval on the generated local tasks, offline, with a score cache."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.merging import device
from bench.merging.cache import ScoreCache
from bench.merging.language.mc_tasks import MCTask


def lm_eval_accuracy(
    model_dir: Path,
    task_names: Sequence[str],
    include_path: Path,
    batch_size: int = 16,
    limit: int | None = None,
) -> dict[str, tuple[float, list[float]]]:
    """``{lm-eval task name: (acc, each document's acc in document order)}`` of a local HF causal
    LM (one model load for all tasks); the documents' scores give the paired intervals."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(variable, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    output = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(model_dir), "dtype": "float32", "device": device.current()},
        tasks=list(task_names),
        batch_size=batch_size,
        limit=limit,
        # the tasks are generated locally: indexing lm-eval's own (thousands of YAML files) too took
        # seconds per call, every call
        task_manager=TaskManager(include_path=str(include_path), include_defaults=False),
        log_samples=True,
        verbosity="WARNING",
    )
    out = {}
    for name in task_names:
        documents = sorted(output["samples"][name], key=lambda sample: sample["doc_id"])
        out[name] = (float(output["results"][name]["acc,none"]), [float(d["acc"]) for d in documents])
    return out


def lm_score_key(model_id: str, task: MCTask, split: str, limit: int | None) -> dict[str, Any]:
    return {
        "model": model_id,
        "lm_eval_task": task.lm_eval_name(split),
        "data": task.sha256,
        "split": split,
        "limit": limit,
        "scorer": "lm-eval acc",
    }


def needs_scoring(record: dict[str, Any] | None, split: str) -> bool:
    """Whether a cached score must be (re)computed: absent, or a test score kept without each
    document's score (the paired intervals need them)."""
    return record is None or (split == "test" and "documents" not in record)


def score_lm(
    model_id: str,
    model_dir: Path,
    jobs: Sequence[tuple[MCTask, str]],
    include_path: Path,
    cache: ScoreCache,
    batch_size: int,
    limit: int | None,
) -> tuple[dict[tuple[str, str], float], float]:
    """Accuracies per ``(task, split)`` (cached) and the seconds lm-eval took this time.

    A test score is kept with each document's score (:func:`test_documents`); a test record
    cached without them is scored again.
    """
    keys = {(task.name, split): lm_score_key(model_id, task, split, limit) for task, split in jobs}
    scores: dict[tuple[str, str], float] = {}
    missing: list[tuple[MCTask, str]] = []
    for task, split in jobs:
        record = cache.get(keys[(task.name, split)])
        if needs_scoring(record, split):
            missing.append((task, split))
        else:
            scores[(task.name, split)] = record["accuracy"]
    seconds = 0.0
    if missing:
        started = time.time()
        names = [task.lm_eval_name(split) for task, split in missing]
        accuracies = lm_eval_accuracy(model_dir, names, include_path, batch_size, limit)
        seconds = time.time() - started
        for (task, split), name in zip(missing, names):
            accuracy, documents = accuracies[name]
            record = {"accuracy": accuracy, "n": len(documents), "seconds": seconds, "documents": documents}
            cache.put(keys[(task.name, split)], record)
            scores[(task.name, split)] = accuracy
    return scores, seconds


def test_documents(
    model_id: str, tasks: Sequence[MCTask], cache: ScoreCache, limit: int | None
) -> dict[str, list[float]]:
    """Per task, each test document's score (1/0) of a model :func:`score_lm` scored on test."""
    return {task.name: cache.get(lm_score_key(model_id, task, "test", limit))["documents"] for task in tasks}


def summarize(scores: dict[tuple[str, str], float]) -> dict[str, Any]:
    out: dict[str, dict[str, float]] = {}
    for (task, split), value in scores.items():
        out.setdefault(task, {})[split] = round(value, 4)
    return out
