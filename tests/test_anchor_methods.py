"""tsv, iso_c, iso_cts, wudi and regmean through mergekit's Python API, standalone and as bmm's anchor."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import reference_solve, relative_error
from mergekit.merge_methods.api import merge_tensors

from mergekit_bmm.core import ace_merge, iso_c_merge, iso_cts_merge, regmean_merge, tsv_merge, wudi_merge
from mergekit_bmm.errors import BMMError, ConfigError, StatisticsError, TensorInputError
from mergekit_bmm.examples.synthetic_stats import random_gram, write_stats

NAME = "model.layers.1.mlp.down_proj.weight"
IDS = ("/nonexistent/base", *(f"/nonexistent/expert-{letter}" for letter in "abcdefgh"))
EXPERTS = IDS[1:4]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors (conftest.py)


def inputs(shape=(16, 8), tasks=3, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=generator)
    experts = [base + 0.1 * torch.randn(shape, generator=generator) for _ in range(tasks)]
    return base.to(dtype), [e.to(dtype) for e in experts]


def merge(method, tensors, name=NAME, **parameters):
    return merge_tensors(
        tensors, method, base_index=0, name=name, ids=IDS[: len(tensors)], parameters=parameters
    )


def float64_vectors(base, experts, transpose=False):
    vectors = [e.double() - base.double() for e in experts]
    return [v.T for v in vectors] if transpose else vectors


# (method, recipe parameters, the matrix algorithm with those parameters, output scale)
CASES = [
    ("tsv", {}, tsv_merge, 1.0),
    ("tsv", {"alpha": 0.7}, tsv_merge, 0.7),
    ("iso_c", {"alpha": 1.3}, iso_c_merge, 1.3),
    ("iso_cts", {}, iso_cts_merge, 1.0),
    (
        "iso_cts",
        {"alpha": 0.9, "common_space_fraction": 0.5},
        partial(iso_cts_merge, common_space_fraction=0.5),
        0.9,
    ),
    ("wudi", {}, wudi_merge, 1.0),
    ("ace", {}, ace_merge, 1.0),
    (
        "ace",
        {"alpha": 0.8, "ridge": 0.1, "rank_fraction": 0.5},
        partial(ace_merge, ridge=0.1, rank_fraction=0.5),
        0.8,
    ),
    ("wudi", {"solver": "closed_form"}, partial(wudi_merge, solver="closed_form"), 1.0),
    (
        "wudi",
        {"iterations": 20, "learning_rate": 1e-3},
        partial(wudi_merge, iterations=20, learning_rate=1e-3),
        1.0,
    ),
]


def case_id(case):
    method, parameters, _, _ = case
    return method + "".join(f"-{k}={v}" for k, v in parameters.items())


@pytest.fixture
def stats(tmp_path):
    """A statistics directory for NAME (in = 8) and the three experts."""
    generator = torch.Generator().manual_seed(5)
    grams = {NAME: [random_gram(8, generator) for _ in EXPERTS]}
    return write_stats(tmp_path / "stats", EXPERTS, grams), grams[NAME]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_body_weights_get_the_matrix_algorithm(case):
    method, parameters, algorithm, alpha = case
    base, experts = inputs()
    got = merge(method, [base, *experts], **parameters)
    expected = alpha * algorithm(float64_vectors(base, experts))
    assert got.dtype == torch.float32
    assert relative_error(got - base, expected) < 1e-5


def test_regmean_reads_the_statistics_directory(stats):
    stats_dir, grams = stats
    base, experts = inputs()
    vectors = float64_vectors(base, experts)
    got = merge("regmean", [base, *experts], stats=str(stats_dir))
    assert relative_error(got - base, regmean_merge(vectors, [g.double() for g in grams], 0.5)) < 1e-5
    plain = merge("regmean", [base, *experts], stats=str(stats_dir), off_diagonal_scale=1.0)
    assert relative_error(plain - base, regmean_merge(vectors, [g.double() for g in grams], 1.0)) < 1e-5
    assert relative_error(plain, got) > 1e-3


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts", "wudi", "regmean", "ace"])
@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.self_attn.q_proj.bias", (16,)),
        ("model.layers.0.input_layernorm.weight", (16,)),
        ("model.embed_tokens.weight", (32, 16)),
        ("lm_head.weight", (32, 16)),
        ("model.layers.0.brand_new_thing.weight", (16, 16)),
    ],
)
def test_other_tensors_get_the_mean_of_task_vectors(method, name, shape, stats):
    base, experts = inputs(shape=shape)
    parameters = {"stats": str(stats[0])} if method == "regmean" else {"alpha": 0.5}
    if method in ("wudi", "regmean"):
        parameters.pop("alpha", None)
    got = merge(method, [base, *experts], name=name, **parameters)
    alpha = parameters.get("alpha", 1.0)
    expected = alpha * sum(float64_vectors(base, experts)) / 3
    assert relative_error(got - base, expected) < 1e-6


@pytest.mark.parametrize(
    "method, parameters, algorithm",
    [
        ("iso_cts", {}, iso_cts_merge),
        ("wudi", {"solver": "closed_form"}, partial(wudi_merge, solver="closed_form")),
        ("tsv", {}, tsv_merge),
    ],
)
def test_gpt2_conv1d_weights_are_merged_as_out_by_in(method, parameters, algorithm):
    base, experts = inputs(shape=(8, 24))  # Conv1D storage: (in=8, out=24)
    name = "transformer.h.0.mlp.c_fc.weight"
    with pytest.raises(TensorInputError, match="cannot tell whether"):  # no architecture: no guess
        merge(method, [base, *experts], name=name, **parameters)
    got = merge(method, [base, *experts], name=name, weight_layout="in_out", **parameters)
    expected = algorithm(float64_vectors(base, experts, transpose=True)).T
    assert relative_error(got - base, expected) < 1e-5
    if method != "tsv":  # TSV is transpose-equivariant; ISO-CTS and WUDI are not
        assert relative_error(got - base, algorithm(float64_vectors(base, experts))) > 1e-2


def test_regmean_reads_conv1d_grams_on_the_input_side(tmp_path):
    base, experts = inputs(shape=(8, 24))
    name = "transformer.h.0.mlp.c_fc.weight"
    generator = torch.Generator().manual_seed(6)
    grams = [random_gram(8, generator) for _ in EXPERTS]
    stats_dir = write_stats(tmp_path / "stats", EXPERTS, {name: grams})
    got = merge("regmean", [base, *experts], name=name, stats=str(stats_dir), weight_layout="in_out")
    vectors = float64_vectors(base, experts, transpose=True)
    assert relative_error(got - base, regmean_merge(vectors, [g.double() for g in grams]).T) < 1e-5


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts", "wudi"])
def test_bfloat16_in_bfloat16_out(method):
    base, experts = inputs(dtype=torch.bfloat16)
    got = merge(method, [base, *experts])
    assert got.dtype == torch.bfloat16
    exact = merge(method, [base.double(), *(e.double() for e in experts)])
    assert relative_error(got, exact) < 1e-2


def test_wudi_output_is_reproducible():
    base, experts = inputs(shape=(24, 16), tasks=4)
    assert torch.equal(merge("wudi", [base, *experts]), merge("wudi", [base, *experts]))


def test_nan_input_names_tensor_and_model():
    base, experts = inputs()
    experts[2][1, 1] = float("inf")
    with pytest.raises(TensorInputError, match=rf"{NAME} of model {EXPERTS[2]} contains NaN"):
        merge("iso_cts", [base, *experts])


@pytest.mark.parametrize(
    "method, parameters, message",
    [
        ("tsv", {"alpha": float("nan")}, "tsv parameter `alpha` must be a finite number"),
        ("iso_c", {"alpha": "big"}, "iso_c parameter `alpha`: 'big' is not a valid number"),
        (
            "iso_cts",
            {"common_space_fraction": 1.5},
            r"iso_cts parameter `common_space_fraction` must be a finite number in \[0, 1\]",
        ),
        ("wudi", {"solver": "sgd"}, "wudi parameter `solver`: 'sgd' is not a valid solver"),
        ("wudi", {"iterations": -3}, "wudi parameter `iterations` must be an integer >= 0"),
        ("wudi", {"learning_rate": 0.0}, "wudi parameter `learning_rate` must be a finite number > 0"),
        ("regmean", {}, "regmean needs activation statistics"),
        ("regmean", {"stats": "/nonexistent/stats"}, "is not a statistics directory"),
    ],
)
def test_bad_parameters_raise_one_line_errors(method, parameters, message):
    base, experts = inputs()
    with pytest.raises(BMMError, match=message) as info:
        merge(method, [base, *experts], **parameters)
    assert "\n" not in str(info.value)


def test_regmean_statistics_errors(stats, tmp_path):
    stats_dir, _ = stats
    base, experts = inputs()
    with pytest.raises(StatisticsError, match="have no Gram for model.layers.1.mlp.up_proj.weight"):
        merge("regmean", [base, *experts], name="model.layers.1.mlp.up_proj.weight", stats=str(stats_dir))
    with pytest.raises(ConfigError, match="off_diagonal_scale"):
        merge("regmean", [base, *experts], stats=str(stats_dir), off_diagonal_scale=-0.1)
    wide_base, wide_experts = inputs(shape=(16, 12))
    with pytest.raises(StatisticsError, match=r"the Gram is 8x8 but the weight has 12 inputs"):
        merge("regmean", [wide_base, *wide_experts], stats=str(stats_dir))
    generator = torch.Generator().manual_seed(1)
    broken = [random_gram(8, generator) for _ in EXPERTS]
    broken[1][0, 0] = float("nan")
    broken_dir = write_stats(tmp_path / "broken", EXPERTS, {NAME: broken})
    with pytest.raises(StatisticsError, match="the Gram contains NaN or Inf"):
        merge("regmean", [base, *experts], stats=str(broken_dir))


# ---------------------------------------------------------------- as bmm's anchor


def bmm(tensors, name=NAME, **parameters):
    return merge("bmm", tensors, name=name, **parameters)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bmm_with_a_huge_lambda_reproduces_the_anchor(case):
    method, parameters, _, _ = case
    base, experts = inputs(seed=2)
    direct = merge(method, [base, *experts], **parameters)
    got = bmm([base, *experts], anchor_method=method, **{"lambda": 1e9}, **parameters)
    assert relative_error(got, direct) < 1e-6


@pytest.mark.parametrize("method", ["tsv", "iso_cts", "wudi"])
def test_bmm_solves_around_the_anchor(method):
    base, experts = inputs(seed=3)
    vectors = float64_vectors(base, experts)
    anchor = (
        merge(method, [base, *experts], alpha=1.2) if method != "wudi" else merge(method, [base, *experts])
    )
    extra = {"alpha": 1.2} if method != "wudi" else {}
    got = bmm([base, *experts], anchor_method=method, **{"lambda": 0.05}, **extra)
    expected = reference_solve(vectors, anchor.double() - base.double(), 0.05)
    assert relative_error(got - base, expected) < 1e-5


def test_bmm_regmean_anchor_uses_bmm_stats(stats):
    stats_dir, _ = stats
    base, experts = inputs(seed=4)
    direct = merge("regmean", [base, *experts], stats=str(stats_dir), off_diagonal_scale=0.8)
    got = bmm(
        [base, *experts],
        anchor_method="regmean",
        stats=str(stats_dir),
        off_diagonal_scale=0.8,
        **{"lambda": 1e9},
    )
    assert relative_error(got, direct) < 1e-6


def test_bmm_anchor_stats_overrides_bmm_stats(stats, tmp_path):
    stats_dir, _ = stats
    generator = torch.Generator().manual_seed(9)
    other_dir = write_stats(tmp_path / "other", EXPERTS, {NAME: [random_gram(8, generator) for _ in EXPERTS]})
    base, experts = inputs(seed=4)
    from_other = merge("regmean", [base, *experts], stats=str(other_dir))
    got = bmm(
        [base, *experts],
        anchor_method="regmean",
        stats=str(stats_dir),
        anchor_stats=str(other_dir),
        **{"lambda": 1e9},
    )
    assert relative_error(got, from_other) < 1e-6
    assert relative_error(got, merge("regmean", [base, *experts], stats=str(stats_dir))) > 1e-3


def test_bmm_regmean_anchor_without_any_stats_says_so():
    base, experts = inputs()
    with pytest.raises(ConfigError, match="regmean needs activation statistics"):
        bmm([base, *experts], anchor_method="regmean")


def test_bmm_data_assisted_at_lambda_zero_is_plain_regmean(stats):
    """λ → 0 of the data-assisted MAP is RegMean on task vectors with α = 1 (any anchor)."""
    stats_dir, _ = stats
    base, experts = inputs(seed=5)
    got = bmm(
        [base, *experts],
        anchor_method="regmean",
        gram="activations",
        stats=str(stats_dir),
        compute_dtype="float64",
        **{"lambda": 0.0},
    )
    plain = merge("regmean", [base, *experts], stats=str(stats_dir), off_diagonal_scale=1.0)
    assert relative_error(got, plain) < 1e-5


def test_bmm_passes_anchor_parameter_errors_through():
    base, experts = inputs()
    with pytest.raises(ConfigError, match="wudi parameter `solver`"):
        bmm([base, *experts], anchor_method="wudi", solver="lbfgs")
