"""The BMM closed form for one weight matrix, in pure torch (no mergekit import).

Notation (paper Sec. 4.1/4.3): task vectors ``U_t`` and the anchor ``U0`` are
``(out, in)`` matrices. The MAP merge solves the normal equations
(:mod:`mergekit_bmm.core.normal_equations` builds them)

    U (G + λ' I) = C + λ' U0

with ``G`` an ``(in, in)`` Gram and ``C`` an ``(out, in)`` cross term:

* data-free: ``G = Σ U_tᵀU_t`` and ``C = Σ U_t U_tᵀU_t``;
* data-assisted: ``G = Σ G_t`` and ``C = Σ U_t G_t`` with ``G_t`` the activation Gram of
  task t (``Y Xᵀ = Σ U_t X_t X_tᵀ``);
* mix: ``ε·Ĝ_few + (1-ε)·Ĝ_df`` where each estimate (Gram and cross term alike) is first
  divided by its Gram's mean eigenvalue ``tr(G)/d_in`` so that ε is a true interpolation
  weight between two quantities of the same scale.

λ is dimensionless by default: the ridge actually used is ``λ' = λ·tr(G)/d_in``.

Singular systems: eigenvalues of ``G`` below ``d_in·eps·λ_max`` are treated as exact
zeros. In those directions the data carry no information and the solution keeps the
anchor, which is the λ' → 0⁺ limit of the MAP (``U = C G⁺ + U0 (I - G G⁺)``). This makes
λ = 0 well defined on a rank-deficient ``G`` (few-shot statistics, T·out < in) instead
of producing NaN.

Large ridges: once λ' exceeds every diagonal entry of ``G`` the system is solved in its
scaled form ``U (G/λ' + I) = C/λ' + U0``, equal in exact arithmetic and finite for any
λ' (``λ' I`` itself overflows float32 near 3e38): the anchor is the limit λ → ∞.

The ridge's size and regularity live in :mod:`mergekit_bmm.core.ridge`; ``LambdaMode``,
``effective_ridge``, ``eigenvalue_floor`` and ``ridge_of`` are still importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from mergekit_bmm.core import fixed_point
from mergekit_bmm.core.evidence import AUTO_LAMBDA, EvidenceChoice, EvidenceTerms, choose, terms_of
from mergekit_bmm.core.normal_equations import NormalEquations
from mergekit_bmm.core.ridge import (
    LambdaMode,
    diagonal_max,
    effective_ridge,
    eigenvalue_floor,
    note_zero_ridge_limit,
    ridge_dominates,
    ridge_is_regular,
    ridge_of,
)
from mergekit_bmm.errors import ConfigError, TensorInputError


@dataclass(frozen=True)
class EigenFactors:
    """``G = Q Λ Qᵀ``, the correction ``E Q = (C − U0 G) Q`` and the anchor ``U0``: all a new λ needs.

    ``U(λ') = U0 + (E Q · a) Qᵀ`` with ``a = 1/(Λ + λ')``: the anchor is kept apart and only
    the correction goes through the basis. This equals ``(C Q·a + U0 Q·b) Qᵀ`` with
    ``b = λ'/(Λ+λ')`` (the paper's form) because ``1 − Λa = b``, and it needs no ``U0 Q``:
    directions the basis leaves out keep the anchor exactly. So the basis may be *thin*
    (``in × r``): when ``G`` has rank at most ``r < in`` (data-free, ``T·out < in``) the other
    directions have ``Λ = 0`` and ``E Q = 0`` and are dropped.

    Where :func:`solve` would take its eigen fallback (λ' at or below the zero tolerance of
    ``max diag G``), eigenvalues below the zero tolerance get ``a = 0`` (the anchor), exactly
    as that fallback does; above it no eigenvalue is clipped, as in the Cholesky solve.

    Factors may be stored at a lower precision than the solve (16 bits in a cache: int16
    fixed point or float16), as matrices whose columns are multiplied by ``*_scale``
    vectors; the scales are folded into ``a`` (or applied while adding the anchor), so no
    rescaled copy of a matrix is made. The eigenvalues' dtype is the dtype of the solve.
    """

    basis: torch.Tensor
    eigenvalues: torch.Tensor
    correction: torch.Tensor
    anchor: torch.Tensor | None  # None: in the basis' span (``anchor_in_basis``), or 0 when that is None too
    mean_eigenvalue: float
    diagonal_max: float | None = None
    basis_scale: torch.Tensor | None = None
    correction_scale: torch.Tensor | None = None
    anchor_scale: torch.Tensor | None = None
    evidence: EvidenceTerms | None = None  # what λ: auto needs (None: the inputs cannot tell)
    # Eigenvalues at or below it are numerically zero. None: those of a d_in × d_in eigensolve in
    # the eigenvalues' dtype (eigenvalue_floor). The LoRA subspace route sets it from its own
    # k × k float64 eigenproblem, whose eigenvalues are exact far below a float32 d_in floor.
    zero_floor: float | None = None
    # ``U0 = anchor_in_basis @ basisᵀ`` (``d_out × rank``), set instead of ``anchor`` when the anchor
    # lies in the span of a thin basis (the LoRA route's Task Arithmetic anchor, a data-free Task
    # Arithmetic anchor): ``U`` is then one product, and a cache stores ``out × rank`` instead of
    # ``out × in``. Neither set: ``U0 = 0`` (the base as anchor).
    anchor_in_basis: torch.Tensor | None = None
    anchor_in_basis_scale: torch.Tensor | None = None
    # ``U = rows @ U_k`` (``d_out × k``): these factors are then those of a ``k``-row problem whose
    # rows the update is a combination of (the LoRA data route's stacked ``B_t``; ``k = Σ r_t``), and
    # a trial costs ``k × in × r`` plus ``out × k × in`` instead of ``out × in × r``.
    rows: torch.Tensor | None = None
    # ``anchor`` is ``U0`` as the merge recomputed it from its inputs, not read from a cache entry
    # (a marked input, Task Arithmetic): an entry that says so stores no anchor at all
    anchor_recomputed: bool = False

    @property
    def d_in(self) -> int:
        return self.basis.shape[0]

    @property
    def rank(self) -> int:
        """Columns of the basis: ``d_in``, or fewer for a thin basis."""
        return self.basis.shape[1]

    def to(self, device: torch.device | str | torch.dtype) -> EigenFactors:
        """The same factors on ``device``, or in a dtype (no copy when already so)."""
        moved = {
            field.name: value.to(device) if isinstance(value, torch.Tensor) else value  # evidence stays
            for field in fields(self)
            if (value := getattr(self, field.name)) is not None or field.name == "anchor"
        }
        return EigenFactors(**moved)

    def with_dense_anchor(self) -> EigenFactors:
        """The same factors with ``U0`` as a dense matrix (a zero matrix for the base)."""
        if self.anchor is not None:
            return self
        dtype = self.eigenvalues.dtype
        if self.anchor_in_basis is None:
            anchor = self.correction.new_zeros((self.correction.shape[0], self.d_in), dtype=dtype)
        else:
            anchor = self.decoded("anchor_in_basis", dtype) @ self.decoded("basis", dtype).T
        return replace(self, anchor=anchor, anchor_in_basis=None, anchor_in_basis_scale=None)

    def decoded(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``basis``, ``correction``, ``anchor`` or ``anchor_in_basis`` itself in ``dtype`` (column
        scales applied)."""
        scale = getattr(self, f"{name}_scale")
        if scale is not None and scale.ndim == 2:  # a scale per block of rows (a stored basis)
            return fixed_point.scale_rows(getattr(self, name).to(dtype, copy=True), scale)
        matrix = getattr(self, name).to(dtype)
        return matrix if scale is None else matrix * scale.to(dtype)

    def basis_for_product(self, dtype: torch.dtype) -> torch.Tensor:
        """The basis as the products use it: column scales are folded into ``a``
        (:func:`correction_weights`), block scales applied here."""
        if self.basis_scale is not None and self.basis_scale.ndim == 2:
            return self.decoded("basis", dtype)
        return self.basis.to(dtype)

    def complete_eigen(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Λ, Q)`` over all of ``d_in``: a thin basis is completed by an orthonormal basis of
        its complement, with eigenvalue 0 (what the posterior sampler needs)."""
        basis = self.decoded("basis", dtype)
        eigenvalues = self.eigenvalues.to(dtype)
        missing = self.d_in - self.rank
        if missing <= 0:
            return eigenvalues, basis
        generator = torch.Generator(device=basis.device).manual_seed(0)
        filler = torch.randn(self.d_in, missing, generator=generator, dtype=dtype, device=basis.device)
        for _ in range(2):  # projected out twice: once leaves rounding-level overlap
            filler -= basis @ (basis.T @ filler)
        complement, _ = torch.linalg.qr(filler)
        zeros = eigenvalues.new_zeros(missing)
        return torch.cat([zeros, eigenvalues]), torch.cat([complement, basis], dim=1)

    def ridge(self, lam: float | str, mode: LambdaMode = "relative") -> float:
        """λ' for a number λ, or the evidence's choice for ``auto``."""
        if lam == AUTO_LAMBDA:
            return self.evidence_choice().ridge
        return ridge_of(lam, self.mean_eigenvalue, mode)

    def evidence_choice(self) -> EvidenceChoice:
        """The λ the evidence chooses for this weight (:mod:`mergekit_bmm.core.evidence`)."""
        if self.evidence is None:
            raise TensorInputError(
                "bmm: `lambda: auto` needs the number of observations behind the Gram, which these "
                "statistics do not record (no token counts); re-collect them with mergekit-bmm-stats, "
                "or give lambda a number"
            )
        return choose(self.evidence)


def _check_anchor(equations: NormalEquations, anchor: torch.Tensor) -> None:
    if anchor.shape != equations.cross.shape:
        raise TensorInputError(
            f"anchor task vector has shape {tuple(anchor.shape)}, expected {tuple(equations.cross.shape)}"
        )


def diagonalise(gram: torch.Tensor, dtype: torch.dtype, rank: int | None = None) -> tuple[torch.Tensor, ...]:
    """``(Λ, Q)`` of ``G`` in ``dtype``, ascending; with ``rank`` only the ``rank`` largest."""
    gram = gram.to(dtype)
    eigenvalues, basis = torch.linalg.eigh(0.5 * (gram + gram.T))
    if rank is not None and rank < basis.shape[1]:
        eigenvalues, basis = eigenvalues[-rank:].contiguous(), basis[:, -rank:].contiguous()
    return eigenvalues, basis


def factors_in_basis(
    equations: NormalEquations, anchor: torch.Tensor, eigenvalues: torch.Tensor, basis: torch.Tensor
) -> EigenFactors:
    """The factors of these equations given ``G``'s eigendecomposition ``(Λ, Q)``, in ``Q``'s dtype.

    The correction is formed as ``(C − U0 G) Q``; ``Q`` must be ``G``'s own (exact)
    eigenvectors: a rounded copy would act as a backward error of ``G``, amplified by the
    condition of ``G + λ'I``.
    """
    _check_anchor(equations, anchor)
    dtype = basis.dtype
    anchor = anchor.to(device=basis.device, dtype=dtype)
    cross = equations.cross.to(dtype)
    residual = cross - anchor @ equations.gram.to(dtype)
    correction = residual @ basis
    return EigenFactors(
        basis=basis,
        eigenvalues=eigenvalues,
        correction=correction,
        anchor=anchor,
        mean_eigenvalue=equations.mean_eigenvalue,
        diagonal_max=diagonal_max(equations.gram),
        evidence=_evidence_terms(equations, anchor, cross, residual, eigenvalues, correction),
    )


def _evidence_terms(
    equations: NormalEquations,
    anchor: torch.Tensor,
    cross: torch.Tensor,
    residual: torch.Tensor,
    eigenvalues: torch.Tensor,
    correction: torch.Tensor,
) -> EvidenceTerms | None:
    """The evidence's terms, when the equations carry their energy and observation count.

    ``A = Σ_t tr((U_t − U0) G_t (U_t − U0)ᵀ) = S − ⟨U0, C⟩ − ⟨U0, C − U0 G⟩``.
    """
    if equations.energy is None or equations.observations is None:
        return None
    misfit = equations.energy - float((anchor * cross).sum()) - float((anchor * residual).sum())
    return terms_of(eigenvalues, correction, misfit, equations.observations, equations.mean_eigenvalue)


def eigen_factors(
    equations: NormalEquations,
    anchor: torch.Tensor,
    dtype: torch.dtype | None = None,
    rank: int | None = None,
) -> EigenFactors:
    """Diagonalise ``G`` once; any λ is then a single (out × in × r) product.

    ``dtype`` (default: the Gram's) is the precision of the factorisation. Computing it
    in float64 and rounding the factors afterwards makes the factored route as accurate
    as a float64 solve of the same ``G`` and ``C``: each column of ``E Q`` is then right
    to its own relative precision, whereas a float32 ``eigh`` and ``E Q`` carry errors
    of ``eps·‖C‖`` that ``1/(λ_i + λ')`` amplifies in the small directions. ``rank`` keeps
    only that many of the largest eigenvalues (a bound on ``G``'s rank: see the class).
    """
    _check_anchor(equations, anchor)  # before the eigendecomposition, not after
    eigenvalues, basis = diagonalise(equations.gram, dtype or equations.gram.dtype, rank)
    return factors_in_basis(equations, anchor, eigenvalues, basis)


def correction_weights(factors: EigenFactors, ridge: float, folded: bool = True) -> torch.Tensor:
    """``a = 1/(Λ + λ')`` per basis direction (0 where the anchor is kept).

    ``folded``: the column scales of a low-precision correction and basis are multiplied in,
    so that ``U − U0 = (stored correction · a) @ stored basisᵀ``.
    """
    if ridge < 0 or ridge != ridge:
        raise ConfigError(f"the effective ridge must be >= 0; got {ridge}")
    eigenvalues = factors.eigenvalues
    compute = eigenvalues.dtype
    scale = factors.diagonal_max if factors.diagonal_max is not None else float(eigenvalues.max())
    floor = factors.zero_floor
    if ridge_dominates(ridge, scale):  # a = (1/λ')/(1 + Λ/λ'): finite for any λ'
        inverse = 1.0 / ridge
        weights = inverse / (1.0 + eigenvalues.clamp_min(0.0) * inverse)
    else:
        regular = (
            ridge > floor if floor is not None else ridge_is_regular(ridge, scale, factors.d_in, compute)
        )
        if regular:
            eigenvalues = eigenvalues.clamp_min(0.0)
            kept = torch.ones_like(eigenvalues, dtype=torch.bool)
        else:
            largest = float(eigenvalues.max()) if eigenvalues.numel() else 0.0
            tolerance = floor if floor is not None else eigenvalue_floor(largest, factors.d_in, compute)
            kept = eigenvalues > tolerance
            if factors.rank < factors.d_in or not bool(kept.all()):
                note_zero_ridge_limit(ridge, tolerance)
        denominator = torch.where(kept, eigenvalues + ridge, torch.ones_like(eigenvalues))
        weights = torch.where(kept, 1.0 / denominator, torch.zeros_like(eigenvalues))
    if folded:
        for column_scale in (factors.correction_scale, factors.basis_scale):
            if column_scale is not None and column_scale.ndim == 1:  # block scales: basis_for_product
                weights = weights * column_scale.to(compute)
    return weights


def _anchor_plus(factors: EigenFactors, start: torch.Tensor | None, scale: float, transposed: bool):
    """``start + scale·U0`` (or ``scale·U0``) in the solve's dtype, oriented like the output."""
    compute = factors.eigenvalues.dtype
    anchor = factors.anchor
    if factors.anchor_scale is not None:
        anchor = torch.mul(anchor, factors.anchor_scale.to(compute) * scale)
    else:
        anchor = anchor.to(compute) * scale
    anchor = anchor.T if transposed else anchor
    return anchor if start is None else anchor.add_(start)  # a fresh tensor: start is never written


def _weighted(factors: EigenFactors, ridge: float) -> torch.Tensor:
    """``E Q·a``, plus the anchor's coordinates when it lies in the basis' span (their column
    scales, and a basis' own, folded in as :func:`correction_weights` folds the correction's)."""
    weighted = torch.mul(factors.correction, correction_weights(factors, ridge))
    if factors.anchor_in_basis is not None:
        compute = weighted.dtype
        column = torch.ones(factors.rank, dtype=compute, device=weighted.device)
        for column_scale in (factors.anchor_in_basis_scale, factors.basis_scale):
            if column_scale is not None and column_scale.ndim == 1:  # block scales: basis_for_product
                column = column * column_scale.to(compute)
        weighted.addcmul_(factors.anchor_in_basis.to(compute), column)
    return weighted


def solve_from_factors(factors: EigenFactors, ridge: float) -> torch.Tensor:
    """``U(λ')`` from eigen factors (exact, including λ' = 0 on singular ``G``)."""
    if factors.rows is not None:
        inner = _row_update(factors, ridge)
        return factors.rows.to(inner.dtype) @ inner
    weighted = _weighted(factors, ridge)
    basis = factors.basis_for_product(weighted.dtype)
    if factors.anchor is None:
        return weighted @ basis.T
    return torch.addmm(_anchor_plus(factors, None, 1.0, False), weighted, basis.T)


def _row_update(factors: EigenFactors, ridge: float) -> torch.Tensor:
    """The ``k`` rows' update ``U_k(λ')`` of factors with ``rows``, in one memory layout whatever
    produced them (filled in memory or read back: BLAS's rounding follows the strides)."""
    inner = replace(factors, rows=None)
    weighted = _weighted(inner, ridge)
    basis = inner.basis_for_product(weighted.dtype).T.contiguous()
    if inner.anchor is None:
        return weighted.contiguous() @ basis
    return torch.addmm(_anchor_plus(inner, None, 1.0, False), weighted.contiguous(), basis)


def weight_from_factors(
    factors: EigenFactors, base: torch.Tensor, ridge: float, scale: float, transposed: bool = False
) -> torch.Tensor:
    """``W_pre + s·U(λ')`` in ``base``'s dtype and layout: one product with the sums fused into it.

    This is all a cached merge (a search trial) computes per tensor. ``transposed``: the
    weight is stored (in, out), so ``W = W_pre + s·U0ᵀ + s·Q·(E Q·a)ᵀ``. (Adding a bfloat16
    base to a float32 product in one mixed-dtype pass measured slower than widening the
    base and rounding the result.)
    """
    if factors.rows is not None:  # the k rows' update first, then one (out × k × in) product
        inner = _row_update(factors, ridge)
        rows = factors.rows.to(inner.dtype)
        left, right = (inner.T, rows.T) if transposed else (rows, inner)
        merged = torch.addmm(base.to(inner.dtype), left.contiguous(), right.contiguous(), alpha=scale)
        return merged.to(base.dtype)
    weighted = _weighted(factors, ridge)
    basis = factors.basis_for_product(weighted.dtype)
    if factors.anchor is None:
        start = base.to(weighted.dtype)
    else:
        start = _anchor_plus(factors, base, scale, transposed)
    left, right = (basis, weighted.T) if transposed else (weighted, basis.T)
    # One memory layout whatever produced the factors (filled in memory or read from the cache):
    # BLAS picks its kernel, and so the rounding, by the operands' strides.
    merged = torch.addmm(start, left.contiguous(), right.contiguous(), alpha=scale)
    return merged.to(base.dtype)


@dataclass(frozen=True)
class RidgeFactor:
    """The Cholesky factor of ``G + λ'I`` (``G/λ' + I`` when λ' dominates): every weight with this
    ``G`` and λ' solves with it (q, k and v reading one input's activation Gram)."""

    factor: torch.Tensor
    ridge: float
    scaled: bool

    def solve(self, cross: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """``(C + λ'U0)(G + λ'I)⁻¹``."""
        anchor = anchor.to(device=self.factor.device, dtype=self.factor.dtype)
        cross = cross.to(device=self.factor.device, dtype=self.factor.dtype)
        right = (cross * (1.0 / self.ridge) + anchor).T if self.scaled else (cross + self.ridge * anchor).T
        return torch.cholesky_solve(right, self.factor).T


def ridge_factor(gram: torch.Tensor, ridge: float) -> RidgeFactor | None:
    """The factor of ``G + λ'I``; None where the eigen route must solve (λ' at or below ``G``'s
    numerical zero, a failed factorisation)."""
    if ridge < 0 or ridge != ridge:
        raise ConfigError(f"the effective ridge must be >= 0; got {ridge}")
    largest = diagonal_max(gram)
    if not ridge_is_regular(ridge, largest, gram.shape[-1], gram.dtype):
        return None
    scaled = ridge_dominates(ridge, largest)  # U (G/λ' + I) = C/λ' + U0
    system = gram * (1.0 / ridge) if scaled else gram.clone()
    system.diagonal().add_(1.0 if scaled else ridge)  # + I or + λ'I, without a dense identity
    factor, info = torch.linalg.cholesky_ex(system)
    return RidgeFactor(factor, ridge, scaled) if int(info) == 0 else None


def solve(equations: NormalEquations, anchor: torch.Tensor, ridge: float) -> torch.Tensor:
    """``U = (C + λ'U0)(G + λ'I)⁻¹`` by Cholesky; eigen fallback when (near) singular."""
    _check_anchor(equations, anchor)
    factor = ridge_factor(equations.gram, ridge)
    if factor is not None:
        return factor.solve(equations.cross, anchor)
    anchor = anchor.to(device=equations.gram.device, dtype=equations.gram.dtype)
    return solve_from_factors(eigen_factors(equations, anchor), ridge)


def merge_matrix(
    equations: NormalEquations, anchor: torch.Tensor, lam: float, lambda_mode: LambdaMode = "relative"
) -> torch.Tensor:
    """The merged task vector ``U`` for a dimensionless (or absolute) λ."""
    return solve(equations, anchor, effective_ridge(lam, equations, lambda_mode))


_MOVED = ("data_free_equations", "activation_equations", "mix_equations")


def __getattr__(name: str):
    """The equation builders moved to :mod:`mergekit_bmm.core.normal_equations`; the old names still work."""
    if name in _MOVED:
        import warnings

        from mergekit_bmm.core import normal_equations

        warnings.warn(
            f"mergekit_bmm.core.closed_form.{name} moved to mergekit_bmm.core.normal_equations.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(normal_equations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
