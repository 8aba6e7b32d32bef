"""Helpers shared by the anchor merges: input checks, the mean fallback, rank-aware polar factors.

SVD-based merges are made deterministic here. Singular vectors are unique only up to sign
(and up to rotation inside a repeated singular value); the merges below only ever use
products in which those choices cancel. What does *not* cancel is a direction whose singular
value is (numerically) zero: the SVD routine fills such directions with arbitrary orthonormal
vectors, and a different library, device or thread count picks different ones. Every
function in this package therefore drops directions with singular values at or below
:func:`singular_value_floor` instead of letting them reach the output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mergekit_bmm.errors import TensorInputError


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the anchors compute in: the input's, promoted to at least float32."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def as_matrices(task_vectors: Sequence[torch.Tensor], method: str) -> list[torch.Tensor]:
    """Validated ``(out, in)`` task vectors of one shape and device, in the compute dtype."""
    if not task_vectors:
        raise TensorInputError(f"{method} needs at least one task vector")
    first = task_vectors[0]
    if first.ndim != 2:
        raise TensorInputError(f"{method} merges 2D weights; got a tensor of shape {tuple(first.shape)}")
    for index, vector in enumerate(task_vectors):
        if vector.shape != first.shape:
            raise TensorInputError(
                f"{method}: task vector {index} has shape {tuple(vector.shape)}, "
                f"expected {tuple(first.shape)}"
            )
        if vector.device != first.device:
            raise TensorInputError(f"{method}: task vectors lie on different devices")
    dtype = compute_dtype(first.dtype)
    return [vector.to(dtype) for vector in task_vectors]


def mean_task_vector(task_vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fallback for tensors the matrix algorithms do not apply to (as the references do)."""
    if not task_vectors:
        raise TensorInputError("the mean of task vectors needs at least one task vector")
    dtype = compute_dtype(task_vectors[0].dtype)
    total = task_vectors[0].to(dtype).clone()
    for vector in task_vectors[1:]:
        total += vector.to(dtype)
    return total / len(task_vectors)


def singular_value_floor(scale: float, shape: Sequence[int], dtype: torch.dtype) -> float:
    """Singular values at or below ``√max(m, n)·eps·scale`` are numerically zero.

    ``scale`` is the largest singular value. Rounding leaves the singular values of an exactly
    rank-deficient float32 sum of task vectors at about 2·eps·s_max (64×64) to 8·eps·s_max
    (2048×512), measured; this cut sits above that. numpy's ``matrix_rank`` rule
    (``max(m, n)·eps``) would be too coarse here: a genuine singular value of a square
    64×64 sum at 2e-6·s_max (computed to 0.5% in float32) lies below it, and ISO gives every
    kept direction the same weight, so dropping one changes the result by ``1/√r``.
    """
    return max(float(scale), 0.0) * math.sqrt(max(shape)) * torch.finfo(dtype).eps


def orthonormal_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor ``P Qᵀ`` of the polar decomposition, over the numerical range.

    For a matrix of full column (or row) rank this is the usual polar factor — the closest
    matrix with orthonormal columns (rows), which is how TSV and ISO-CTS orthogonalise their
    stacked singular vectors. When the matrix is rank-deficient (two experts with identical
    singular vectors), the polar factor is not unique; the partial isometry over the
    nonzero singular values is, and it is what this returns.
    """
    left, singular, right = torch.linalg.svd(matrix, full_matrices=False)
    if singular.numel() == 0:
        return torch.zeros_like(matrix)
    kept = singular > singular_value_floor(float(singular[0]), matrix.shape, matrix.dtype)
    return left[:, kept] @ right[kept, :]


def solve_normal(gram: torch.Tensor, cross: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``cross · gram⁻¹`` for a symmetric PSD ``gram``: the stationary point of a quadratic merge.

    Cholesky when ``gram`` is numerically nonsingular (every pivot above the zero tolerance
    of :func:`mergekit_bmm.core.closed_form.eigenvalue_floor`). Otherwise the exact λ → 0⁺ limit
    of the ridge solution from :mod:`mergekit_bmm.core.closed_form`: the pseudo-inverse solution
    in the directions ``gram`` sees, and ``fallback`` in the directions it does not.
    """
    from mergekit_bmm.core import closed_form
    from mergekit_bmm.core.normal_equations import NormalEquations

    d_in = gram.shape[-1]
    scale = float(torch.diagonal(gram).max()) if gram.numel() else 0.0
    tolerance = closed_form.eigenvalue_floor(scale, d_in, gram.dtype)
    if scale > 0:
        factor, info = torch.linalg.cholesky_ex(gram)
        if int(info) == 0 and float(torch.diagonal(factor).square().min()) > tolerance:
            return torch.cholesky_solve(cross.T, factor).T
    equations = NormalEquations(gram, cross)
    return closed_form.solve(equations, fallback, 0.0)
