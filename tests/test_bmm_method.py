"""``bmm`` through mergekit's Python API: parameters, anchors, layouts, dtypes, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_solve, relative_error
from mergekit.merge_methods.api import merge_tensors

from mergekit_bmm.errors import BMMError, ConfigError, TensorInputError

NAME = "model.layers.2.mlp.up_proj.weight"


def inputs(shape=(16, 8), tasks=3, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=generator)
    experts = [base + 0.1 * torch.randn(shape, generator=generator) for _ in range(tasks)]
    return base.to(dtype), [e.to(dtype) for e in experts]


def bmm(tensors, name=NAME, **parameters):
    return merge_tensors(tensors, "bmm", base_index=0, name=name, parameters=parameters)


def test_task_arithmetic_anchor_matches_reference():
    base, experts = inputs()
    vectors = [e - base for e in experts]
    got = bmm([base, *experts], weight=[0.3, 0.3, 0.3], **{"lambda": 0.05})
    expected = base.double() + reference_solve(vectors, 0.3 * sum(vectors), 0.05)
    assert relative_error(got - base, expected - base.double()) < 1e-5


def test_scale_multiplies_the_merged_task_vector():
    base, experts = inputs()
    one = bmm([base, *experts], weight=[0.5] * 3, scale=1.0)
    scaled = bmm([base, *experts], weight=[0.5] * 3, scale=1.25)
    assert relative_error(scaled - base, 1.25 * (one - base)) < 1e-6


def test_pretrained_anchor_is_zero_prior():
    base, experts = inputs()
    vectors = [e - base for e in experts]
    got = bmm([base, *experts], anchor_method="pretrained", **{"lambda": 0.2})
    expected = reference_solve(vectors, torch.zeros_like(base), 0.2)
    assert relative_error(got - base, expected) < 1e-5


@pytest.mark.parametrize("anchor", ["ties", "task_arithmetic", "linear", "dare_ties"])
def test_huge_lambda_reproduces_the_anchor_method(anchor):
    base, experts = inputs(seed=1)
    parameters = {"weight": [0.4, 0.3, 0.3], "density": [0.5] * 3}
    if anchor in ("linear",):
        parameters.pop("density")
    got = bmm([base, *experts], anchor_method=anchor, **{"lambda": 1e9}, **parameters)
    if anchor == "linear":
        direct = merge_tensors(experts, "linear", name=NAME, parameters={"weight": parameters["weight"]})
    else:
        import zlib

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(NAME.encode()))
            direct = merge_tensors([base, *experts], anchor, base_index=0, name=NAME, parameters=parameters)
    assert relative_error(got, direct) < 1e-6


def test_anchor_parameters_are_forwarded():
    base, experts = inputs(seed=2)
    got = bmm(
        [base, *experts],
        anchor_method="task_arithmetic",
        weight=[1.0] * 3,
        anchor_lambda=0.5,
        **{"lambda": 1e9},
    )
    expected = base + 0.5 * sum(e - base for e in experts)
    assert relative_error(got, expected) < 1e-6


def test_marked_input_is_the_prior():
    base, experts = inputs(seed=3)
    anchor = base + 0.05 * torch.ones_like(base)
    got = bmm([base, *experts, anchor], anchor=[False, False, False, True], **{"lambda": 0.1})
    vectors = [e - base for e in experts]
    expected = reference_solve(vectors, anchor - base, 0.1)
    assert relative_error(got - base, expected) < 1e-5


def test_marked_anchor_and_anchor_method_conflict():
    base, experts = inputs(seed=3)
    with pytest.raises(ConfigError, match="only one"):
        bmm([base, *experts, base], anchor=[False, False, False, True], anchor_method="ties")


def test_non_body_tensors_get_the_anchor():
    base, experts = inputs()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.new_thing.weight"):
        got = bmm([base, *experts], name=name, weight=[0.3] * 3)
        assert relative_error(got, base + 0.3 * sum(e - base for e in experts)) < 1e-6
    bias, bias_experts = base[0], [e[0] for e in experts]
    got = bmm([bias, *bias_experts], name="model.layers.0.self_attn.q_proj.bias", anchor_method="pretrained")
    assert torch.equal(got, bias)


def test_conv1d_weights_are_solved_in_their_own_orientation():
    base, experts = inputs(shape=(8, 24))  # GPT-2 Conv1D: (in=8, out=24)
    name = "transformer.h.0.mlp.c_fc.weight"
    with pytest.raises(TensorInputError, match="set `weight_layout: out_in`"):  # no architecture: no guess
        bmm([base, *experts], name=name, anchor_method="pretrained", **{"lambda": 0.1})
    got = bmm(
        [base, *experts], name=name, anchor_method="pretrained", weight_layout="in_out", **{"lambda": 0.1}
    )
    vectors = [(e - base).T for e in experts]  # (out, in)
    expected = reference_solve(vectors, torch.zeros(24, 8), 0.1).T
    assert relative_error(got - base, expected) < 1e-5
    wrong = bmm(
        [base, *experts], name=name, anchor_method="pretrained", weight_layout="out_in", **{"lambda": 0.1}
    )
    assert relative_error(wrong - base, expected) > 1e-2


def test_bfloat16_in_bfloat16_out_computed_in_float32():
    base, experts = inputs(dtype=torch.bfloat16)
    got = bmm([base, *experts], weight=[0.3] * 3)
    assert got.dtype == torch.bfloat16
    vectors = [(e.float() - base.float()) for e in experts]
    expected = base.double() + reference_solve(vectors, 0.3 * sum(vectors), 0.1)
    assert relative_error(got, expected) < 1e-2


def test_float64_compute_is_tighter():
    base, experts = inputs(dtype=torch.float64)
    vectors = [e - base for e in experts]
    got = bmm([base, *experts], weight=[0.3] * 3, compute_dtype="float64", **{"lambda": 1e-4})
    expected = reference_solve(vectors, 0.3 * sum(vectors), 1e-4)
    assert relative_error(got - base, expected) < 1e-10


def test_lambda_zero_rank_deficient_is_finite():
    base = torch.zeros(4, 32)
    experts = [base + torch.randn(4, 32) for _ in range(2)]  # rank 8 < 32 inputs
    got = bmm([base, *experts], weight=[0.5, 0.5], **{"lambda": 0.0})
    assert torch.isfinite(got).all()


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"lambda": -1.0}, "lambda"),
        ({"anchor_method": "nope"}, "unknown method 'nope'"),
        ({"gram": "activations"}, "needs activation statistics"),
        ({"gram": "sometimes"}, "gram"),
        ({"epsilon": 2.0}, "epsilon"),
        ({"anchor_method": "task_arithmetic"}, "needs parameter `weight`"),
    ],
)
def test_bad_parameters_raise_one_line_errors(parameters, message):
    base, experts = inputs()
    with pytest.raises(BMMError, match=message) as info:
        bmm([base, *experts], **parameters)
    assert "\n" not in str(info.value)


def test_nan_input_names_tensor_and_model():
    base, experts = inputs()
    experts[1][0, 0] = float("nan")
    with pytest.raises(TensorInputError, match=rf"{NAME} of model 2 contains NaN"):
        bmm([base, *experts], weight=[0.3] * 3)


def test_mismatched_shapes_are_refused():
    base, experts = inputs()
    with pytest.raises(ValueError, match="size mismatch"):
        bmm([base, experts[0], experts[1][:, :4]], weight=[0.3] * 2)
