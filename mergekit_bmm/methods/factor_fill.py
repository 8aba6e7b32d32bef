"""Building one solved tensor's cache entry: its Gram's basis (shared when it exists) and factors.

The first merge of a tensor with ``cache:`` diagonalises ``G`` in float64 — unless a basis of
the very same ``G`` is already stored (another weight reading the same input, in the
``activations`` mode), which is then reused — forms the correction ``(C − U0 G) Q`` in
float64 and stores each factor at the precision :mod:`~mergekit_bmm.methods.factor_precision`
chooses. It returns exactly what a later read of the entry gives.
"""

from __future__ import annotations

import torch

from mergekit_bmm.core import closed_form
from mergekit_bmm.core.closed_form import EigenFactors, NormalEquations
from mergekit_bmm.methods import cache_key, factor_precision
from mergekit_bmm.methods.bmm_parameters import BMMSettings
from mergekit_bmm.methods.factor_cache import FactorCache

EXACT = torch.float64
AUTO_BASES = (factor_precision.FIXED_POINT, torch.float32)


def thin_rank(settings: BMMSettings, tasks: int, out_features: int, in_features: int) -> int | None:
    """A bound on ``G``'s rank below ``in`` (data-free ``G = Σ U_tᵀU_t`` has rank ≤ ``T·out``)."""
    if settings.gram == "data_free" and tasks * out_features < in_features:
        return tasks * out_features
    return None


def _budget(settings: BMMSettings, exact: EigenFactors, base: torch.Tensor) -> factor_precision.Budget:
    ridge = exact.ridge(settings.lam, settings.lambda_mode)
    floor = min(ridge, factor_precision.LAMBDA_FLOOR * max(exact.mean_eigenvalue, 0.0))
    weights = closed_form.correction_weights(exact, floor, folded=False)
    return factor_precision.Budget.of(float(base.to(EXACT).norm()), settings.scale, weights)


def _exact(
    equations: NormalEquations, eigenvalues: torch.Tensor, basis: torch.Tensor, residual, anchor
) -> EigenFactors:
    return EigenFactors(
        basis=basis,
        eigenvalues=eigenvalues.to(EXACT),
        correction=residual @ basis,
        anchor=anchor,
        mean_eigenvalue=equations.mean_eigenvalue,
        diagonal_max=float(torch.diagonal(equations.gram).max()) if equations.gram.numel() else 0.0,
    )


def fill_factors(
    cache: FactorCache,
    name: str,
    key: str,
    equations: NormalEquations,
    prior: torch.Tensor,
    base: torch.Tensor,
    settings: BMMSettings,
    rank: int | None,
) -> EigenFactors:
    """Store ``name``'s factors under ``key`` and return them as a later read would.

    The correction is always formed in the basis as stored (rounded), whether that basis was
    just computed or read: a refill gives the same bits as the first fill.
    """
    compute, fixed = settings.compute_dtype, settings.cache_dtype
    gram = cache_key.gram_key(equations.gram, rank)
    anchor = prior.to(EXACT)
    residual = equations.cross.to(EXACT) - anchor @ equations.gram.to(EXACT)
    candidates = (fixed,) if fixed is not None else AUTO_BASES

    def factors_in(eigenvalues: torch.Tensor, basis: torch.Tensor, precision: torch.dtype, rounding: float):
        exact = _exact(equations, eigenvalues.to(compute), basis, residual, anchor)
        if fixed is not None:
            return exact, dict.fromkeys(("anchor", "correction", "basis"), fixed)
        budget = _budget(settings, exact, base)
        return exact, factor_precision.choose(exact.correction, anchor, budget, precision, rounding)

    for precision in candidates:  # a stored basis of the same G, the cheapest that fits
        stored = cache.load_basis(gram, equations.d_in, compute, (precision,))
        if stored is not None:
            exact, chosen = factors_in(stored.eigenvalues, stored.decoded(EXACT), precision, stored.rounding)
            if chosen["basis"] == precision:
                break
    else:
        eigenvalues, vectors = closed_form.diagonalise(equations.gram, EXACT, rank)
        for precision in candidates:
            rounded = factor_precision.decode(*factor_precision.encode(vectors, precision), EXACT)
            rounding = factor_precision.basis_rounding(vectors, precision)
            exact, chosen = factors_in(eigenvalues, rounded, precision, rounding)
            if chosen["basis"] == precision:
                break
        stored = cache.store_basis(gram, eigenvalues, vectors, precision, rounding, compute)
    scalars = {"mean_eigenvalue": exact.mean_eigenvalue, "diagonal_max": exact.diagonal_max}
    return cache.store_factors(name, key, stored, gram, exact.correction, anchor, chosen, scalars, compute)
