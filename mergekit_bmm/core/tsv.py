"""TSV-Merge: Task Singular Vectors (Gargiulo et al., CVPR 2025).

Per matrix, each task keeps its top ``k = ⌊r/T⌋`` singular triplets (``r = min(out, in)``);
the kept left and right singular vectors of all tasks are stacked and each stack is
replaced by its closest orthonormal matrix (the polar factor), which removes the
interference between tasks' subspaces while keeping every task's singular values:

    τ_TSV = polar([U_1,k … U_T,k]) · diag(s_1,k … s_T,k) · polar([V_1,k … V_T,k])ᵀ

This equals the reference ``compute_and_sum_svd_mem_reduction`` (which places the same
triplets into zero-padded slots of width r before orthogonalising: zero slots do not change
the polar factor of the others). Signs of singular vectors cancel in the product.

Choices where the reference is silent or arbitrary:
* triplets whose singular value is numerically zero (a task vector of rank < k, an
  all-zero task vector) are left out instead of contributing arbitrary null-space vectors
  to the orthogonalisation; with full-rank task vectors this changes nothing;
* when ``T > r`` (``k = 0``) the reference returns zero; here the matrix falls back to the
  mean of the task vectors, like every tensor the matrix algorithm does not apply to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mergekit_bmm.core.merge_tools import (
    as_matrices,
    mean_task_vector,
    orthonormal_factor,
    singular_value_floor,
)


def tsv_factors(task_vectors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(left, singular_values, right)`` with ``τ_TSV = left · diag(s) · right``.

    ``left`` has orthonormal columns and ``right`` orthonormal rows (over their numerical
    rank): task t's block of columns is orthogonal to every other task's block.
    """
    vectors = as_matrices(task_vectors, "tsv")
    rows, columns = vectors[0].shape
    per_task = min(rows, columns) // len(vectors)
    lefts, values, rights = [], [], []
    for vector in vectors:
        left, singular, right = torch.linalg.svd(vector, full_matrices=False)
        if singular.numel() == 0:
            continue
        tolerance = singular_value_floor(float(singular[0]), vector.shape, vector.dtype)
        kept = min(per_task, int((singular > tolerance).sum()))
        lefts.append(left[:, :kept])
        values.append(singular[:kept])
        rights.append(right[:kept, :])
        del left, singular, right
    if not values or sum(v.numel() for v in values) == 0:
        empty = vectors[0].new_zeros((0,))
        return vectors[0].new_zeros((rows, 0)), empty, vectors[0].new_zeros((0, columns))
    return (
        orthonormal_factor(torch.cat(lefts, dim=1)),
        torch.cat(values),
        orthonormal_factor(torch.cat(rights, dim=0)),
    )


def tsv_merge(task_vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The TSV-M merged task vector of one ``(out, in)`` matrix (before the scale α)."""
    vectors = as_matrices(task_vectors, "tsv")
    if min(vectors[0].shape) < len(vectors):
        return mean_task_vector(vectors)
    left, singular, right = tsv_factors(vectors)
    return (left * singular) @ right
