"""The pure-torch closed form against a float64 reference, its limits and fallbacks."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import reference_solve, relative_error

from mergekit_bmm.core import closed_form as cf
from mergekit_bmm.core import normal_equations as ne
from mergekit_bmm.core import ridge
from mergekit_bmm.errors import ConfigError, TensorInputError

SHAPES = [(12, 8), (8, 12), (24, 16), (16, 33)]
LAMBDAS = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]


def random_tasks(shape, count, seed, rank=None):
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = shape
    vectors = []
    for _ in range(count):
        if rank is None:
            vectors.append(torch.randn(shape, generator=generator, dtype=torch.float64))
        else:
            left = torch.randn(out_features, rank, generator=generator, dtype=torch.float64)
            right = torch.randn(rank, in_features, generator=generator, dtype=torch.float64)
            vectors.append(left @ right)
    anchor = torch.randn(shape, generator=generator, dtype=torch.float64)
    return vectors, anchor


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tasks", [1, 2, 5, 8])
def test_data_free_matches_float64_reference(shape, tasks):
    vectors, anchor = random_tasks(shape, tasks, seed=tasks * 100 + shape[0])
    for lam in LAMBDAS:
        expected = reference_solve(vectors, anchor, lam)
        equations = ne.data_free_equations(vectors, torch.float64)
        got64 = cf.merge_matrix(equations, anchor, lam)
        assert relative_error(got64, expected) < 1e-9, (lam, shape, tasks)

        equations32 = ne.data_free_equations([v.float() for v in vectors], torch.float32)
        got32 = cf.merge_matrix(equations32, anchor.float(), lam)
        assert got32.dtype == torch.float32
        # float32 forward error is bounded by the condition number of G + λ'I.
        gram = sum(v.T @ v for v in vectors)
        eigenvalues = torch.linalg.eigvalsh(gram)
        ridge = lam * gram.trace().item() / shape[1]
        condition = (eigenvalues.max().item() + ridge) / (max(eigenvalues.min().item(), 0.0) + ridge)
        tolerance = max(1e-5, 20 * condition * torch.finfo(torch.float32).eps)
        assert relative_error(got32, expected) < tolerance, (lam, shape, tasks, condition)


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_activation_equations_match_reference(shape):
    vectors, anchor = random_tasks(shape, 3, seed=7)
    generator = torch.Generator().manual_seed(1)
    grams = []
    for _ in vectors:
        activations = torch.randn(shape[1], 40, generator=generator, dtype=torch.float64)
        grams.append(activations @ activations.T / 40)
    for lam in LAMBDAS:
        expected = reference_solve(vectors, anchor, lam, grams=grams)
        got = cf.merge_matrix(ne.activation_equations(vectors, grams, torch.float64), anchor, lam)
        assert relative_error(got, expected) < 1e-9


def test_large_lambda_returns_the_anchor():
    vectors, anchor = random_tasks((10, 6), 4, seed=3)
    got = cf.merge_matrix(ne.data_free_equations(vectors, torch.float64), anchor, 1e12)
    assert relative_error(got, anchor) < 1e-9


def test_one_task_small_lambda_reproduces_the_task():
    (vector,), _ = random_tasks((10, 6), 1, seed=4)
    anchor = 0.3 * vector  # a task-arithmetic anchor of one task
    for lam in (0.0, 1e-12):
        got = cf.merge_matrix(ne.data_free_equations([vector], torch.float64), anchor, lam)
        assert relative_error(got, vector) < 1e-8


def test_lambda_zero_on_a_singular_gram_is_the_limit_not_nan():
    # rank-2 task vectors with 16 inputs: G has a 14-dimensional null space
    vectors, anchor = random_tasks((6, 16), 1, seed=5, rank=2)
    equations = ne.data_free_equations(vectors, torch.float64)
    at_zero = cf.merge_matrix(equations, anchor, 0.0)
    assert torch.isfinite(at_zero).all()
    # the λ → 0⁺ limit: C G⁺ + U0 (I - G G⁺)
    gram_pinv = torch.linalg.pinv(equations.gram)
    identity = torch.eye(16, dtype=torch.float64)
    limit = equations.cross @ gram_pinv + anchor @ (identity - equations.gram @ gram_pinv)
    assert relative_error(at_zero, limit) < 1e-9
    assert relative_error(at_zero, reference_solve(vectors, anchor, 1e-7)) < 1e-5
    # in G's null space the anchor is kept, in its range the data are fitted
    vector = vectors[0]
    projector = torch.linalg.pinv(vector) @ vector
    null = torch.eye(16, dtype=torch.float64) - projector
    assert relative_error(at_zero @ null, anchor @ null) < 1e-9
    assert relative_error(at_zero @ projector, vector) < 1e-9
    for dtype in (torch.float32, torch.float64):
        equations = ne.data_free_equations([v.to(dtype) for v in vectors], dtype)
        assert torch.isfinite(cf.merge_matrix(equations, anchor.to(dtype), 0.0)).all()


def test_all_zero_task_vectors_give_the_anchor():
    anchor = torch.randn(5, 4, dtype=torch.float64)
    equations = ne.data_free_equations([torch.zeros(5, 4, dtype=torch.float64)] * 2, torch.float64)
    for lam in (0.0, 0.1):
        assert relative_error(cf.merge_matrix(equations, anchor, lam), anchor) < 1e-12


def test_eigen_factors_agree_with_the_direct_solve():
    vectors, anchor = random_tasks((20, 12), 3, seed=9)
    equations = ne.data_free_equations(vectors, torch.float64)
    factors = cf.eigen_factors(equations, anchor)
    for lam in LAMBDAS:
        ridge = cf.effective_ridge(lam, equations)
        direct = cf.solve(equations, anchor, ridge)
        cached = cf.solve_from_factors(factors, factors.ridge(lam))
        assert relative_error(cached, direct) < 1e-10


def test_absolute_lambda_is_the_paper_literal_ridge():
    vectors, anchor = random_tasks((9, 7), 2, seed=11)
    equations = ne.data_free_equations(vectors, torch.float64)
    got = cf.merge_matrix(equations, anchor, 0.37, lambda_mode="absolute")
    assert relative_error(got, reference_solve(vectors, anchor, 0.37, relative=False)) < 1e-10


def test_relative_lambda_is_invariant_to_weight_scale():
    vectors, anchor = random_tasks((9, 7), 3, seed=12)
    first = cf.merge_matrix(ne.data_free_equations(vectors, torch.float64), anchor, 0.05)
    scaled = [10.0 * v for v in vectors]
    second = cf.merge_matrix(ne.data_free_equations(scaled, torch.float64), 10.0 * anchor, 0.05)
    assert relative_error(second, 10.0 * first) < 1e-10


def test_mix_interpolates_normalised_estimates():
    vectors, anchor = random_tasks((8, 6), 2, seed=13)
    grams = [1e3 * torch.eye(6, dtype=torch.float64) for _ in vectors]
    few = ne.activation_equations(vectors, grams, torch.float64)
    free = ne.data_free_equations(vectors, torch.float64)
    for epsilon, expected in ((0.0, free), (1.0, few)):
        mixed = ne.mix_equations(few, free, epsilon)
        direct = cf.merge_matrix(expected, anchor, 0.1)
        assert relative_error(cf.merge_matrix(mixed, anchor, 0.1), direct) < 1e-10
    half = ne.mix_equations(few, free, 0.5)
    assert math.isclose(half.mean_eigenvalue, 1.0, rel_tol=1e-12)
    with pytest.raises(ConfigError):
        ne.mix_equations(few, free, 1.5)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TensorInputError, match="shape"):
        ne.data_free_equations([torch.zeros(3, 4), torch.zeros(4, 3)])
    with pytest.raises(TensorInputError, match="2D"):
        ne.data_free_equations([torch.zeros(3)])
    equations = ne.data_free_equations([torch.randn(3, 4)])
    with pytest.raises(ConfigError, match="lambda"):
        cf.merge_matrix(equations, torch.zeros(3, 4), -1.0)
    with pytest.raises(TensorInputError, match="anchor"):
        cf.merge_matrix(equations, torch.zeros(4, 3), 0.1)
    with pytest.raises(TensorInputError, match="Gram"):
        ne.activation_equations([torch.randn(3, 4)], [torch.eye(3)])


def test_a_tiny_positive_ridge_on_an_anisotropic_gram_is_named_not_called_lambda_zero(caplog, monkeypatch):
    """λ' = λ·mean eigenvalue below the Gram's numerical zero takes the λ → 0⁺ limit, and the one
    log line names that ridge instead of claiming λ was 0."""
    monkeypatch.setattr(ridge, "noted_limit", False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=generator) * torch.logspace(
        0, -6, 64
    )  # rank 8, eigenvalues span 12 decades
    equations = ne.NormalEquations(x.T @ x, torch.randn(4, 8, generator=generator) @ x)
    anchor = torch.randn(4, 64, generator=generator)
    factors = cf.eigen_factors(equations, anchor, torch.float32)  # a float32 solve, as in a trial
    with caplog.at_level("WARNING", logger="mergekit_bmm"):
        merged = cf.solve_from_factors(factors, factors.ridge(1e-6, "relative"))
    assert torch.isfinite(merged).all()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "a ridge lambda' = " in line and "lambda 0 with" not in line
