"""LoRA experts solved in their T·r subspace: equal to the float64 full solve for any anchor and λ,
in float64 and float32, with the same evidence; rank-deficient and overlapping adapters included."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error

from mergekit_bmm.core import closed_form, evidence, normal_equations
from mergekit_bmm.core.low_rank import LowRankUpdate, SpanAnchor, low_rank_factors

F64 = torch.float64


def _updates(seed: int, d_out: int = 24, d_in: int = 40, ranks=(2, 3, 4), shared: bool = False):
    g = torch.Generator().manual_seed(seed)
    updates = []
    common = torch.randn(2, d_in, generator=g, dtype=F64)
    for r in ranks:
        right = torch.randn(r, d_in, generator=g, dtype=F64)
        if shared:  # adapters that overlap: the stacked A is rank-deficient
            right[:2] = common
        updates.append(LowRankUpdate(0.3 * torch.randn(d_out, r, generator=g, dtype=F64), right))
    return updates


def _full(updates, anchor, lam):
    vectors = [u.dense() for u in updates]
    equations = normal_equations.data_free_equations(vectors, F64)
    return closed_form.merge_matrix(equations, anchor, lam), equations


@pytest.mark.parametrize("lam", [1e-4, 0.01, 0.1, 1.0, 100.0])
@pytest.mark.parametrize("anchor_kind", ["task_arithmetic", "dense", "zero"])
def test_the_subspace_solve_equals_the_full_solve(lam, anchor_kind):
    updates = _updates(0)
    g = torch.Generator().manual_seed(1)
    anchor = {
        "task_arithmetic": 0.4 * sum(u.dense() for u in updates),
        "dense": torch.randn(24, 40, generator=g, dtype=F64) * 0.1,  # not in the adapters' span
        "zero": torch.zeros(24, 40, dtype=F64),
    }[anchor_kind]
    factors = low_rank_factors(updates, anchor)
    assert factors.rank == 9  # Σ r_t
    full, equations = _full(updates, anchor, lam)
    ridge = factors.ridge(lam)
    assert ridge == pytest.approx(closed_form.effective_ridge(lam, equations), rel=1e-12)
    ours = closed_form.solve_from_factors(factors, ridge)
    assert relative_error(ours, full) < 1e-9


@pytest.mark.parametrize("coefficients", [(0.4, 0.4, 0.4), (0.5, -0.2, 1.3), (0.0, 0.0, 0.0)])
@pytest.mark.parametrize("shared", [False, True])
def test_an_anchor_in_the_span_is_never_formed_and_gives_the_same_solve(coefficients, shared):
    """Task Arithmetic of the adapters (or the base, all 0) held as coordinates in the basis: the
    weight is one product, the solve and the evidence those of the dense anchor."""
    updates = [
        LowRankUpdate(u.left, u.right, expert=index) for index, u in enumerate(_updates(4, shared=shared))
    ]
    dense = sum(c * u.dense() for c, u in zip(coefficients, updates))
    span = low_rank_factors(updates, SpanAnchor(coefficients, (24, 40)))
    assert span.anchor is None and span.anchor_in_basis.shape == (24, span.rank)
    for lam in (1e-4, 0.1, 100.0):
        full, _ = _full(updates, dense, lam)
        assert relative_error(closed_form.solve_from_factors(span, span.ridge(lam)), full) < 1e-9
    reference = low_rank_factors(updates, dense)
    assert span.evidence.energy == pytest.approx(reference.evidence.energy, rel=1e-9, abs=1e-12)
    if any(coefficients):
        assert relative_error(span.with_dense_anchor().anchor, dense) < 1e-12
    base = torch.randn(24, 40, dtype=F64)
    weight = closed_form.weight_from_factors(span, base, span.ridge(0.1), 0.7)
    assert relative_error(weight, base + 0.7 * _full(updates, dense, 0.1)[0]) < 1e-12


def test_an_expert_whose_adapter_skips_the_weight_keeps_its_coefficient_out():
    """Coefficients are per expert of the merge: expert 1's adapter does not touch this weight."""
    first, _, third = _updates(5)
    updates = [LowRankUpdate(first.left, first.right, 0), LowRankUpdate(third.left, third.right, 2)]
    factors = low_rank_factors(updates, SpanAnchor((0.2, 9.0, 0.6), (24, 40)), experts=3)
    full, _ = _full(updates, 0.2 * first.dense() + 0.6 * third.dense(), 0.1)
    assert relative_error(closed_form.solve_from_factors(factors, factors.ridge(0.1)), full) < 1e-9


def test_float32_factors_stay_within_1e_5_of_float64():
    updates = _updates(2, d_out=64, d_in=96, ranks=(4, 4, 4))
    anchor = 0.3 * sum(u.dense() for u in updates)
    full, equations = _full(updates, anchor, 0.01)
    factors = low_rank_factors(updates, anchor, dtype=torch.float32)
    ours = closed_form.solve_from_factors(factors, factors.ridge(0.01))
    assert relative_error(ours, full) < 1e-5


def test_small_eigenvalues_of_a_decaying_spectrum_are_solved_not_dropped_in_float32():
    """Trained adapters' spectra decay: eigenvalues far below a float32 ``d_in × d_in`` floor
    (λ_max · d_in · eps32) are exact in the k × k float64 eigenproblem and must enter the solve."""
    g = torch.Generator().manual_seed(5)
    d_out, d_in = 48, 512
    updates = []
    for _ in range(3):
        left = torch.randn(d_out, 4, generator=g, dtype=F64) * torch.tensor([1.0, 0.3, 3e-3, 1e-3], dtype=F64)
        updates.append(LowRankUpdate(left, torch.randn(4, d_in, generator=g, dtype=F64) / d_in**0.5))
    anchor = 0.3 * sum(u.dense() for u in updates)
    lam = 1e-3
    full, _ = _full(updates, anchor, lam)
    factors = low_rank_factors(updates, anchor)
    float32_floor = closed_form.eigenvalue_floor(float(factors.eigenvalues.max()), d_in, torch.float32)
    ridge = factors.ridge(lam)
    assert ridge < float32_floor and int((factors.eigenvalues < float32_floor).sum()) >= 3
    solved = factors.to(torch.float32)  # the merge's compute dtype
    assert relative_error(closed_form.solve_from_factors(solved, ridge), full) < 1e-5


def test_overlapping_adapters_and_the_evidence_agree_with_the_full_route():
    updates = _updates(3, shared=True)
    anchor = 0.5 * sum(u.dense() for u in updates)
    factors = low_rank_factors(updates, anchor)
    for lam in (0.0, 0.05):
        full, equations = _full(updates, anchor, lam)
        assert relative_error(closed_form.solve_from_factors(factors, factors.ridge(lam)), full) < 1e-8
    dense = closed_form.eigen_factors(equations, anchor, F64)
    ours, reference = evidence.choose(factors.evidence), evidence.choose(dense.evidence)
    assert ours.lam == pytest.approx(reference.lam, rel=1e-6)
    assert ours.log_evidence == pytest.approx(reference.log_evidence, rel=1e-9)


def test_balance_weights_enter_as_in_the_full_route():
    updates = _updates(4)
    anchor = torch.zeros(24, 40, dtype=F64)
    vectors = [u.dense() for u in updates]
    weights = [0.5, 1.0, 2.0]
    gram = sum(w * v.T @ v for w, v in zip(weights, vectors))
    cross = sum(w * v @ v.T @ v for w, v in zip(weights, vectors))
    full = closed_form.merge_matrix(normal_equations.NormalEquations(gram, cross), anchor, 0.1)
    factors = low_rank_factors(updates, anchor, weights)
    assert relative_error(closed_form.solve_from_factors(factors, factors.ridge(0.1)), full) < 1e-9


def test_mismatched_factors_are_one_line():
    updates = _updates(5)
    with pytest.raises(Exception, match="LoRA factors of expert 0 have shapes"):
        low_rank_factors(updates, torch.zeros(23, 40, dtype=F64))


@pytest.mark.parametrize("anchor_kind", ["span", "dense"])
def test_pooled_grams_of_the_weights_reading_one_input_equal_the_full_pooled_solve(anchor_kind):
    """``gram_sharing: input``: each expert's Gram pools its updates of the sibling weights (here k and
    v beside q; expert 2 adapted v alone), and the subspace solve, its span anchor and its evidence
    equal the dense pooled closed form."""
    g = torch.Generator().manual_seed(7)
    d_in, shapes = 40, {"q": 24, "k": 8, "v": 8}

    def update(rows: int, rank: int, expert: int) -> LowRankUpdate:
        left = 0.3 * torch.randn(rows, rank, generator=g, dtype=F64)
        return LowRankUpdate(left, torch.randn(rank, d_in, generator=g, dtype=F64), expert)

    own = [update(shapes["q"], 2, 0), update(shapes["q"], 3, 1)]
    siblings = [update(shapes["k"], 2, 0), update(shapes["v"], 3, 0), update(shapes["v"], 2, 2)]
    vectors = [own[0].dense(), own[1].dense(), torch.zeros(shapes["q"], d_in, dtype=F64)]
    grams = [v.T @ v for v in vectors]
    for sibling in siblings:
        grams[sibling.expert] += sibling.dense().T @ sibling.dense()
    rows = sum(shapes.values())
    equations = normal_equations.pooled_equations(vectors, grams, rows, F64)
    coefficients = (0.3, 0.3, 0.3)
    dense_anchor = 0.3 * (vectors[0] + vectors[1])
    prior = SpanAnchor(coefficients, (shapes["q"], d_in)) if anchor_kind == "span" else dense_anchor
    factors = low_rank_factors(own, prior, experts=3, siblings=siblings, rows=rows)
    assert factors.rank == 12
    for lam in (1e-3, 0.1, 10.0):
        full = closed_form.merge_matrix(equations, dense_anchor, lam)
        assert relative_error(closed_form.solve_from_factors(factors, factors.ridge(lam)), full) < 1e-9
    dense = closed_form.eigen_factors(equations, dense_anchor, F64)
    ours, reference = evidence.choose(factors.evidence), evidence.choose(dense.evidence)
    assert ours.lam == pytest.approx(reference.lam, rel=1e-6)
    assert ours.log_evidence == pytest.approx(reference.log_evidence, rel=1e-9)
