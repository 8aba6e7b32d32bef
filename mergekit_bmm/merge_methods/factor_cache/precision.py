"""The stored precision of each cached factor, chosen against the float64 factors at the fill.

A factor may be stored in 16 bits as *fixed point*: each column divided by its largest
magnitude over 32767 and rounded to int16, the scales kept in float32 (a basis: each block of
256 rows of a column by its own largest magnitude, :mod:`mergekit_bmm.core.fixed_point`). Its
entries are dense and of one scale (eigenvectors, corrections, task vectors), so fixed point
rounds them about 7× more finely than float16 at the same two bytes. Rounding reaches the merged weight
``W = W_pre + s·(U0 + (E Q·a) Qᵀ)`` as

* anchor ``U0``: ``s·‖ΔU0‖`` (exactly, for any λ);
* correction ``E Q``: ``s·‖ΔEQ·a‖`` (exactly: ``Q`` is orthonormal), largest at the smallest λ;
* basis ``Q``: about ``s·(Σ_i ‖(EQ·a)_i‖²·‖ΔQ_i‖²)^½`` over its columns ``i`` (the correction
  is formed in the exact basis, so the basis' rounding only turns the result, and rounding
  errors are independent of ``EQ·a``).

An anchor in the span of a thin basis may be stored as its coordinates ``U0·Q`` (``out × r``
instead of ``out × in``; :func:`shares_in_basis`): their rounding is the anchor's share, and the
basis then turns ``U0·Q + EQ·a``, so its share grows by the anchor's (measured at the budget's λ
and at λ → ∞, where ``a = 0``).

With ``cache_dtype: auto`` (the default) every factor starts in int16; where the three shares
added in quadrature exceed ``TOLERANCE·‖W_pre‖`` at the corner of the default search boxes where
they are largest (``λ = LAMBDA_FLOOR`` relative, or the merge's own λ if smaller;
``s = max(SCALE_CEILING, |s|)``), the factors whose move to float32 brings the rest within it at
the fewest bytes move. So no trial inside those boxes moves a merged weight by more than about
``TOLERANCE`` relative to float32 factors (the tests and the ``cache_fit`` workload check the
actual error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import torch

from mergekit_bmm.core import fixed_point

TOLERANCE = 1e-5
LAMBDA_FLOOR = 1e-3
SCALE_CEILING = 2.2
FIXED_POINT = torch.int16
_STEPS = 32767.0


def encode(
    matrix: torch.Tensor, dtype: torch.dtype, blocks: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``matrix`` as stored in ``dtype``: float16 or int16 with per-column scales (float32); with
    ``blocks``, int16 with a scale per column and block of rows (:mod:`mergekit_bmm.core.fixed_point`)."""
    if dtype not in (torch.float16, FIXED_POINT):
        return matrix.to(dtype), None
    if blocks and dtype == FIXED_POINT and matrix.shape[0] > fixed_point.BLOCK_ROWS:
        scale = fixed_point.block_scales(matrix, _STEPS).to(torch.float32)
        steps = fixed_point.scale_rows(matrix.clone(), 1.0 / scale.to(matrix.dtype))
        return torch.round(steps).clamp_(-_STEPS, _STEPS).to(FIXED_POINT), scale
    largest = matrix.abs().amax(dim=0)
    largest = torch.where(largest > 0, largest, torch.ones_like(largest))
    if dtype == torch.float16:
        scale = largest.to(torch.float32)
        return (matrix / scale.to(matrix.dtype)).to(torch.float16), scale
    scale = (largest / _STEPS).to(torch.float32)
    steps = torch.round(matrix / scale.to(matrix.dtype)).clamp_(-_STEPS, _STEPS)
    return steps.to(FIXED_POINT), scale


def decode(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The matrix a stored factor stands for, in ``dtype``."""
    matrix = stored.to(dtype)
    if scale is not None and scale.ndim == 2:  # a scale per block of rows
        return fixed_point.scale_rows(matrix if matrix is not stored else matrix.clone(), scale)
    return matrix if scale is None else matrix * scale.to(dtype)


def rounding_error(matrix: torch.Tensor, dtype: torch.dtype, blocks: bool = False) -> torch.Tensor:
    """What storing ``matrix`` in ``dtype`` changes it by (in ``matrix``'s dtype)."""
    return decode(*encode(matrix, dtype, blocks), matrix.dtype) - matrix


@dataclass(frozen=True)
class Budget:
    """How much error the factors together may add to ``W``, and the ``a`` of the worst λ."""

    allowance: float
    weights: torch.Tensor  # a = 1/(Λ + λ'_floor), float64

    @classmethod
    def of(cls, base_norm: float, scale: float, weights: torch.Tensor) -> Budget:
        worst_scale = max(SCALE_CEILING, abs(scale))
        return cls(TOLERANCE * base_norm / worst_scale, weights.to(torch.float64))


def shares(
    correction: torch.Tensor, anchor: torch.Tensor | None, budget: Budget, basis_columns: torch.Tensor
) -> dict[str, float]:
    """What storing each factor in int16 adds to ``W`` (per unit s) at the budget's λ; the
    basis' rounding moves its columns by ``basis_columns`` (``‖ΔQ_i‖``). No anchor: ``U0 = 0``."""
    turned = (correction * budget.weights).norm(dim=0) * basis_columns.to(correction.dtype)
    return {
        "anchor": 0.0 if anchor is None else float(rounding_error(anchor, FIXED_POINT).norm()),
        "correction": float(rounding_error(correction, FIXED_POINT).mul_(budget.weights).norm()),
        "basis": float(turned.norm()),
    }


def shares_in_basis(
    correction: torch.Tensor, coordinates: torch.Tensor, budget: Budget, basis_columns: torch.Tensor
) -> dict[str, float]:
    """As :func:`shares`, for an anchor held as its coordinates ``U0·Q`` in the basis."""
    columns = basis_columns.to(correction.dtype)
    near = (correction * budget.weights + coordinates).norm(dim=0) * columns
    far = coordinates.norm(dim=0) * columns
    return {
        "anchor": float(rounding_error(coordinates, FIXED_POINT).norm()),
        "correction": float(rounding_error(correction, FIXED_POINT).mul_(budget.weights).norm()),
        "basis": max(float(near.norm()), float(far.norm())),
    }


def stored_bytes(chosen: dict[str, torch.dtype], sizes: dict[str, int]) -> int:
    """What the factors take on disk at the ``chosen`` precisions (scales aside)."""
    return sum(sizes[name] * torch.empty((), dtype=chosen[name]).element_size() for name in sizes)


def choose(
    errors: dict[str, float], budget: Budget, basis_precision: torch.dtype, sizes: dict[str, int]
) -> dict[str, torch.dtype]:
    """Per factor, int16 or float32: of the sets of factors whose move to float32 keeps the budget,
    the one that adds the fewest bytes (``sizes``: each factor's entries); the basis is offered as
    ``basis_precision`` (the result's ``basis`` says whether it may stay so).

    Cheapest, not largest share first: at the Llama-3.2-1B shape ``down_proj``'s three shares were
    1.5 % over the budget together, and moving its largest (the 8192 × 6144 basis) cost four times
    what moving the correction (2048 × 6144) did, for the same guarantee."""
    shares = dict(errors, basis=errors["basis"] if basis_precision == FIXED_POINT else 0.0)
    candidates = ["anchor", "correction"] + (["basis"] if basis_precision == FIXED_POINT else [])
    best: tuple[str, ...] | None = None
    for count in range(len(candidates) + 1):
        for moved in combinations(candidates, count):
            kept = [shares[name] for name in candidates if name not in moved]
            if math.hypot(*kept) <= budget.allowance and (
                best is None or sum(sizes[n] for n in moved) < sum(sizes[n] for n in best)
            ):
                best = moved
    chosen = {"anchor": FIXED_POINT, "correction": FIXED_POINT, "basis": basis_precision}
    return {**chosen, **dict.fromkeys(candidates if best is None else best, torch.float32)}
