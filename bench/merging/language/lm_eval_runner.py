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
) -> dict[str, float]:
    """``{lm-eval task name: acc}`` of a local HF causal LM (one model load for all tasks)."""
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
        task_manager=TaskManager(include_path=str(include_path)),
        log_samples=False,
        verbosity="WARNING",
    )
    return {name: float(output["results"][name]["acc,none"]) for name in task_names}


def lm_score_key(model_id: str, task: MCTask, split: str, limit: int | None) -> dict[str, Any]:
    return {
        "model": model_id,
        "lm_eval_task": task.lm_eval_name(split),
        "data": task.sha256,
        "split": split,
        "limit": limit,
        "scorer": "lm-eval acc",
    }


def score_lm(
    model_id: str,
    model_dir: Path,
    jobs: Sequence[tuple[MCTask, str]],
    include_path: Path,
    cache: ScoreCache,
    batch_size: int,
    limit: int | None,
) -> tuple[dict[tuple[str, str], float], float]:
    """Accuracies per ``(task, split)`` (cached) and the seconds lm-eval took this time."""
    keys = {(task.name, split): lm_score_key(model_id, task, split, limit) for task, split in jobs}
    scores: dict[tuple[str, str], float] = {}
    missing: list[tuple[MCTask, str]] = []
    for task, split in jobs:
        record = cache.get(keys[(task.name, split)])
        if record is None:
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
            n = min(limit, task.counts[split]) if limit else task.counts[split]
            cache.put(keys[(task.name, split)], {"accuracy": accuracies[name], "n": n, "seconds": seconds})
            scores[(task.name, split)] = accuracies[name]
    return scores, seconds


def summarize(scores: dict[tuple[str, str], float]) -> dict[str, Any]:
    out: dict[str, dict[str, float]] = {}
    for (task, split), value in scores.items():
        out.setdefault(task, {})[split] = round(value, 4)
    return out
