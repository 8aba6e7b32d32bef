"""Python-callable evaluators used by the search tests (importable as ``search_objectives:...``).

Weight-reading objectives take the live model (``input: model``, the default) or, when called
directly, a folder; the ones that need the trial's folder name take ``input: folder``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import torch

from mergekit_bmm.core.module_map import classify
from mergekit_bmm.io.checkpoint import load_state_dict

# A search.yml's `evaluator:` that scores trials with per_task_scores below.
EVALUATOR = {
    "type": "python",
    "callable": "search_objectives:per_task_scores",
    "python_path": [str(Path(__file__).parent)],
}


def _state(model) -> dict[str, torch.Tensor]:
    """The merged weights of a live model, or of a model folder."""
    if isinstance(model, (str, Path)):
        return load_state_dict(model)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@lru_cache(maxsize=8)
def _weights(path: str) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_state_dict(path).items() if v.ndim == 2 and classify(k)}


def distance_to_target(model, tokenizer, target: str, base: str) -> float:
    """Minus the distance of the merged body weights to a target merge's, relative to its update.

    The score is 0 exactly at the target's λ/s point and negative elsewhere.
    """
    merged = {k: v.double() for k, v in _state(model).items() if k in _weights(target)}
    wanted, pre = _weights(target), _weights(base)
    errors = [(merged[k] - wanted[k]).norm() / (wanted[k] - pre[k]).norm() for k in wanted]
    return -float(sum(errors) / len(errors))


def per_task_scores(model, tokenizer=None) -> dict[str, float]:
    """Two "tasks" read from the merged weights (deterministic, for summary checks)."""
    weights = _state(model)
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


def returns_text(model, tokenizer) -> str:
    return "not a number"


def interrupts_on(model_dir: Path, trial: int) -> float:
    """Acts like Ctrl-C (or SIGTERM through the command) during the given trial's evaluation."""
    if Path(model_dir).name == f"trial-{trial:04d}":
        raise KeyboardInterrupt
    return 1.0


def _first_to_mark(marker: str) -> bool:
    """Creates ``marker`` atomically: True in exactly one of the processes that race for it."""
    try:
        with open(marker, "x") as handle:
            handle.write("marked")
    except FileExistsError:
        return False
    return True


def kills_its_worker_once(model, tokenizer, marker: str, on_call: int = 2) -> dict[str, float]:
    """Scores like ``per_task_scores``, but the process dies (SIGKILL) on its ``on_call``-th call
    unless ``marker`` exists; it creates the marker first, so the trial's re-run succeeds."""
    import os
    import signal

    _calls.append(1)
    if len(_calls) == on_call and _first_to_mark(marker):
        os.kill(os.getpid(), signal.SIGKILL)
    return per_task_scores(model, tokenizer)


def sleeps(model, tokenizer, seconds: float) -> float:
    """A slow evaluation (for interrupting a search mid-trial)."""
    import time

    time.sleep(seconds)
    return 1.0


_calls: list[int] = []


def hangs_once(model, tokenizer, marker: str, seconds: float = 600.0) -> dict[str, float]:
    """Hangs (sleeps ``seconds``) on its first call anywhere, marked by creating ``marker``;
    later calls, in any process, score like ``per_task_scores``."""
    import time

    if _first_to_mark(marker):
        time.sleep(seconds)
    return per_task_scores(model, tokenizer)
