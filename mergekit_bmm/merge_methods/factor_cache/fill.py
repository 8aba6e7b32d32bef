"""Building one solved tensor's cache entry: its Gram's basis (shared when it can be) and factors.

The first merge of a tensor with ``cache:`` diagonalises ``G`` in float64, forms the correction
``(C − U0 G) Q`` in float64 *in that exact basis* and stores each factor at the precision
:mod:`~mergekit_bmm.merge_methods.factor_cache.precision` chooses; it returns exactly what a later read of
the entry gives. Forming the correction in a rounded basis instead would turn the basis'
rounding into a backward error of ``G``, amplified by ``κ(G + λ'I)``: so a basis is shared only
by weights whose exact eigendecomposition this process still holds. Weights that read the same
input (q/k/v, gate/up in the ``activations`` mode) have the same ``G`` and are merged one after
another, so the last ``RECENT_GRAMS`` eigendecompositions are kept in memory, keyed by the
Gram's content, and their weights share one stored basis.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from mergekit_bmm.core import closed_form
from mergekit_bmm.core.closed_form import EigenFactors
from mergekit_bmm.core.normal_equations import NormalEquations
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings
from mergekit_bmm.merge_methods.factor_cache import key as cache_key
from mergekit_bmm.merge_methods.factor_cache import precision as factor_precision
from mergekit_bmm.merge_methods.factor_cache.store import FactorCache, StoredBasis, key_digest

EXACT = torch.float64
AUTO_BASES = (factor_precision.FIXED_POINT, torch.float32)
RECENT_GRAMS = 2


@dataclass
class _Eigen:
    """One exact eigendecomposition, its stored copies by precision, and their file id."""

    basis_id: str
    eigenvalues: torch.Tensor
    vectors: torch.Tensor
    stored: dict[torch.dtype, StoredBasis] = field(default_factory=dict)
    rounding: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def column_rounding(self, precision: torch.dtype) -> torch.Tensor:
        """``‖ΔQ_i‖`` per column when the basis is stored in ``precision`` (computed once)."""
        if precision not in self.rounding:
            rounded = factor_precision.rounding_error(self.vectors, precision, blocks=True)  # as stored
            self.rounding[precision] = rounded.norm(dim=0)
        return self.rounding[precision]


_RECENT: OrderedDict[str, _Eigen] = OrderedDict()


def thin_rank(settings: BMMSettings, tasks: int, out_features: int, in_features: int) -> int | None:
    """A bound on ``G``'s rank below ``in`` (data-free ``G = Σ U_tᵀU_t`` has rank ≤ ``T·out``)."""
    if settings.gram == "data_free" and tasks * out_features < in_features:
        return tasks * out_features
    return None


def _eigen(gram_key: str, equations: NormalEquations, rank: int | None) -> _Eigen:
    """This Gram's exact eigendecomposition: from memory when recent, else computed (and kept)."""
    recent = _RECENT.get(gram_key)
    if recent is not None:
        _RECENT.move_to_end(gram_key)
        return recent
    eigenvalues, vectors = closed_form.diagonalise(equations.gram, EXACT, rank)
    # One file id per eigendecomposition: another process's (or a later) eigendecomposition of
    # the same G may differ in sign or within degenerate eigenspaces, and must not be mixed.
    computed = _Eigen(f"{key_digest(gram_key)}-{uuid.uuid4().hex[:12]}", eigenvalues, vectors)
    _RECENT[gram_key] = computed
    while len(_RECENT) > RECENT_GRAMS:
        _RECENT.popitem(last=False)
    return computed


def _budget(settings: BMMSettings, exact: EigenFactors, base: torch.Tensor) -> factor_precision.Budget:
    ridge = exact.ridge(settings.lam, settings.lambda_mode)
    floor = min(ridge, factor_precision.LAMBDA_FLOOR * max(exact.mean_eigenvalue, 0.0))
    weights = closed_form.correction_weights(exact, floor, folded=False)
    return factor_precision.Budget.of(float(base.to(EXACT).norm()), settings.scale, weights)


def _stored_basis(
    cache: FactorCache, eigen: _Eigen, precision: torch.dtype, compute: torch.dtype
) -> StoredBasis:
    """The stored copy of ``eigen`` in ``precision``, written when missing or unreadable."""
    stored = eigen.stored.get(precision)
    d_in = eigen.vectors.shape[0]
    if stored is None or cache.load_basis(eigen.basis_id, d_in, compute, precision) is None:
        stored = cache.store_basis(eigen.basis_id, eigen.eigenvalues, eigen.vectors, precision, compute)
        eigen.stored[precision] = stored
    return stored


def fill_factors(
    cache: FactorCache,
    name: str,
    key: str,
    equations: NormalEquations,
    prior: torch.Tensor,
    base: torch.Tensor,
    settings: BMMSettings,
    rank: int | None,
    recomputed: bool = False,
) -> EigenFactors:
    """Store ``name``'s factors under ``key`` and return them as a later read would; ``recomputed``:
    every merge recomputes ``prior`` from its inputs, so the entry need not store it."""
    compute = settings.compute_dtype
    eigen = _eigen(cache_key.gram_key(equations.gram, rank), equations, rank)
    # Eigenvalues as a read gives them (compute dtype): the budget is then the same on a refill.
    eigenvalues = eigen.eigenvalues.to(compute).to(EXACT)
    exact = closed_form.factors_in_basis(equations, prior, eigenvalues, eigen.vectors)
    anchor = prior.to(compute) if recomputed else None  # as a later merge recomputes it
    return _store(cache, name, key, eigen, exact, base, settings, anchor)


def fill_exact_factors(
    cache: FactorCache, name: str, key: str, exact: EigenFactors, base: torch.Tensor, settings: BMMSettings
) -> EigenFactors:
    """Store factors computed exactly elsewhere (float64; the LoRA subspace route) under ``key``."""
    eigen = _Eigen(f"{key_digest(key)}-{uuid.uuid4().hex[:12]}", exact.eigenvalues, exact.basis)
    rounded = exact.eigenvalues.to(settings.compute_dtype).to(EXACT)  # as a read gives them
    exact = replace(exact, eigenvalues=rounded)
    return _store(cache, name, key, eigen, exact, base, settings)


def fill_row_factors(
    cache: FactorCache,
    name: str,
    key: str,
    equations: NormalEquations,
    rows: torch.Tensor,
    prior: torch.Tensor,
    base: torch.Tensor,
    settings: BMMSettings,
) -> EigenFactors:
    """Store the factors of ``U = rows @ U_k`` under ``key``: ``equations`` and ``prior`` are the
    ``k``-row problem (``G``, ``Z``, ``c⊙A``: the LoRA data route), ``rows`` the stacked ``B_t``.

    ``G`` is diagonalised in float64 as for any weight (and shared with the other weights that read
    its input); the ``k``-row correction and anchor and ``rows`` are small and kept in float32, and
    the basis is stored in 16 bits when the budget allows it for the dense update they stand for.
    """
    compute = settings.compute_dtype
    eigen = _eigen(cache_key.gram_key(equations.gram, None), equations, None)
    eigenvalues = eigen.eigenvalues.to(compute).to(EXACT)  # as a read gives them
    exact = closed_form.factors_in_basis(equations, prior, eigenvalues, eigen.vectors)
    exact = replace(exact, evidence=None)  # k rows are not the weight's: no evidence for λ auto
    chosen = dict.fromkeys(("anchor", "correction", "basis"), settings.cache_dtype or torch.float32)
    if settings.cache_dtype is None:
        budget = _budget(settings, exact, base)
        dense = rows.to(EXACT) @ exact.correction  # the weight's own E Q: what the basis turns
        columns = eigen.column_rounding(factor_precision.FIXED_POINT)
        turned = float(((dense * budget.weights).norm(dim=0) * columns).norm())
        if turned <= budget.allowance:
            chosen["basis"] = factor_precision.FIXED_POINT
    stored = _stored_basis(cache, eigen, chosen["basis"], compute)
    scalars = {"mean_eigenvalue": exact.mean_eigenvalue, "diagonal_max": exact.diagonal_max}
    return cache.store_factors(
        name, key, stored, exact.correction, exact.anchor, chosen, scalars, compute, rows=rows
    )


@dataclass(frozen=True)
class _AnchorLayout:
    """How an entry holds ``U0``: dense, as its coordinates ``U0·Q`` in a thin basis, or not at all
    (``U0 = 0``, or ``recomputed``: every merge recomputes it from the inputs it loads anyway)."""

    dense: torch.Tensor | None = None
    coordinates: torch.Tensor | None = None
    outside: float = 0.0  # ‖U0 − U0·Q·Qᵀ‖: what the coordinates leave out
    recomputed: torch.Tensor | None = None  # U0 as the merge computed it (compute dtype)

    def entries(self) -> int:
        held = self.dense if self.dense is not None else self.coordinates
        return 0 if held is None else held.numel()


def _anchor_layouts(
    exact: EigenFactors, vectors: torch.Tensor, recomputed: torch.Tensor | None = None
) -> list[_AnchorLayout]:
    """The ways this entry could hold its anchor, smallest first.

    A base anchor (``U0 = 0``) is not stored, nor is one that every merge ``recomputed`` from its
    inputs (a marked input, Task Arithmetic: mergekit loads those tensors for the merge anyway). With
    a thin basis an anchor in its span (a data-free Task Arithmetic anchor: the task vectors' rows
    span it) is ``out × r`` as coordinates instead of ``out × in``; what it leaves out,
    ``‖U0‖² − ‖U0·Q‖²`` (``Q`` orthonormal; its float64 cancellation is about 1e-8·‖U0‖), is charged
    to the error budget.
    """
    if exact.anchor is None and exact.anchor_in_basis is None:
        return [_AnchorLayout()]
    if exact.anchor is None:  # held in the basis by the route that computed it (exactly)
        coordinates = exact.decoded("anchor_in_basis", EXACT)
        return [_AnchorLayout(coordinates=coordinates), _AnchorLayout(dense=exact.with_dense_anchor().anchor)]
    if not bool(exact.anchor.any()):
        return [_AnchorLayout()]
    if recomputed is not None:  # exact, and no bytes: nothing smaller exists
        return [_AnchorLayout(recomputed=recomputed)]
    layouts = [_AnchorLayout(dense=exact.anchor)]
    if vectors.shape[1] < vectors.shape[0]:
        coordinates = exact.anchor.to(EXACT) @ vectors.to(EXACT)
        left = float(exact.anchor.to(EXACT).norm()) ** 2 - float(coordinates.norm()) ** 2
        layouts.insert(0, _AnchorLayout(coordinates=coordinates, outside=math.sqrt(max(left, 0.0))))
    return layouts


def _precisions(
    layout: _AnchorLayout, exact: EigenFactors, eigen: _Eigen, base: torch.Tensor, settings: BMMSettings
) -> tuple[dict[str, torch.dtype], int] | None:
    """Each factor's precision in this layout and the bytes they take; None where the layout cannot
    keep the error budget (an anchor too far outside the basis' span)."""
    sizes = {
        "anchor": layout.entries(),
        "correction": exact.correction.numel(),
        "basis": eigen.vectors.numel(),
    }
    budget = _budget(settings, exact, base)
    if layout.outside > 0.5 * budget.allowance:
        return None
    if settings.cache_dtype is not None:
        chosen = dict.fromkeys(sizes, settings.cache_dtype)
        return chosen, factor_precision.stored_bytes(chosen, sizes)
    budget = replace(budget, allowance=math.sqrt(budget.allowance**2 - layout.outside**2))
    columns = eigen.column_rounding(factor_precision.FIXED_POINT)
    if layout.coordinates is None:  # a recomputed anchor is exact: no share, as for U0 = 0
        errors = factor_precision.shares(exact.correction, layout.dense, budget, columns)
    else:
        errors = factor_precision.shares_in_basis(exact.correction, layout.coordinates, budget, columns)
    for precision in AUTO_BASES:  # the cheapest basis that keeps the budget
        chosen = factor_precision.choose(errors, budget, precision, sizes)
        if chosen["basis"] == precision:
            break
    return chosen, factor_precision.stored_bytes(chosen, sizes)


def _store(
    cache: FactorCache,
    name: str,
    key: str,
    eigen: _Eigen,
    exact: EigenFactors,
    base: torch.Tensor,
    settings: BMMSettings,
    recomputed: torch.Tensor | None = None,
) -> EigenFactors:
    """Each factor at the precision the budget allows, in the anchor layout that takes the fewest
    bytes, written; returned exactly as read back."""
    fitted = [
        (layout, *fit)
        for layout in _anchor_layouts(exact, eigen.vectors, recomputed)
        if (fit := _precisions(layout, exact, eigen, base, settings)) is not None
    ]  # a dense (or zero) anchor always fits; on a tie the smaller layout, listed first, wins
    layout, chosen, _ = min(fitted, key=lambda item: item[2])
    stored = _stored_basis(cache, eigen, chosen["basis"], settings.compute_dtype)
    scalars = {"mean_eigenvalue": exact.mean_eigenvalue, "diagonal_max": exact.diagonal_max}
    if exact.zero_floor is not None:
        scalars["zero_floor"] = exact.zero_floor
    return cache.store_factors(
        name,
        key,
        stored,
        exact.correction,
        layout.dense,
        chosen,
        scalars,
        settings.compute_dtype,
        exact.evidence,
        anchor_in_basis=layout.coordinates,
        anchor_from_inputs=layout.recomputed,
    )
