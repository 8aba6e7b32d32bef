"""The posterior of App. B: the draws have the right mean and row covariance, reproducibly."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import reference_solve, relative_error

from mergekit_bmm.core import closed_form, normal_equations
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.sampling.posterior import RowPosterior, check_beta, check_sigma, standard_normal

Z = 5.0  # half-width of the acceptance band in standard errors (fixed seeds: deterministic)


def small_problem(out_features=6, in_features=5, tasks=3, lam=0.2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    vectors = [
        torch.randn(out_features, in_features, generator=generator, dtype=torch.float64) for _ in range(tasks)
    ]
    anchor = sum(vectors) / tasks
    equations = normal_equations.data_free_equations(vectors, torch.float64)
    ridge = closed_form.effective_ridge(lam, equations)
    u_map = closed_form.solve(equations, anchor, ridge)
    return vectors, anchor, equations, ridge, u_map


def reference_covariance(vectors, ridge, beta):
    gram = sum(u.T @ u for u in vectors)
    return torch.linalg.inv(gram + ridge * torch.eye(gram.shape[0], dtype=torch.float64)) / beta


def test_covariance_matches_the_paper_formula():
    vectors, anchor, equations, ridge, u_map = small_problem()
    posterior = RowPosterior.from_gram(equations.gram, ridge, beta=3.0, solve_dtype=torch.float64)
    expected = reference_covariance(vectors, ridge, 3.0)
    assert relative_error(posterior.covariance(), expected) < 1e-12
    factor = posterior.noise_factor()
    assert relative_error(factor.T @ factor, expected) < 1e-12
    assert posterior.rms_std() == pytest.approx(math.sqrt(expected.trace().item() / 5), rel=1e-12)
    assert relative_error(u_map, reference_solve(vectors, anchor, 0.2)) < 1e-12


def test_posterior_from_the_merge_eigen_factors():
    """A merge that already diagonalised G (closed_form.eigen_factors) needs no second eigh."""
    vectors, anchor, equations, ridge, _ = small_problem()
    factors = closed_form.eigen_factors(equations, anchor)
    posterior = RowPosterior.from_eigen(factors.eigenvalues, factors.basis, ridge, 3.0, torch.float64)
    assert relative_error(posterior.covariance(), reference_covariance(vectors, ridge, 3.0)) < 1e-12


def test_a_thin_basis_is_completed_for_the_posterior():
    """A cache keeps only the ``T·out`` directions a data-free G can have; the posterior needs
    all of ``d_in``: the complement is added with eigenvalue 0 (precision λ' there)."""
    generator = torch.Generator().manual_seed(5)
    vectors = [torch.randn(2, 7, generator=generator, dtype=torch.float64) for _ in range(3)]  # rank 6 of 7
    equations = normal_equations.data_free_equations(vectors, torch.float64)
    thin = closed_form.eigen_factors(equations, torch.zeros(2, 7, dtype=torch.float64), rank=6)
    eigenvalues, basis = thin.complete_eigen(torch.float64)
    assert (
        basis.shape == (7, 7) and relative_error(basis.T @ basis, torch.eye(7, dtype=torch.float64)) < 1e-12
    )
    posterior = RowPosterior.from_eigen(eigenvalues, basis, 0.3, 2.0, torch.float64)
    assert relative_error(posterior.covariance(), reference_covariance(vectors, 0.3, 2.0)) < 1e-10


def test_empirical_mean_and_row_covariance_match():
    """Many draws of a 6×5 tensor: mean → U_MAP, pooled row covariance → Σ_row.

    With n draws the sample mean of entry (i, j) has standard error sqrt(Σ_jj/n); the
    row covariance estimate pooled over rows·n draws (known mean) has standard error
    sqrt((Σ_jl² + Σ_jj Σ_ll)/(rows·n)). Every entry must lie within Z of them.
    """
    vectors, _, equations, ridge, u_map = small_problem()
    beta = 2.0
    posterior = RowPosterior.from_gram(equations.gram, ridge, beta, torch.float64)
    factor = posterior.noise_factor()
    n = 4000
    draws = torch.stack([u_map + standard_normal(tuple(u_map.shape), 7, "w", k) @ factor for k in range(n)])
    sigma = reference_covariance(vectors, ridge, beta)
    rows = u_map.shape[0]

    mean_error = draws.mean(0) - u_map
    mean_band = Z * (torch.diagonal(sigma) / n).sqrt()
    assert bool((mean_error.abs() <= mean_band).all()), (mean_error / mean_band).abs().max()

    centred = (draws - u_map).reshape(n * rows, -1)
    empirical = centred.T @ centred / (n * rows)
    variances = torch.diagonal(sigma)
    covariance_band = Z * ((sigma**2 + variances[:, None] * variances[None, :]) / (n * rows)).sqrt()
    assert bool(((empirical - sigma).abs() <= covariance_band).all()), (
        ((empirical - sigma) / covariance_band).abs().max()
    )


def test_beta_infinity_is_the_map():
    _, _, equations, ridge, u_map = small_problem()
    posterior = RowPosterior.from_gram(equations.gram, ridge, math.inf)
    assert torch.count_nonzero(posterior.noise_factor()) == 0
    assert posterior.rms_std() == 0.0
    draw = u_map + standard_normal(tuple(u_map.shape), 0, "w", 0) @ posterior.noise_factor()
    assert torch.equal(draw, u_map)


def test_precision_grows_with_beta():
    _, _, equations, ridge, _ = small_problem()
    low = RowPosterior.from_gram(equations.gram, ridge, 1.0)
    high = RowPosterior.from_gram(equations.gram, ridge, 100.0)
    assert high.rms_std() == pytest.approx(low.rms_std() / 10, rel=1e-12)
    assert low.rms_std(100.0) == pytest.approx(high.rms_std(), rel=1e-12)


def test_improper_posterior_is_refused():
    """λ' = 0 on a singular Gram (one 2×5 task vector: rank 2 of 5) has no proper posterior."""
    vector = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    equations = normal_equations.data_free_equations([vector], torch.float64)
    with pytest.raises(ConfigError, match="improper") as caught:
        RowPosterior.from_gram(equations.gram, 0.0, 1.0, name="layers.0.mlp.down_proj.weight")
    assert "rank 2 of 5" in str(caught.value) and "\n" not in str(caught.value)
    # the same Gram with a ridge, or a full-rank Gram without one, is fine
    assert RowPosterior.from_gram(equations.gram, 1e-3, 1.0).rms_std() > 0
    _, _, full, _, _ = small_problem()
    assert RowPosterior.from_gram(full.gram, 0.0, 1.0).rms_std() > 0


def test_draws_are_reproducible_and_independent_of_order():
    first = standard_normal((3, 4), 11, "model.layers.1.mlp.down_proj.weight", 2)
    standard_normal((3, 4), 11, "model.layers.0.mlp.down_proj.weight", 0)  # other draws in between
    again = standard_normal((3, 4), 11, "model.layers.1.mlp.down_proj.weight", 2)
    assert torch.equal(first, again)
    assert not torch.equal(first, standard_normal((3, 4), 12, "model.layers.1.mlp.down_proj.weight", 2))
    assert not torch.equal(first, standard_normal((3, 4), 11, "model.layers.1.mlp.down_proj.weight", 3))
    assert not torch.equal(first, standard_normal((3, 4), 11, "model.layers.2.mlp.down_proj.weight", 2))


@pytest.mark.parametrize("beta", [0.0, -1.0, float("nan")])
def test_bad_beta(beta):
    with pytest.raises(ConfigError, match="--beta must be a number > 0"):
        check_beta(beta)


@pytest.mark.parametrize("sigma", [-0.1, float("nan"), float("inf")])
def test_bad_sigma(sigma):
    with pytest.raises(ConfigError, match="--iid-sigma"):
        check_sigma(sigma)
