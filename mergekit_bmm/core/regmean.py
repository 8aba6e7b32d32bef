"""RegMean (Jin et al., ICLR 2023): merge a linear layer as the least-squares fit to every
task's outputs on that task's inputs, from per-task input Grams ``G_t = X_tᵀX_t / N_t``:

    W* = (Σ_t W_t G̃_t)(Σ_t G̃_t)⁻¹        G̃_t = α·G_t + (1 − α)·diag(G_t)

``α`` (here ``off_diagonal_scale``; ``reduce_non_diagonal_ratio`` in the reference code)
shrinks the off-diagonal entries: ``α = 1`` is plain RegMean, ``α = 0`` a per-input-feature
weighted average. Since ``Σ G̃_t (Σ G̃_t)⁻¹ = I``, RegMean on full weights equals
``W_pre +`` RegMean on task vectors, which is what is computed here (and what BMM needs as
``U0``).

When ``Σ G̃_t`` is singular (α = 1 with fewer calibration tokens than input features,
input features that are never active), the directions no task's data reach keep the mean
of the task vectors — the same fallback RegMean uses for every parameter it does not
regress — and the others get the pseudo-inverse solution. Identical Grams therefore give
exactly the average, singular or not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mergekit_bmm.core.merge_tools import as_matrices, mean_task_vector, solve_normal
from mergekit_bmm.errors import ConfigError, TensorInputError

DEFAULT_OFF_DIAGONAL_SCALE = 0.5


def shrink_off_diagonal(gram: torch.Tensor, off_diagonal_scale: float) -> torch.Tensor:
    """``α·G + (1 − α)·diag(G)``: off-diagonal entries times α, the diagonal unchanged."""
    if not 0.0 <= off_diagonal_scale <= 1.0:
        raise ConfigError(
            f"regmean parameter `off_diagonal_scale` must lie in [0, 1]; got {off_diagonal_scale}"
        )
    if off_diagonal_scale == 1.0:
        return gram
    shrunk = gram * off_diagonal_scale
    shrunk.diagonal().copy_(torch.diagonal(gram))
    return shrunk


def regmean_merge(
    task_vectors: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    off_diagonal_scale: float = DEFAULT_OFF_DIAGONAL_SCALE,
) -> torch.Tensor:
    """The RegMean merged task vector of one ``(out, in)`` matrix from its input Grams."""
    vectors = as_matrices(task_vectors, "regmean")
    if len(grams) != len(vectors):
        raise TensorInputError(f"regmean got {len(grams)} Grams for {len(vectors)} task vectors")
    from mergekit_bmm.core.normal_equations import activation_equations

    dtype, device = vectors[0].dtype, vectors[0].device
    in_features = vectors[0].shape[1]
    shrunk = [
        shrink_off_diagonal(gram.to(device=device, dtype=dtype), off_diagonal_scale)
        if gram.shape == (in_features, in_features)
        else gram  # activation_equations names the misfit
        for gram in grams
    ]
    equations = activation_equations(vectors, shrunk, dtype)
    return solve_normal(equations.gram, equations.cross, mean_task_vector(vectors))
