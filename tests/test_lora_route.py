"""LoRA experts through bmm's low-rank route, in real merges: each weight equals the float64 closed
form of the adapters' exact updates, untouched modules keep the anchor, and the full route, the factor
cache and ``lambda: auto`` agree with it."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import load_weights, relative_error
from safetensors.torch import load_file

from mergekit_bmm.cards.merge_record import read_record
from mergekit_bmm.core import closed_form, normal_equations
from mergekit_bmm.plugin.run import merge_recipe_text

F64 = torch.float64
TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_family(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_lora_adapter, make_tiny_family

    root = tmp_path_factory.mktemp("lora")
    family = make_tiny_family(root, "llama", n_experts=1, hidden=32, layers=2)
    adapters = [make_lora_adapter(family.base, root / f"adapter-{i}", seed=i, rank=2 + i) for i in range(3)]
    return family.base, adapters


@pytest.fixture(autouse=True)
def lora_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEKIT_BMM_CACHE", str(tmp_path / "plugin-cache"))


def _recipe(base, adapters, **parameters) -> str:
    """A recipe over the adapters; ``gram_sharing: weight`` unless given (most references here are one
    weight's own closed form; the default ``input`` pools q's and v's adapters, tested on its own);
    a parameter given as None is left out (bmm's default)."""
    parameters = {k: v for k, v in {"gram_sharing": "weight", **parameters}.items() if v is not None}
    return yaml.safe_dump(
        {
            "merge_method": "bmm",
            "base_model": str(base),
            "models": [{"model": f"{base}+{a}", "parameters": {"weight": 0.3}} for a in adapters],
            "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.05, **parameters},
            "dtype": "float32",
        }
    )


def _exact_updates(adapters, module: str) -> list[torch.Tensor]:
    """Each adapter's α/r · B A for ``module`` in float64, read straight from its files."""
    updates = []
    for adapter in adapters:
        config = json.loads((adapter / "adapter_config.json").read_text())
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        key = f"base_model.model.{module}"
        b, a = tensors[f"{key}.lora_B.weight"].double(), tensors[f"{key}.lora_A.weight"].double()
        updates.append(config["lora_alpha"] / config["r"] * b @ a)
    return updates


@pytest.mark.parametrize(("compute", "tolerance"), [("float32", 1e-5), ("float64", 1e-6)])
def test_each_lora_weight_is_the_float64_closed_form_of_the_exact_updates(
    lora_family, tmp_path, compute, tolerance
):
    base, adapters = lora_family
    out = tmp_path / "merged"
    merge_recipe_text(_recipe(base, adapters, compute_dtype=compute), out)
    merged, pre = load_weights(out), load_weights(base)
    solved = [n for n in pre if n.endswith(".weight") and any(t in n for t in TARGETS)]
    assert len(solved) == 2 * 3
    for name in solved:
        vectors = _exact_updates(adapters, name.removesuffix(".weight"))
        anchor = 0.3 * sum(vectors)  # Task Arithmetic of the adapters themselves, not of their rounded copies
        equations = normal_equations.data_free_equations(vectors, F64)
        expected = closed_form.merge_matrix(equations, anchor, 0.05)
        assert relative_error(merged[name].double() - pre[name].double(), expected) < tolerance, name
    untouched = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight")
    for name in (*untouched, "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(merged[name], pre[name])  # no adapter touches them: the anchor (the base)
    record = read_record(out)
    assert "model.layers.0.self_attn.o_proj.weight" in record.kept_at_anchor["no_experts"]
    assert record.low_rank == dict.fromkeys(solved, 2 + 3 + 4)  # the route taken: a rank-9 subspace


def test_under_the_default_gram_sharing_each_weight_pools_its_siblings_adapters(lora_family, tmp_path):
    """q and v (adapted) and k (not) read one input: each is solved on the low-rank route with the
    Gram their adapters pool, as the float64 closed form of the exact updates says; cached too."""
    base, adapters = lora_family
    for label, extra in (("direct", {}), ("cached", {"cache": str(tmp_path / "factors")})):
        merge_recipe_text(_recipe(base, adapters, gram_sharing=None, **extra), tmp_path / label)
    pre = load_weights(base)
    rank = 2 * (2 + 3 + 4)  # q's and v's adapters span the input's subspace together
    for label in ("direct", "cached"):
        merged = load_weights(tmp_path / label)
        assert read_record(tmp_path / label).low_rank == {
            **{
                f"model.layers.{i}.self_attn.{p}.weight": rank for i in range(2) for p in ("q_proj", "v_proj")
            },
            **{f"model.layers.{i}.mlp.down_proj.weight": 2 + 3 + 4 for i in range(2)},
        }
        for layer in range(2):
            attention = f"model.layers.{layer}.self_attn"
            updates = {p: _exact_updates(adapters, f"{attention}.{p}") for p in ("q_proj", "v_proj")}
            pooled = [q.T @ q + v.T @ v for q, v in zip(updates["q_proj"], updates["v_proj"])]
            for part, vectors in updates.items():
                equations = normal_equations.pooled_equations(vectors, pooled, 1, F64)
                expected = closed_form.merge_matrix(equations, 0.3 * sum(vectors), 0.05)
                name = f"{attention}.{part}.weight"
                assert relative_error(merged[name].double() - pre[name].double(), expected) < 1e-5, name
                own = normal_equations.data_free_equations(vectors, F64)
                assert (
                    relative_error(closed_form.merge_matrix(own, 0.3 * sum(vectors), 0.05), expected) > 1e-3
                )
            assert torch.equal(merged[f"{attention}.k_proj.weight"], pre[f"{attention}.k_proj.weight"])


def test_under_gram_sharing_input_untouched_weights_keep_a_dense_anchor_with_their_line(
    lora_family, tmp_path
):
    """TIES (a dense anchor): gate and up, which no adapter touches, pool only with each other and keep
    the anchor, counted as kept; k (untouched, pooled with q and v) is solved against their pool."""
    base, adapters = lora_family
    recipe = yaml.safe_load(_recipe(base, adapters, gram_sharing="input"))
    recipe["parameters"]["anchor_method"] = "ties"
    for model in recipe["models"]:
        model["parameters"] = {"weight": 1.0, "density": 0.5}
    merge_recipe_text(yaml.safe_dump(recipe), tmp_path / "merged")
    record = read_record(tmp_path / "merged")
    kept = record.kept_at_anchor["no_experts"]
    assert {f"model.layers.{i}.mlp.{p}.weight" for i in range(2) for p in ("gate_proj", "up_proj")} <= set(
        kept
    )
    assert "model.layers.0.self_attn.k_proj.weight" in record.low_rank  # solved against q's and v's pool


def test_a_task_arithmetic_anchor_keeps_mergekit_s_weights_normalize_and_lambda(lora_family, tmp_path):
    """The anchor formed from the factors is mergekit's Task Arithmetic of the adapters: per-model
    weights, ``normalize`` and ``lambda`` as mergekit reads them."""
    base, adapters = lora_family
    weights = (0.2, 0.5, 0.9)
    recipe = yaml.safe_load(_recipe(base, adapters, normalize=True, **{"anchor_lambda": 0.5}))
    for model, weight in zip(recipe["models"], weights):
        model["parameters"]["weight"] = weight
    merge_recipe_text(yaml.safe_dump(recipe), tmp_path / "merged")
    merged, pre = load_weights(tmp_path / "merged"), load_weights(base)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        vectors = _exact_updates(adapters, name.removesuffix(".weight"))
        anchor = 0.5 * sum(w * v for w, v in zip(weights, vectors)) / sum(weights)
        expected = closed_form.merge_matrix(normal_equations.data_free_equations(vectors, F64), anchor, 0.05)
        assert relative_error(merged[name].double() - pre[name].double(), expected) < 1e-5, name


def test_a_task_arithmetic_anchor_without_weights_is_one_line(lora_family, tmp_path):
    base, adapters = lora_family
    recipe = yaml.safe_load(_recipe(base, adapters))
    for model in recipe["models"]:
        del model["parameters"]
    with pytest.raises(Exception, match=r"anchor `task_arithmetic` needs parameter `weight`") as info:
        merge_recipe_text(yaml.safe_dump(recipe), tmp_path / "merged")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("sharing", ["input", "weight"])
def test_the_full_route_the_cache_and_lambda_auto_agree_with_it(lora_family, tmp_path, sharing):
    base, adapters = lora_family
    runs = {
        "low_rank": {},
        "full": {"low_rank": False},
        "cached": {"cache": str(tmp_path / "factors")},
        "cached again": {"cache": str(tmp_path / "factors")},
    }
    merged = {}
    for label, parameters in runs.items():
        merge_recipe_text(_recipe(base, adapters, gram_sharing=sharing, **parameters), tmp_path / label)
        merged[label] = load_weights(tmp_path / label)
    names = [n for n in merged["low_rank"] if any(t in n for t in TARGETS) and n.endswith(".weight")]
    assert read_record(tmp_path / "full").low_rank == {}  # `low_rank: false`: the full route
    assert len(read_record(tmp_path / "cached again").low_rank) == len(names)
    for name in names:
        reference = merged["low_rank"][name]
        assert relative_error(merged["full"][name], reference) < 1e-4  # float32 full route on dense copies
        assert relative_error(merged["cached"][name], reference) < 1e-5
        assert torch.equal(merged["cached again"][name], merged["cached"][name])
    from safetensors import safe_open

    ranks = {9, 18} if sharing == "input" else {9}  # q's and v's adapters span one input's basis together
    for entry in (tmp_path / "factors").glob("*.safetensors"):  # the anchor as k coordinates
        with safe_open(str(entry), framework="pt") as handle:
            assert (
                "anchor" not in handle.keys() and handle.get_slice("anchor_in_basis").get_shape()[1] in ranks
            )
    for label in ("auto", "auto cached"):
        extra = {"cache": str(tmp_path / "factors")} if label == "auto cached" else {}
        recipe = _recipe(base, adapters, gram_sharing=sharing, **{"lambda": "auto", **extra})
        merge_recipe_text(recipe, tmp_path / label)
    chosen = {label: read_record(tmp_path / label).lambda_auto for label in ("auto", "auto cached")}
    assert sorted(chosen["auto"]) == sorted(names)
    for name in names:
        assert chosen["auto cached"][name]["lambda"] == pytest.approx(
            chosen["auto"][name]["lambda"], rel=1e-5
        )


def test_posterior_samples_of_lora_experts_run_through_the_route(lora_family, tmp_path):
    from mergekit_bmm.plugin.run import merge_options
    from mergekit_bmm.sampling.run import SamplingRequest, sample_models

    base, adapters = lora_family
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(_recipe(base, adapters))
    request = SamplingRequest(2, 100.0, None, "q_proj", 0)
    summary = sample_models(str(recipe), str(tmp_path / "samples"), request, merge_options(quiet=True))
    assert [record.name for record in summary.tensors] == [
        f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)
    ]
    map_weights = load_weights(tmp_path / "samples" / "map")
    direct = tmp_path / "direct"
    merge_recipe_text(_recipe(base, adapters), direct)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert relative_error(map_weights[name], load_weights(direct)[name]) < 1e-6


def test_an_adapter_with_nan_is_one_line_naming_it(lora_family, tmp_path):
    from safetensors.torch import load_file, save_file

    base, adapters = lora_family
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters[0] / "adapter_config.json").read_text())
    tensors = load_file(str(adapters[0] / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(broken / "adapter_model.safetensors"))
    with pytest.raises(Exception, match=r"LoRA factors of .*q_proj.* in adapter .*broken contain NaN"):
        merge_recipe_text(_recipe(base, [broken, *adapters[1:]]), tmp_path / "out")


def test_adapters_with_a_decaying_spectrum_keep_their_small_directions(lora_family, tmp_path):
    """Trained adapters' spectra decay: at a small λ the ridge and their weakest directions sit below
    the float32 floor of a d_in × d_in eigensolve, yet are exact in the subspace's k × k float64
    one; direct and cached merges both solve them (before, they kept the anchor)."""
    from safetensors.torch import save_file

    base, originals = lora_family
    adapters = []
    for index, original in enumerate(originals):
        adapter = tmp_path / f"decaying-{index}"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text((original / "adapter_config.json").read_text())
        tensors = load_file(str(original / "adapter_model.safetensors"))
        for key, value in tensors.items():
            if "lora_B" in key:  # columns of B scaled down: singular values 1 … 1e-3 of the largest
                tensors[key] = 4 * value * torch.logspace(0, -3, value.shape[1])
        save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
        adapters.append(adapter)
    for label, extra in {"direct": {}, "cached": {"cache": str(tmp_path / "factors")}}.items():
        merge_recipe_text(_recipe(base, adapters, **{"lambda": 1e-5, **extra}), tmp_path / label)
    pre = load_weights(base)
    for name in (
        f"model.layers.{layer}.{module}.weight"
        for layer in (0, 1)
        for module in ("self_attn.q_proj", "mlp.down_proj")
    ):
        vectors = _exact_updates(adapters, name.removesuffix(".weight"))
        expected = closed_form.merge_matrix(
            normal_equations.data_free_equations(vectors, F64), 0.3 * sum(vectors), 1e-5
        )
        for label in ("direct", "cached"):
            found = load_weights(tmp_path / label)[name].double() - pre[name].double()
            assert relative_error(found, expected) < 1e-5, (label, name)
