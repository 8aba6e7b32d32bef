"""ACE-Merging (Xu et al., CVPR 2026, arXiv 2603.02945): covariances estimated from the task vectors.

Under a local linear model the input covariance of task t shows in the rows of its update, so
``Σ_t ∝ τ̄_tᵀτ̄_t`` (``τ̄_t``: ``τ_t`` with its mean row removed) stands in for the data in the
RegMean-style closed form ``(Σ τ_t Σ_t)(Σ Σ_t)⁻¹``. As the authors' public code does, per weight:

1. **Adaptive normalisation.** With ``c_t = ‖τ_t‖²_F``, ``γ = Var(log c) / mean(log c)²`` (unbiased
   variance over tasks; :func:`mergekit_bmm.core.task_balance.heterogeneous`). When ``γ > 0.3`` the
   tasks' scales are heterogeneous and each
   ``Σ_t`` (and its ridge ``ε``) is divided by its trace, so that every task weighs the same.
2. **Collective structural prior.** The column means of ``Σ_t Σ_t`` (divided by the mean ``c_t``
   when normalised) are added to every row of the system matrix.
3. The closed form ``W₀ = (Σ_t τ̄_t (Σ_t + ε_t I)) (Σ_t (Σ_t + ε_t I) + 1·cᵀ)⁻¹``.
4. **Spectral refinement** (normalised case only): the top ``⌊k_frac · r⌋`` singular directions of
   ``W₀ + Σ_t τ_t (Σ_t − Σ̄)`` are added to ``W₀`` with one common singular value, their mean.

Defaults follow the public code: ``ε = 1e-2``, ``k_frac = 0.3``; its output scale is 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mergekit_bmm.core.finite import all_finite
from mergekit_bmm.core.merge_tools import as_matrices
from mergekit_bmm.core.task_balance import heterogeneous

DEFAULT_RIDGE = 1e-2
DEFAULT_RANK_FRACTION = 0.3
_TINY = 1e-12


def heterogeneous_scales(task_vectors: Sequence[torch.Tensor]) -> bool:
    """Whether the tasks' update sizes differ enough (γ > 0.3) to normalise each covariance
    (the rule bmm's ``task_balance: adaptive`` shares)."""
    return heterogeneous([float(vector.square().sum()) for vector in task_vectors])


def ace_merge(
    task_vectors: Sequence[torch.Tensor],
    ridge: float = DEFAULT_RIDGE,
    rank_fraction: float = DEFAULT_RANK_FRACTION,
) -> torch.Tensor:
    """The ACE-Merging task vector of one ``(out, in)`` weight (before the output scale)."""
    vectors = as_matrices(task_vectors, "ace")
    normalise = heterogeneous_scales(vectors)
    d_in = vectors[0].shape[1]
    identity = torch.eye(d_in, dtype=vectors[0].dtype, device=vectors[0].device)
    covariances, cross, system = [], torch.zeros_like(vectors[0]), torch.zeros_like(identity)
    for vector in vectors:
        centred = vector - vector.mean(dim=0, keepdim=True)
        covariance = centred.T @ centred
        trace = float(torch.trace(covariance)) + _TINY
        task_ridge = ridge / trace if normalise else ridge
        if normalise:
            covariance = covariance / trace
        covariances.append(covariance)
        regularised = covariance + task_ridge * identity
        cross += centred @ regularised
        system += regularised
    prior = sum(covariances).mean(dim=0, keepdim=True)
    if normalise:
        prior = prior / (sum(float(vector.square().sum()) for vector in vectors) / len(vectors) + _TINY)
    merged = _right_solve(cross, system + prior)
    if not normalise:
        return merged
    mean_system = system / len(vectors)
    fused = merged + sum(
        vector @ (covariance - mean_system) for vector, covariance in zip(vectors, covariances)
    )
    left, singular, right = torch.linalg.svd(fused, full_matrices=False)
    keep = int(singular.numel() * rank_fraction)
    if keep == 0:
        return merged
    return merged + singular[:keep].mean() * (left[:, :keep] @ right[:keep, :])


def _right_solve(cross: torch.Tensor, system: torch.Tensor) -> torch.Tensor:
    """``cross · system⁻¹`` (``system`` is not symmetric: the prior is added to its rows)."""
    solution, info = torch.linalg.solve_ex(system.T, cross.T)
    if int(info) == 0 and all_finite(solution):
        return solution.T
    return cross @ torch.linalg.pinv(system)
