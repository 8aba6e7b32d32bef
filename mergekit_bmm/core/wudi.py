"""WUDI-Merging v1 (Cheng et al., ICML 2025): per matrix, minimise the interference loss

    L(τ) = Σ_t ‖(τ − τ_t) τ_tᵀ‖²_F / ‖τ_t‖²_F

in which the rows of each task vector stand in for the inputs the task sees. The loss is
quadratic: ``L(τ) = tr(τ C τᵀ) − 2 tr(τ Dᵀ) + const`` with

    C = Σ_t τ_tᵀτ_t / ‖τ_t‖²   (in × in)        D = Σ_t τ_t τ_tᵀτ_t / ‖τ_t‖²   (out × in)

so its gradient is ``2 (τ C − D)`` and its stationary points solve ``τ C = D``.

Two solvers:
* ``adam`` (the reference): from the *sum* of the task vectors, ``iterations`` full-batch
  steps of ``torch.optim.Adam(lr=learning_rate, weight_decay=0)`` (reference: 300 steps at
  1e-5, default betas). The gradient is formed from ``C`` and ``D`` once per matrix — the
  same gradient autograd gives for the reference loss, at ``out·in²`` per step. Early
  stopping is part of the method: the WUDI authors report that running Adam to convergence
  (towards the closed form) loses accuracy.
* ``closed_form``: the exact minimiser ``D C⁺`` (the minimum-norm stationary point, which
  is also where gradient flow from the sum converges: the sum's rows lie in C's range).

The method has no random component (sum init, full batch), so nothing needs a seed: the
same inputs on the same device give bit-identical outputs. A task vector that is exactly
zero contributes nothing (its loss term is 0/0 in the reference; here it is dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from mergekit_bmm.core.merge_tools import as_matrices, solve_normal
from mergekit_bmm.errors import ConfigError

WudiSolver = Literal["adam", "closed_form"]
SOLVERS: tuple[str, ...] = ("adam", "closed_form")


def _weighted(vectors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(τ_t, 1/‖τ_t‖²)`` for the nonzero task vectors."""
    pairs = []
    for vector in vectors:
        norm_squared = vector.square().sum()
        if float(norm_squared) > 0:
            pairs.append((vector, 1.0 / norm_squared))
    return pairs


def wudi_equations(task_vectors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, D)`` of the WUDI loss (see the module docstring)."""
    vectors = as_matrices(task_vectors, "wudi")
    out_features, in_features = vectors[0].shape
    gram = vectors[0].new_zeros((in_features, in_features))
    cross = vectors[0].new_zeros((out_features, in_features))
    for vector, weight in _weighted(vectors):
        task_gram = vector.T @ vector
        gram.add_(task_gram, alpha=float(weight))
        if out_features < in_features:
            cross.add_((vector @ vector.T) @ vector, alpha=float(weight))
        else:
            cross.add_(vector @ task_gram, alpha=float(weight))
        del task_gram
    return gram, cross


def wudi_loss(merged: torch.Tensor, task_vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The WUDI loss of ``merged``, computed literally (one product per task)."""
    vectors = as_matrices(task_vectors, "wudi")
    merged = merged.to(vectors[0].dtype)
    total = merged.new_zeros(())
    for vector, weight in _weighted(vectors):
        total = total + ((merged - vector) @ vector.T).square().sum() * weight
    return total


def wudi_closed_form(task_vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exact minimiser ``D C⁺`` of the WUDI loss."""
    gram, cross = wudi_equations(task_vectors)
    return solve_normal(gram, cross, torch.zeros_like(cross))


def wudi_merge(
    task_vectors: Sequence[torch.Tensor],
    solver: WudiSolver = "adam",
    iterations: int = 300,
    learning_rate: float = 1e-5,
) -> torch.Tensor:
    """The WUDI merged task vector of one ``(out, in)`` matrix (no output scale)."""
    if solver not in SOLVERS:
        raise ConfigError(f"wudi parameter `solver` must be one of {', '.join(SOLVERS)}; got {solver!r}")
    if solver == "closed_form":
        return wudi_closed_form(task_vectors)
    if iterations < 0:
        raise ConfigError(f"wudi parameter `iterations` must be >= 0; got {iterations}")
    if not learning_rate > 0:
        raise ConfigError(f"wudi parameter `learning_rate` must be > 0; got {learning_rate}")
    vectors = as_matrices(task_vectors, "wudi")
    initial = vectors[0].clone()
    for vector in vectors[1:]:
        initial += vector
    if iterations == 0:
        return initial
    gram, cross = wudi_equations(vectors)
    merged = torch.nn.Parameter(initial)
    optimizer = torch.optim.Adam([merged], lr=learning_rate, weight_decay=0.0)
    with torch.no_grad():
        for _ in range(iterations):
            # ∇L = 2 (τ C − D)
            merged.grad = torch.addmm(cross, merged, gram, beta=-2.0, alpha=2.0)
            optimizer.step()
    return merged.detach()
