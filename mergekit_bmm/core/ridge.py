"""How large the ridge λ' is, and whether ``G + λ'I`` is solved as is or by its λ' → 0⁺ limit.

One concern shared by every solve of :mod:`mergekit_bmm.core.closed_form` (Cholesky, eigen
factors, cached trials): λ is dimensionless by default (``λ' = λ·tr(G)/d_in``), eigenvalues at or
below ``d_in·eps·λ_max`` are numerically zero, and a ridge above every diagonal entry of ``G`` is
solved in its scaled form.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from mergekit_bmm.core.normal_equations import NormalEquations
from mergekit_bmm.errors import ConfigError

LambdaMode = Literal["relative", "absolute"]


def ridge_of(lam: float, mean_eigenvalue: float, mode: LambdaMode = "relative") -> float:
    """The ridge λ' added to ``G``: ``λ·tr(G)/d_in`` (relative) or ``λ`` (absolute), in float64.

    ``G = 0`` (every expert equals the base) gives λ' = 0 in relative mode, whatever λ: the
    solution is the anchor then for any ridge.
    """
    if lam < 0 or lam != lam:
        raise ConfigError(f"lambda must be a number >= 0; got {lam}")
    if mode == "relative":
        return float(lam) * mean_eigenvalue if mean_eigenvalue > 0 else 0.0
    if mode == "absolute":
        return float(lam)
    raise ConfigError(f"lambda_mode must be 'relative' or 'absolute'; got {mode!r}")


def effective_ridge(lam: float, equations: NormalEquations, mode: LambdaMode = "relative") -> float:
    """The ridge λ' actually added to ``G`` for these equations."""
    return ridge_of(lam, equations.mean_eigenvalue, mode)


noted_limit = False


def note_zero_ridge_limit(ridge: float, tolerance: float) -> None:
    """Say once per process that a ridge at or below ``G``'s numerical zero met a rank-deficient
    ``G`` and the λ' → 0⁺ limit was used.

    A positive λ gets here too: a small relative λ on a strongly anisotropic Gram (activation
    Grams of real models span many decades) gives a ridge λ' = λ·mean eigenvalue below the
    numerical zero ``eps · λ_max · d_in``; the message says so rather than "lambda 0".
    """
    global noted_limit
    if not noted_limit:
        noted_limit = True
        what = (
            "lambda 0"
            if ridge == 0
            else f"a ridge lambda' = {ridge:.3g} at or below the Gram's numerical zero ({tolerance:.3g})"
        )
        logging.getLogger("mergekit_bmm").warning(
            f"bmm: {what} with a rank-deficient Gram: directions the data do not reach keep the "
            "anchor (the lambda -> 0+ limit, docs/numerics.md); said once"
        )


def ridge_dominates(ridge: float, diagonal_max: float) -> bool:
    """Whether λ' exceeds every diagonal entry of ``G``: then the scaled form is solved."""
    return ridge > max(diagonal_max, 0.0)


def eigenvalue_floor(eigenvalue_max: float, d_in: int, dtype: torch.dtype) -> float:
    """Eigenvalues at or below this are numerically zero (numpy's pinv convention)."""
    return max(eigenvalue_max, 0.0) * d_in * torch.finfo(dtype).eps


def diagonal_max(gram: torch.Tensor) -> float:
    # max(diag) is a cheap stand-in for λ_max (within a factor d_in, no eigensolve).
    return float(torch.diagonal(gram).max()) if gram.numel() else 0.0


def ridge_is_regular(ridge: float, diagonal_max: float, d_in: int, dtype: torch.dtype) -> bool:
    """Whether ``G + λ'I`` is solved as is (True) or by the λ' → 0⁺ limit (False)."""
    return ridge > eigenvalue_floor(diagonal_max, d_in, dtype)
