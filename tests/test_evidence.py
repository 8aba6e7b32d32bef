"""λ from the evidence: the closed-form log evidence against a float64 Gaussian likelihood written
out observation by observation, its argmax against a brute-force grid, and the degenerate cases."""

from __future__ import annotations

import math

import pytest
import torch

from mergekit_bmm.core import closed_form, evidence, normal_equations

F64 = torch.float64


def _problem(seed: int, rows: int = 5, d_in: int = 7, tasks: int = 3, tokens: int = 6, spread: float = 0.3):
    """Experts that share a common update plus their own, activation inputs, an anchor."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(rows, d_in, generator=g, dtype=F64)
    vectors = [shared + spread * torch.randn(rows, d_in, generator=g, dtype=F64) for _ in range(tasks)]
    inputs = [torch.randn(d_in, tokens, generator=g, dtype=F64) for _ in range(tasks)]
    anchor = sum(vectors) / tasks + 0.1 * torch.randn(rows, d_in, generator=g, dtype=F64)
    return vectors, inputs, anchor


def _reference(vectors, inputs, anchor, ridge: float) -> float:
    """log p(Y | λ') with σ² at its maximiser, from the N-dimensional Gaussian of each row."""
    x = torch.cat(inputs, dim=1)  # (d_in, N)
    n = x.shape[1]
    covariance = torch.eye(n, dtype=F64) + x.T @ x / ridge  # σ²·this
    residual = torch.cat([(u - anchor) @ xt for u, xt in zip(vectors, inputs)], dim=1)  # (rows, N)
    quadratic = float((residual @ torch.linalg.solve(covariance, residual.T)).trace())
    rows = residual.shape[0]
    sigma2 = quadratic / (rows * n)
    _, log_det = torch.linalg.slogdet(covariance)
    return -0.5 * (rows * n * math.log(2 * math.pi * sigma2) + rows * float(log_det) + quadratic / sigma2)


def _terms(equations, anchor) -> evidence.EvidenceTerms:
    return closed_form.eigen_factors(equations, anchor, F64).evidence


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_log_evidence_is_the_gaussian_likelihood_of_the_experts_outputs(seed):
    vectors, inputs, anchor = _problem(seed)
    grams = [x @ x.T for x in inputs]
    equations = normal_equations.activation_equations(
        vectors, grams, F64, tokens=[x.shape[1] for x in inputs]
    )
    terms = _terms(equations, anchor)
    ridges = torch.tensor([1e-3, 0.1, 1.0, 10.0, 1e3], dtype=F64)
    ours = terms.log_evidence(ridges)
    for ridge, value in zip(ridges.tolist(), ours.tolist()):
        reference = _reference(vectors, inputs, anchor, ridge)
        assert abs(value - reference) <= 1e-9 * abs(reference), (ridge, value, reference)


def test_data_free_observations_are_each_experts_own_rows():
    vectors, _, anchor = _problem(3, rows=6, d_in=4)
    equations = normal_equations.data_free_equations(vectors, F64)
    terms = _terms(equations, anchor)
    assert terms.observations == 3 * 6
    ridges = torch.tensor([0.01, 1.0, 100.0], dtype=F64)
    for ridge, value in zip(ridges.tolist(), terms.log_evidence(ridges).tolist()):
        reference = _reference(vectors, [u.T for u in vectors], anchor, ridge)
        assert abs(value - reference) <= 1e-9 * abs(reference)


def test_the_chosen_lambda_is_the_maximum_of_a_brute_force_grid():
    vectors, inputs, anchor = _problem(4, rows=8, d_in=6, tasks=4, tokens=12, spread=1.0)
    anchor = torch.zeros_like(anchor)  # the pretrained anchor: the shared update is signal
    grams = [x @ x.T for x in inputs]
    equations = normal_equations.activation_equations(vectors, grams, F64, tokens=[12] * 4)
    choice = evidence.choose(_terms(equations, anchor))
    assert choice.edge is None
    scale = equations.mean_eigenvalue
    grid = torch.logspace(-4, 4, 801, dtype=F64).tolist()  # 0.01 decades apart
    best = max(grid, key=lambda lam: _reference(vectors, inputs, anchor, lam * scale))
    assert abs(math.log10(choice.lam) - math.log10(best)) <= 0.0101, (choice.lam, best)
    assert choice.ridge == pytest.approx(choice.lam * scale)
    assert choice.low <= choice.lam <= choice.high
    assert choice.log_evidence == pytest.approx(_reference(vectors, inputs, anchor, choice.ridge), rel=1e-9)


def test_experts_that_can_all_be_fitted_exactly_choose_the_low_edge():
    # Two rank-1 experts in independent input directions: one u reproduces both exactly.
    g = torch.Generator().manual_seed(5)
    directions = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=F64))[0].T
    vectors = [torch.randn(4, 1, generator=g, dtype=F64) * directions[i : i + 1] for i in range(2)]
    equations = normal_equations.data_free_equations(vectors, F64)  # rank 2 < d_in 6 (thin)
    choice = evidence.choose(_terms(equations, torch.zeros(4, 6, dtype=F64)))
    assert choice.edge == "low" and choice.lam == pytest.approx(evidence.LOW)


def test_experts_that_differ_only_by_noise_from_the_anchor_choose_a_strong_prior():
    g = torch.Generator().manual_seed(6)
    anchor = torch.randn(6, 5, generator=g, dtype=F64)
    inputs = [torch.randn(5, 40, generator=g, dtype=F64) for _ in range(3)]
    vectors = [anchor + 1e-3 * torch.randn(6, 5, generator=g, dtype=F64) for _ in range(3)]
    # Observations are the anchor's outputs plus noise: y_t = u0 X_t + ε, no expert signal.
    grams = [x @ x.T for x in inputs]
    equations = normal_equations.activation_equations(vectors, grams, F64, tokens=[40] * 3)
    noisy = evidence.choose(_terms(equations, anchor))
    informative = evidence.choose(_terms(equations, torch.zeros(6, 5, dtype=F64)))
    assert noisy.lam > 100 * informative.lam


def test_an_anchor_equal_to_every_expert_is_flat_and_gives_the_anchor():
    vectors, _, _ = _problem(7)
    same = [vectors[0]] * 3
    equations = normal_equations.data_free_equations(same, F64)
    choice = evidence.choose(_terms(equations, vectors[0]))
    assert choice.edge == "flat"
    merged = closed_form.solve(equations, vectors[0], choice.ridge)
    assert torch.allclose(merged, vectors[0], rtol=1e-10, atol=1e-12)
    zero = normal_equations.data_free_equations([torch.zeros(3, 4, dtype=F64)], F64)
    assert evidence.choose(_terms(zero, torch.zeros(3, 4, dtype=F64))).edge == "flat"


def test_the_mix_counts_both_sets_of_observations_and_statistics_without_tokens_cannot_tell():
    vectors, inputs, anchor = _problem(8)
    grams = [x @ x.T for x in inputs]
    few = normal_equations.activation_equations(vectors, grams, F64, tokens=[6, 6, 6])
    free = normal_equations.data_free_equations(vectors, F64)
    assert normal_equations.mix_equations(few, free, 0.5).observations == 18 + 15
    assert normal_equations.mix_equations(few, free, 1.0).observations == 18
    blind = normal_equations.activation_equations(vectors, grams, F64)
    assert blind.observations is None and _terms(blind, anchor) is None
    assert normal_equations.mix_equations(blind, free, 0.5).observations is None
