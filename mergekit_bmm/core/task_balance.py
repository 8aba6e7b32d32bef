"""Task balance: how much each task's statistics weigh in BMM's Gram and cross term.

The data-free Gram ``Σ_t U_tᵀU_t`` weighs task t by the size of its update, so an expert trained
longer or with a larger learning rate dominates the regression whatever its importance; the
activation Grams are per-task means, but their scales differ with each expert's activations.
``task_balance`` divides task t's Gram *and* its cross term by a size ``n_t`` before the sum:

* ``none`` (default): as before;
* ``trace``: ``n_t = tr(G_t)`` (data-free: ``‖U_t‖²_F``);
* ``frobenius``: ``n_t = ‖G_t‖_F`` (data-free: ``‖U_tᵀU_t‖_F``);
* ``adaptive``: ACE-Merging's rule — ``trace`` when the tasks' traces are heterogeneous
  (``γ = Var(log n) / mean(log n)² > 0.3``, unbiased variance), else ``none``.

Weights are ``w_t = mean_s(n_s) / n_t``, so the sizes average as before and an absolute λ keeps
its scale (with the default relative λ only the ratios matter). A task with ``n_t = 0`` adds
nothing whatever its weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

BALANCE_MODES = ("none", "trace", "frobenius", "adaptive")
GAMMA_THRESHOLD = 0.3
_TINY = 1e-12


def heterogeneous(sizes: Sequence[float]) -> bool:
    """ACE-Merging's test: do the tasks' sizes differ enough to normalise each (γ > 0.3)?"""
    if len(sizes) < 2:
        return False
    logs = [math.log(size + _TINY) for size in sizes]
    mean = sum(logs) / len(logs)
    variance = sum((value - mean) ** 2 for value in logs) / (len(logs) - 1)
    return variance / (mean * mean + _TINY) > GAMMA_THRESHOLD


def size_kind(mode: str) -> str | None:
    """Which size the mode divides by: ``trace``, ``frobenius`` or None (no balance)."""
    if mode not in BALANCE_MODES:
        raise ValueError(f"task_balance must be one of {', '.join(BALANCE_MODES)}; got {mode!r}")
    return {"none": None, "trace": "trace", "frobenius": "frobenius", "adaptive": "trace"}[mode]


def balance_weights(sizes: Sequence[float], mode: str) -> list[float]:
    """The weight of each task's Gram and cross term (``sizes``: the kind :func:`size_kind` names)."""
    if size_kind(mode) is None or (mode == "adaptive" and not heterogeneous(sizes)):
        return [1.0] * len(sizes)
    positive = [size for size in sizes if size > 0]
    if not positive:
        return [1.0] * len(sizes)
    mean = sum(positive) / len(positive)
    return [mean / size if size > 0 else 1.0 for size in sizes]
