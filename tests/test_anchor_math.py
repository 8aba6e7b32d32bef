"""The anchor merges (pure torch) against float64 references and their defining properties.

Each reference below transcribes the published algorithm literally, in float64, including
the reference code's zero-padded slots, and draws random signs for every singular vector
pair it uses: matching them shows the merges do not depend on SVD sign choices.
"""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error

from mergekit_bmm.core import (
    ace_merge,
    iso_c_merge,
    iso_cts_merge,
    iso_cts_split,
    regmean_merge,
    shrink_off_diagonal,
    tsv_factors,
    tsv_merge,
    wudi_closed_form,
    wudi_equations,
    wudi_loss,
    wudi_merge,
)
from mergekit_bmm.errors import BMMError, ConfigError, TensorInputError

SHAPES = [(12, 8), (8, 12), (10, 10), (16, 24)]
TASK_COUNTS = [2, 3, 5, 8]
CASES = [(shape, tasks) for shape in SHAPES for tasks in TASK_COUNTS]
F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors (conftest.py)


def ids(case):
    (rows, columns), tasks = case
    return f"{rows}x{columns}-T{tasks}"


def task_vectors(shape, tasks, seed=0, rank=None):
    generator = torch.Generator().manual_seed(seed)
    if rank is None:
        return [torch.randn(shape, generator=generator, dtype=F64) for _ in range(tasks)]
    return [
        torch.randn(shape[0], rank, generator=generator, dtype=F64)
        @ torch.randn(rank, shape[1], generator=generator, dtype=F64)
        for _ in range(tasks)
    ]


def svd_with_random_signs(matrix, generator):
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    signs = torch.randint(0, 2, (s.numel(),), generator=generator).to(F64) * 2 - 1
    return u * signs, s, signs[:, None] * vh


def polar(matrix):
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


def random_orthogonal(size, generator):
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=F64))
    return q * torch.sign(torch.diagonal(r))


# ---------------------------------------------------------------- references (float64)


def reference_tsv(vectors, generator):
    """compute_and_sum_svd_mem_reduction: zero-padded slots of width r, then polar factors."""
    tasks = len(vectors)
    rank = min(vectors[0].shape)
    k = int(rank * (1 / tasks))
    slots_u = torch.zeros(vectors[0].shape[0], rank, dtype=F64)
    slots_s = torch.zeros(rank, dtype=F64)
    slots_v = torch.zeros(rank, vectors[0].shape[1], dtype=F64)
    for index, vector in enumerate(vectors):
        u, s, vh = svd_with_random_signs(vector, generator)
        slots_u[:, index * k : (index + 1) * k] = u[:, :k]
        slots_s[index * k : (index + 1) * k] = s[:k]
        slots_v[index * k : (index + 1) * k, :] = vh[:k, :]
    return polar(slots_u) @ torch.diag(slots_s) @ polar(slots_v)


def reference_iso_c(vectors, generator):
    u, s, vh = svd_with_random_signs(sum(vectors), generator)
    return u @ torch.diag(torch.full_like(s, float(s.mean()))) @ vh


def reference_iso_cts(vectors, fraction, generator):
    """iso_utils.iso_cts, literally (Python round, task slots first, common block last)."""
    tasks = len(vectors)
    rank = min(vectors[0].shape)
    common = int(rank * fraction)
    common = rank - round((rank - common) / tasks) * tasks
    per_task = int((rank - common) / tasks)
    u, s, vh = svd_with_random_signs(sum(vectors), generator)
    u_c, s_c, v_c = u[:, :common], s[:common], vh[:common, :]
    slots_u = torch.zeros(vectors[0].shape[0], rank, dtype=F64)
    slots_s = torch.zeros(rank, dtype=F64)
    slots_v = torch.zeros(rank, vectors[0].shape[1], dtype=F64)
    for index, vector in enumerate(vectors):
        residual = vector - u_c @ u_c.T @ vector
        ut, st, vt = svd_with_random_signs(residual, generator)
        span = slice(index * per_task, (index + 1) * per_task)
        slots_u[:, span], slots_s[span], slots_v[span, :] = ut[:, :per_task], st[:per_task], vt[:per_task]
    tail = slice(tasks * per_task, tasks * per_task + common)
    slots_u[:, tail], slots_s[tail], slots_v[tail, :] = u_c, s_c, v_c
    return polar(slots_u) @ torch.diag(torch.full_like(slots_s, float(slots_s.mean()))) @ polar(slots_v)


def reference_wudi_loss(merged, vectors):
    return sum(((merged - v) @ v.T).square().sum() / v.square().sum() for v in vectors)


def reference_wudi_adam(vectors, iterations, learning_rate):
    """wudi_merging: Adam on the literal loss through autograd, from the sum."""
    merged = torch.nn.Parameter(sum(vectors).clone())
    optimizer = torch.optim.Adam([merged], lr=learning_rate, weight_decay=0)
    for _ in range(iterations):
        loss = reference_wudi_loss(merged, vectors)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return merged.detach()


def reference_wudi_closed_form(vectors):
    gram = sum(v.T @ v / v.square().sum() for v in vectors)
    cross = sum(v @ v.T @ v / v.square().sum() for v in vectors)
    return cross @ torch.linalg.pinv(gram, hermitian=True)


def reference_regmean_weights(weights, grams, ratio):
    """merging_with_regmean_weights on full weights: [(ΣG̃)⁻¹ Σ G̃ Wᵀ]ᵀ, G̃ by the mask trick."""
    mask = torch.diag(torch.ones(grams[0].shape[0], dtype=F64) - ratio) + ratio
    shrunk = [g * mask for g in grams]
    total = sum(shrunk)
    return (torch.linalg.inv(total) @ sum(g @ w.T for g, w in zip(shrunk, weights))).T


def random_grams(in_features, tasks, seed, tokens=None):
    generator = torch.Generator().manual_seed(seed + 100)
    tokens = tokens or 3 * in_features
    grams = []
    for _ in range(tasks):
        x = torch.randn(tokens, in_features, generator=generator, dtype=F64)
        x = x * torch.linspace(0.2, 3.0, in_features, dtype=F64)  # uneven feature scales
        grams.append(x.T @ x / tokens)
    return grams


# ---------------------------------------------------------------- TSV


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_tsv_matches_reference(case):
    shape, tasks = case
    vectors = task_vectors(shape, tasks, seed=tasks)
    expected = reference_tsv(vectors, torch.Generator().manual_seed(1))
    assert relative_error(tsv_merge(vectors), expected) < 1e-10


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_tsv_task_blocks_are_orthogonal(case):
    shape, tasks = case
    vectors = task_vectors(shape, tasks, seed=10 + tasks)
    left, singular, right = tsv_factors(vectors)
    kept = (min(shape) // tasks) * tasks
    assert left.shape == (shape[0], kept) and right.shape == (kept, shape[1])
    eye = torch.eye(kept, dtype=F64)
    assert relative_error(left.T @ left, eye) < 1e-10
    assert relative_error(right @ right.T, eye) < 1e-10
    assert relative_error((left * singular) @ right, tsv_merge(vectors)) < 1e-12


def test_tsv_of_already_orthogonal_tasks_is_their_sum():
    generator = torch.Generator().manual_seed(3)
    rows, columns, tasks, rank = 24, 16, 4, 3  # k = 4 >= rank 3
    left = random_orthogonal(rows, generator)[:, : tasks * rank]
    right = random_orthogonal(columns, generator)[:, : tasks * rank]
    vectors = []
    for t in range(tasks):
        block = slice(t * rank, (t + 1) * rank)
        values = torch.rand(rank, generator=generator, dtype=F64) + 0.5
        vectors.append(left[:, block] @ torch.diag(values) @ right[:, block].T)
    assert relative_error(tsv_merge(vectors), sum(vectors)) < 1e-12


def test_tsv_with_more_tasks_than_rank_falls_back_to_the_mean():
    vectors = task_vectors((3, 16), 5)
    assert relative_error(tsv_merge(vectors), sum(vectors) / 5) < 1e-14


# ---------------------------------------------------------------- ISO-C / ISO-CTS


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_iso_c_matches_reference(case):
    shape, tasks = case
    vectors = task_vectors(shape, tasks, seed=20 + tasks)
    expected = reference_iso_c(vectors, torch.Generator().manual_seed(2))
    assert relative_error(iso_c_merge(vectors), expected) < 1e-10


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_iso_cts_matches_reference(case):
    shape, tasks = case
    vectors = task_vectors(shape, tasks, seed=30 + tasks)
    expected = reference_iso_cts(vectors, 0.8, torch.Generator().manual_seed(3))
    assert relative_error(iso_cts_merge(vectors, 0.8), expected) < 1e-10


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.8])
def test_iso_cts_matches_reference_at_other_fractions(fraction):
    vectors = task_vectors((20, 12), 3, seed=4)
    expected = reference_iso_cts(vectors, fraction, torch.Generator().manual_seed(4))
    assert relative_error(iso_cts_merge(vectors, fraction), expected) < 1e-10


@pytest.mark.parametrize("merge", [iso_c_merge, iso_cts_merge], ids=["iso_c", "iso_cts"])
@pytest.mark.parametrize("case", CASES[::3], ids=ids)
def test_iso_outputs_have_a_flat_spectrum(merge, case):
    shape, tasks = case
    vectors = task_vectors(shape, tasks, seed=40 + tasks)
    singular = torch.linalg.svdvals(merge(vectors))
    assert float(singular.max() - singular.min()) < 1e-10 * float(singular.max())


def test_iso_c_keeps_the_sum_singular_vectors_and_nuclear_norm():
    vectors = task_vectors((14, 9), 3, seed=5)
    total = sum(vectors)
    merged = iso_c_merge(vectors)
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    assert relative_error(merged, float(s.mean()) * u @ vh) < 1e-12
    assert abs(torch.linalg.matrix_norm(merged, "nuc") - s.sum()) < 1e-10 * s.sum()


def test_iso_cts_with_the_whole_rank_in_common_is_iso_c():
    vectors = task_vectors((10, 15), 4, seed=6)
    assert relative_error(iso_cts_merge(vectors, 1.0), iso_c_merge(vectors)) < 1e-12


@pytest.mark.parametrize(
    "rank, tasks, fraction, expected",
    [
        (16, 4, 0.8, (12, 1)),
        (64, 3, 0.8, (52, 4)),
        (768, 8, 0.8, (616, 19)),
        (6, 4, 0.0, (2, 1)),
        (8, 3, 1.0, (8, 0)),
    ],
)
def test_iso_cts_split(rank, tasks, fraction, expected):
    common, per_task = iso_cts_split(rank, tasks, fraction)
    assert (common, per_task) == expected
    assert common >= 0 and common + tasks * per_task == rank


@pytest.mark.parametrize("merge", [tsv_merge, iso_c_merge, iso_cts_merge], ids=["tsv", "iso_c", "iso_cts"])
def test_low_rank_inputs_give_no_arbitrary_directions(merge):
    """Rank-deficient sums (LoRA-like experts): rotating the inputs rotates the output exactly.

    Null-space singular vectors are arbitrary; had any reached the output, the output would
    not follow a rotation of the inputs.
    """
    generator = torch.Generator().manual_seed(7)
    vectors = task_vectors((20, 16), 3, seed=7, rank=2)  # rank(Σ) = 6 < 16
    left, right = random_orthogonal(20, generator), random_orthogonal(16, generator)
    rotated = merge([left @ v @ right for v in vectors])
    assert relative_error(rotated, left @ merge(vectors) @ right) < 1e-10
    assert int(torch.linalg.matrix_rank(merge(vectors))) <= 6


def test_iso_c_on_a_low_rank_sum_flattens_the_nonzero_spectrum():
    vectors = task_vectors((20, 16), 3, seed=8, rank=2)
    u, s, vh = torch.linalg.svd(sum(vectors), full_matrices=False)
    expected = float(s[:6].mean()) * u[:, :6] @ vh[:6]
    assert relative_error(iso_c_merge(vectors), expected) < 1e-10


@pytest.mark.parametrize("merge", [tsv_merge, iso_c_merge, iso_cts_merge, wudi_closed_form])
def test_all_zero_task_vectors_merge_to_zero(merge):
    zeros = [torch.zeros(6, 4, dtype=F64) for _ in range(3)]
    assert torch.equal(merge(zeros), zeros[0])


def test_identical_experts_are_deterministic():
    vector = task_vectors((12, 8), 1, seed=9)[0]
    for merge in (tsv_merge, iso_cts_merge):
        first = merge([vector, vector.clone(), vector.clone()])
        assert torch.isfinite(first).all()
        assert torch.equal(first, merge([vector, vector.clone(), vector.clone()]))


# ---------------------------------------------------------------- WUDI


@pytest.mark.parametrize("case", CASES[::2], ids=ids)
def test_wudi_adam_matches_reference(case):
    shape, tasks = case
    vectors = [0.01 * v for v in task_vectors(shape, tasks, seed=50 + tasks)]
    expected = reference_wudi_adam(vectors, 300, 1e-5)
    got = wudi_merge(vectors, solver="adam", iterations=300, learning_rate=1e-5)
    assert relative_error(got, expected) < 1e-9


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_wudi_loss_and_closed_form_match_reference(case):
    shape, tasks = case
    vectors = task_vectors(shape, tasks, seed=60 + tasks)
    merged = sum(vectors) / tasks
    assert relative_error(wudi_loss(merged, vectors), reference_wudi_loss(merged, vectors)) < 1e-12
    assert relative_error(wudi_closed_form(vectors), reference_wudi_closed_form(vectors)) < 1e-8


@pytest.mark.parametrize("case", CASES[::3], ids=ids)
def test_wudi_adam_decreases_the_loss(case):
    shape, tasks = case
    vectors = [0.01 * v for v in task_vectors(shape, tasks, seed=70 + tasks)]
    losses = [
        float(wudi_loss(wudi_merge(vectors, iterations=n, learning_rate=1e-4), vectors)) for n in (0, 50, 300)
    ]
    assert losses[0] == pytest.approx(float(wudi_loss(sum(vectors), vectors)), rel=1e-12)
    assert losses[0] > losses[1] > losses[2]
    assert losses[2] >= float(wudi_loss(wudi_closed_form(vectors), vectors))


@pytest.mark.parametrize("shape, tasks", [((12, 8), 3), ((8, 12), 5), ((2, 12), 3)])
def test_wudi_closed_form_is_the_stationary_point(shape, tasks):
    """Zero gradient 2(τC − D); every perturbation raises the loss; (2, 12) has a singular C."""
    vectors = task_vectors(shape, tasks, seed=80 + tasks)
    gram, cross = wudi_equations(vectors)
    solution = wudi_closed_form(vectors)
    assert relative_error(solution @ gram, cross) < 1e-10
    best = float(wudi_loss(solution, vectors))
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        nudge = 1e-3 * torch.randn(shape, generator=generator, dtype=F64)
        assert float(wudi_loss(solution + nudge, vectors)) >= best
    # minimum norm: no component in directions no task vector reaches
    null_projector = torch.eye(shape[1], dtype=F64) - torch.linalg.pinv(gram, hermitian=True) @ gram
    assert float((solution @ null_projector).norm()) < 1e-10 * float(solution.norm())


def test_wudi_ignores_zero_task_vectors():
    vectors = task_vectors((10, 6), 3, seed=11)
    with_zero = [*vectors, torch.zeros(10, 6, dtype=F64)]
    assert relative_error(wudi_closed_form(with_zero), wudi_closed_form(vectors)) < 1e-12
    assert float(wudi_loss(sum(vectors), with_zero)) == pytest.approx(float(wudi_loss(sum(vectors), vectors)))


def test_wudi_is_bit_reproducible():
    vectors = [v.float() for v in task_vectors((24, 16), 4, seed=12)]
    assert torch.equal(wudi_merge(vectors), wudi_merge(vectors))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"solver": "sgd"}, "solver"),
        ({"iterations": -1}, "iterations"),
        ({"learning_rate": 0.0}, "learning_rate"),
    ],
)
def test_wudi_rejects_bad_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        wudi_merge(task_vectors((4, 4), 2), **kwargs)


# ---------------------------------------------------------------- RegMean


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.0])
def test_regmean_on_weights_is_base_plus_regmean_on_task_vectors(case, ratio):
    shape, tasks = case
    generator = torch.Generator().manual_seed(tasks)
    base = torch.randn(shape, generator=generator, dtype=F64)
    vectors = task_vectors(shape, tasks, seed=90 + tasks)
    grams = random_grams(shape[1], tasks, seed=tasks)
    expected = reference_regmean_weights([base + v for v in vectors], grams, ratio)
    got = base + regmean_merge(vectors, grams, off_diagonal_scale=ratio)
    assert relative_error(got - base, expected - base) < 1e-9


@pytest.mark.parametrize("singular", [False, True])
def test_regmean_with_identical_grams_is_the_average(singular):
    vectors = task_vectors((10, 12), 4, seed=13)
    tokens = 5 if singular else 40  # 5 tokens: rank-5 Gram of a 12-input layer
    (gram,) = random_grams(12, 1, seed=13, tokens=tokens)
    got = regmean_merge(vectors, [gram] * 4, off_diagonal_scale=1.0)
    assert relative_error(got, sum(vectors) / 4) < 1e-10


def test_regmean_without_off_diagonal_is_a_per_feature_weighted_average():
    vectors = task_vectors((6, 5), 3, seed=14)
    grams = random_grams(5, 3, seed=14)
    weights = torch.stack([torch.diagonal(g) for g in grams])  # (T, in)
    expected = sum(v * w for v, w in zip(vectors, weights)) / weights.sum(0)
    assert relative_error(regmean_merge(vectors, grams, off_diagonal_scale=0.0), expected) < 1e-12


def test_regmean_singular_grams_solve_what_they_see_and_keep_the_mean_elsewhere():
    vectors = task_vectors((7, 12), 2, seed=15)
    grams = random_grams(12, 2, seed=15, tokens=4)  # Σ G has rank 8 < 12
    got = regmean_merge(vectors, grams, off_diagonal_scale=1.0)
    total = sum(grams)
    projector = torch.linalg.pinv(total, hermitian=True) @ total
    assert relative_error(got @ total, sum(v @ g for v, g in zip(vectors, grams))) < 1e-9
    mean = sum(vectors) / 2
    assert (
        relative_error(got @ (torch.eye(12, dtype=F64) - projector), mean @ (torch.eye(12) - projector))
        < 1e-9
    )


def test_shrink_off_diagonal():
    gram = random_grams(4, 1, seed=16)[0]
    shrunk = shrink_off_diagonal(gram, 0.3)
    assert relative_error(shrunk, 0.3 * gram + 0.7 * torch.diag(torch.diagonal(gram))) < 1e-15
    with pytest.raises(ConfigError, match="off_diagonal_scale"):
        shrink_off_diagonal(gram, 1.5)


def test_regmean_rejects_mismatched_grams():
    vectors = task_vectors((4, 6), 2)
    with pytest.raises(TensorInputError, match=r"Gram 1 has shape \(5, 5\)"):
        regmean_merge(vectors, [torch.eye(6), torch.eye(5)])
    with pytest.raises(TensorInputError, match="2 task vectors"):
        regmean_merge(vectors, [torch.eye(6)])


# ---------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize(
    "merge",
    [tsv_merge, iso_c_merge, iso_cts_merge, wudi_merge, lambda v: regmean_merge(v, [torch.eye(8)] * len(v))],
    ids=["tsv", "iso_c", "iso_cts", "wudi", "regmean"],
)
def test_half_precision_inputs_are_computed_in_float32(merge):
    vectors = [v.to(torch.bfloat16) for v in task_vectors((12, 8), 3, seed=17)]
    got = merge(vectors)
    assert got.dtype == torch.float32
    expected = merge([v.double() for v in vectors])
    assert relative_error(got, expected) < 1e-4


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TensorInputError, match="2D"):
        tsv_merge([torch.zeros(3)])
    with pytest.raises(TensorInputError, match=r"task vector 1 has shape \(4, 3\)"):
        iso_c_merge([torch.zeros(3, 4), torch.zeros(4, 3)])
    with pytest.raises(BMMError, match="at least one"):
        wudi_merge([])
    with pytest.raises(ConfigError, match="common_space_fraction"):
        iso_cts_merge(task_vectors((4, 4), 2), 1.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_merges_run_on_the_inputs_device():
    vectors = [v.float().cuda() for v in task_vectors((32, 24), 3, seed=18)]
    for merge in (tsv_merge, iso_c_merge, iso_cts_merge, wudi_merge):
        got = merge(vectors)
        assert got.device.type == "cuda"
        assert relative_error(got.cpu(), merge([v.cpu() for v in vectors])) < 1e-4


def reference_ace(vectors, eps=1e-2, k_frac=0.3):
    """ACE-Merging as its paper and public code define it, written out in float64 with numpy-style
    loops: traces, the γ test, centred covariances, the row-broadcast prior, the inverse, and the
    rank-k isotropic refinement."""
    tasks = len(vectors)
    d_in = vectors[0].shape[1]
    traces = torch.tensor([float(torch.trace(v.T @ v)) for v in vectors], dtype=F64)
    logs = torch.log(traces + 1e-12)
    normalise = tasks > 1 and float(logs.var(correction=1) / (logs.mean() ** 2 + 1e-12)) > 0.3
    sigmas, weighted, total = [], torch.zeros_like(vectors[0]), torch.zeros(d_in, d_in, dtype=F64)
    for v in vectors:
        centred = v - v.mean(dim=0, keepdim=True)
        sigma = centred.T @ centred
        trace = float(torch.trace(sigma)) + 1e-12
        sigma, ridge = (sigma / trace, eps / trace) if normalise else (sigma, eps)
        sigmas.append(sigma)
        regularised = sigma + ridge * torch.eye(d_in, dtype=F64)
        weighted += centred @ regularised
        total += regularised
    prior = torch.stack(sigmas).sum(dim=0).mean(dim=0)
    if normalise:
        prior = prior / (float(traces.mean()) + 1e-12)
    system = total + prior.unsqueeze(0).expand(d_in, d_in)
    merged = weighted @ torch.linalg.inv(system)
    if not normalise:
        return merged
    mean_total = total / tasks
    fused = merged + sum(v @ (s - mean_total) for v, s in zip(vectors, sigmas))
    u, s, vh = torch.linalg.svd(fused, full_matrices=False)
    k = int(s.numel() * k_frac)
    return merged + s[:k].mean() * (u[:, :k] @ vh[:k, :]) if k else merged


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["like-sized", "heterogeneous"])
def test_ace_matches_reference(case, spread):
    shape, tasks = case
    vectors = [v * 0.01 * spread**index for index, v in enumerate(task_vectors(shape, tasks, seed=7))]
    from mergekit_bmm.core.ace import heterogeneous_scales

    assert heterogeneous_scales(vectors) == (spread > 1.0)
    assert relative_error(ace_merge(vectors), reference_ace(vectors)) < 1e-10
    assert (
        relative_error(ace_merge(vectors, ridge=0.5, rank_fraction=0.6), reference_ace(vectors, 0.5, 0.6))
        < 1e-10
    )
    float32 = ace_merge([v.float() for v in vectors])
    assert float32.dtype == torch.float32 and relative_error(float32, reference_ace(vectors)) < 1e-3


def test_ace_of_identical_experts_of_like_size_keeps_their_direction():
    """One expert repeated: no normalisation, and the merge is that expert's update shrunk by the ridge."""
    vector = task_vectors((8, 6), 1, seed=3)[0]
    merged = ace_merge([vector, vector.clone()], ridge=0.0)
    centred = vector - vector.mean(dim=0, keepdim=True)
    assert torch.isfinite(merged).all()
    cosine = float((merged * centred).sum() / (merged.norm() * centred.norm()))
    assert cosine > 0.9
