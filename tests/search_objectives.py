"""Python-callable evaluators used by the search tests (importable as ``search_objectives:...``)."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import torch

from mergekit_bmm.checkpoint import load_state_dict
from mergekit_bmm.module_map import classify


@lru_cache(maxsize=8)
def _weights(path: str) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_state_dict(path).items() if v.ndim == 2 and classify(k)}


def distance_to_target(model_dir: Path, target: str, base: str) -> float:
    """Minus the distance of the merged body weights to a target merge's, relative to its update.

    The score is 0 exactly at the target's λ/s point and negative elsewhere.
    """
    merged = {k: v.double() for k, v in load_state_dict(model_dir).items() if k in _weights(target)}
    wanted, pre = _weights(target), _weights(base)
    errors = [(merged[k] - wanted[k]).norm() / (wanted[k] - pre[k]).norm() for k in wanted]
    return -float(sum(errors) / len(errors))


def per_task_scores(model_dir: Path) -> dict[str, float]:
    """Two "tasks" read from the merged weights (deterministic, for summary checks)."""
    weights = load_state_dict(model_dir)
    attention = [v for k, v in weights.items() if "self_attn" in k and v.ndim == 2]
    mlp = [v for k, v in weights.items() if "mlp" in k and v.ndim == 2]
    return {
        "attention": float(sum(v.double().norm() for v in attention)),
        "mlp": float(sum(v.double().norm() for v in mlp)),
    }


def fails_on(model_dir: Path, trials: list[int], nan: bool = False) -> float:
    """Raises (or returns NaN) for the listed trial numbers, 1.0 otherwise."""
    name = Path(model_dir).name
    index = int(name.rsplit("-", 1)[-1]) if name.startswith("trial-") else -1
    if index in trials:
        if nan:
            return math.nan
        raise RuntimeError(f"evaluation blew up on {name}")
    return 1.0 + 0.01 * index


def returns_text(model_dir: Path) -> str:
    return "not a number"


def interrupts_on(model_dir: Path, trial: int) -> float:
    """Acts like Ctrl-C (or SIGTERM through the command) during the given trial's evaluation."""
    if Path(model_dir).name == f"trial-{trial:04d}":
        raise KeyboardInterrupt
    return 1.0
