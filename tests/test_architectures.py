"""Every architecture transformers and mergekit both know: bmm through mergekit, against float64.

For each tiny model (docs/architectures.md), a data-free ``bmm`` recipe over a Task Arithmetic
anchor is merged through mergekit's ``run_merge``; the merged folder must load in transformers
and run forward, and every tensor must equal an independent float64 closed form: the weights of
``nn.Linear`` / ``Conv1D`` modules inside the layers (routers excepted) and every expert of a
mixture-of-experts stack are solved in the orientation their module uses, everything else is
Task Arithmetic. Under bmm's default ``gram_sharing: input`` the modules of one parent that read the
same tensor in a forward pass (q/k/v, gate/up) share one data-free Gram; the reference finds them
by running the model, not from the project's module map.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import relative_error
from references import ridge_solve

from mergekit_bmm.examples.architectures import AUTO_CLASS, MIXTURES_OF_EXPERTS, TINY_CONFIGS
from mergekit_bmm.plugin.run import merge_recipe_text

pytestmark = pytest.mark.slow

WEIGHT, LAMBDA = 0.3, 0.1
MERGEKIT_CANNOT = {"gpt_neox": "required but not present"}  # mergekit's own definition fails
SOLVED_BY_BMM = sorted(set(TINY_CONFIGS) - set(MERGEKIT_CANNOT))
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.\d+\.")


def load(folder: Path, model_type: str) -> torch.nn.Module:
    import transformers

    auto = getattr(transformers, AUTO_CLASS.get(model_type, "AutoModelForCausalLM"))
    return auto.from_pretrained(folder, dtype=torch.float32).eval()


def solved_layouts(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> ``out_in`` / ``in_out`` / ``experts_out_in`` / ``experts_in_out`` for the
    tensors the closed form must solve, read off the modules themselves."""
    from transformers.pytorch_utils import Conv1D

    layouts = {}
    for module_name, module in model.named_modules():
        if not _LAYER.search(module_name + "."):
            continue
        if isinstance(module, (torch.nn.Linear, Conv1D)) and not module_name.endswith(("gate", "router")):
            layouts[f"{module_name}.weight"] = "in_out" if isinstance(module, Conv1D) else "out_in"
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.ndim == 3 and module_name.endswith("experts"):
                transposed = getattr(module, "is_transposed", False)
                layouts[f"{module_name}.{name}"] = "experts_in_out" if transposed else "experts_out_in"
    return layouts


def shared_inputs(model: torch.nn.Module, layouts: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Weight name -> the solved 2-D weights of its parent module that read the very same tensor in
    a forward pass (itself included): the weights whose data-free Grams ``gram_sharing: input`` pools."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for module_name, module in model.named_modules():
        if layouts.get(f"{module_name}.weight") in ("out_in", "in_out"):  # not an expert stack

            def record(_module, inputs, _output, name=f"{module_name}.weight"):
                seen.setdefault(name, inputs[0].detach().clone())

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 9, 12, 3]]))
    for hook in hooks:
        hook.remove()
    parent = lambda name: name.rsplit(".", 2)[0]  # noqa: E731
    return {
        name: tuple(
            other for other in seen if parent(other) == parent(name) and torch.equal(seen[other], seen[name])
        )
        for name in seen
    }


def expected_merge(family, model_type: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    base = load(family.base, model_type)
    layouts = solved_layouts(base)
    readers = shared_inputs(base, layouts)
    pre = base.state_dict()
    experts = [load(path, model_type).state_dict() for path in family.experts]

    def oriented(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        vector = state[name].double() - pre[name].double()
        return vector.T if layouts[name].endswith("in_out") else vector

    expected = {}
    for name, w_pre in pre.items():
        w_pre = w_pre.double()
        vectors = [e[name].double() - w_pre for e in experts]
        anchor = WEIGHT * sum(vectors)
        layout = layouts.get(name)
        if layout is None:
            expected[name] = w_pre + anchor
            continue
        stacked = layout.startswith("experts")
        flip = (lambda m: m.T) if layout.endswith("in_out") else (lambda m: m)
        parts = []
        for index in range(len(anchor) if stacked else 1):
            matrices = [flip(v[index] if stacked else v) for v in vectors]
            prior = flip(anchor[index] if stacked else anchor)
            grams = [m.T @ m for m in matrices]  # a fused weight's parts pool their rows
            if name in readers:
                grams = [sum((u := oriented(e, other)).T @ u for other in readers[name]) for e in experts]
            gram, cross = sum(grams), sum(m @ g for m, g in zip(matrices, grams))
            parts.append(flip(ridge_solve(gram, cross, prior, LAMBDA)))
        expected[name] = w_pre + (torch.stack(parts) if stacked else parts[0])
    return expected, layouts


def recipe(family) -> str:
    return yaml.safe_dump(
        {
            "merge_method": "bmm",
            "base_model": str(family.base),
            "models": [{"model": str(p), "parameters": {"weight": WEIGHT}} for p in family.experts],
            "parameters": {"anchor_method": "task_arithmetic", "lambda": LAMBDA, "scale": 1.0},
            "dtype": "float32",
        }
    )


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    from mergekit_bmm.examples.architectures import make_architecture_family

    root = tmp_path_factory.mktemp("architectures")
    return lambda model_type: make_architecture_family(root / model_type, model_type)


@pytest.mark.parametrize("model_type", SOLVED_BY_BMM)
def test_bmm_solves_every_architecture_as_a_float64_reference(
    families, model_type, tmp_path, one_torch_thread
):
    family = families(model_type)
    out = tmp_path / "merged"
    merge_recipe_text(recipe(family), out)
    merged_model = load(out, model_type)
    merged = merged_model.state_dict()
    expected, layouts = expected_merge(family, model_type)
    assert layouts, f"{model_type}: the reference found nothing to solve"
    if model_type in MIXTURES_OF_EXPERTS:
        assert any(layout.startswith("experts") for layout in layouts.values())
    assert set(merged) == set(expected)
    worst = max(expected, key=lambda name: relative_error(merged[name], expected[name]))
    assert relative_error(merged[worst], expected[worst]) < 1e-5, worst
    with torch.no_grad():
        output = merged_model(input_ids=torch.tensor([[1, 5, 9, 12, 3]]))
    hidden = output.logits if hasattr(output, "logits") else output.last_hidden_state
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize("model_type", ["llama", "exaone", "mixtral", "qwen3_moe"])
def test_a_blockwise_lambda_reaches_every_solved_weight(families, model_type, tmp_path, one_torch_thread):
    """A search writes λ as mergekit filters on module names; they must match the names the merge reads,
    which differ from the checkpoint's where mergekit converts it (EXAONE saved under its own names,
    Mixtral's per-expert weights read as stacks). λ → ∞ everywhere must give the anchor exactly."""
    from conftest import load_weights

    from mergekit_bmm.io.model_folder import num_layers_of
    from mergekit_bmm.recipes.blockwise import BlockSetting, blockwise_recipe

    family = families(model_type)
    plain = yaml.safe_load(recipe(family))
    huge = dict.fromkeys(("attn_in", "attn_out", "mlp_in", "mlp_out"), 1e9)
    merge_recipe_text(
        yaml.safe_dump(blockwise_recipe(plain, [BlockSetting(0, num_layers_of(family.base), huge, 1.0)])),
        tmp_path / "bmm",
    )
    anchor = {**plain, "merge_method": "task_arithmetic"}
    del anchor["parameters"]
    merge_recipe_text(yaml.safe_dump(anchor), tmp_path / "anchor")
    merged, expected = load_weights(tmp_path / "bmm"), load_weights(tmp_path / "anchor")
    assert max(relative_error(merged[name], expected[name]) for name in expected) < 1e-6


def test_gpt_bigcode_by_hub_id_is_solved_as_by_local_path(tmp_path, monkeypatch, one_torch_thread):
    """The layout of GPT-2's names (c_attn, c_fc, c_proj) comes from the checkpoint's config, read
    from the Hub cache for a Hub id; gpt_bigcode stores them as nn.Linear (out, in)."""
    import huggingface_hub
    from hf_cache import lay_out
    from mergekit.common import ModelReference
    from mergekit.merge_methods.api import merge_tensors

    from mergekit_bmm.errors import TensorInputError
    from mergekit_bmm.examples.architectures import make_architecture_family
    from mergekit_bmm.io import model_folder

    family = make_architecture_family(tmp_path / "bigcode", "gpt_bigcode")
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model_folder._hub_model_type.cache_clear()
    folders = [family.base, *family.experts]
    name = "transformer.h.0.mlp.c_fc.weight"
    tensors = [load_tensor(folder, name) for folder in folders]
    by_path = [ModelReference.model_validate({"model": {"path": str(f)}}) for f in folders]
    by_id = [ModelReference.model_validate({"model": {"path": f"org/{f.name}"}}) for f in folders]
    parameters = {"anchor_method": "task_arithmetic", "weight": WEIGHT, "lambda": LAMBDA}

    def merged(ids):
        return merge_tensors(tensors, "bmm", base_index=0, name=name, ids=ids, parameters=parameters)

    with pytest.raises(TensorInputError, match="cannot tell whether .* stored"):  # not cached: no guess
        merged(by_id)
    for folder in folders:
        lay_out(cache, f"org/{folder.name}", folder)
    model_folder._hub_model_type.cache_clear()
    assert torch.equal(merged(by_id), merged(by_path))
    vectors = [t.double() - tensors[0].double() for t in tensors[1:]]
    gram, cross = sum(v.T @ v for v in vectors), sum(v @ v.T @ v for v in vectors)
    expected = tensors[0].double() + ridge_solve(gram, cross, WEIGHT * sum(vectors), LAMBDA)
    assert relative_error(merged(by_id), expected) < 1e-5


def load_tensor(folder: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return handle.get_tensor(name)


def test_mergekits_own_limits_stay_mergekits(families, tmp_path):
    """gpt_neox as transformers 5 saves it lacks buffers mergekit's definition requires: every method
    fails inside mergekit. A `ties` recipe gets mergekit's own error; a `bmm` recipe one line that says
    whose limit it is and names the tensor."""
    import subprocess
    import sys

    family = families("gpt_neox")
    command = str(Path(sys.executable).parent / "mergekit-yaml")
    stderr = {}
    for method in ("bmm", "ties"):
        config = yaml.safe_load(recipe(family))
        config["merge_method"] = method
        if method == "ties":
            config["parameters"] = {"density": 0.5}
        path = tmp_path / f"{method}.yml"
        path.write_text(yaml.safe_dump(config))
        done = subprocess.run([command, str(path), str(tmp_path / method)], capture_output=True, text=True)
        assert done.returncode != 0
        stderr[method] = done.stderr
    bmm_lines = [line for line in stderr["bmm"].splitlines() if "error" in line]
    assert bmm_lines[-1].startswith("mergekit-bmm: error: mergekit's architecture definition requires tensor")
    assert "not bmm's" in bmm_lines[-1]
    assert "mergekit-bmm" not in stderr["ties"] and "Traceback" in stderr["ties"]
    assert MERGEKIT_CANNOT["gpt_neox"] in stderr["ties"]


def test_a_moe_merge_through_the_factor_cache_equals_the_direct_one_and_says_what_kept_the_anchor(
    families, tmp_path, one_torch_thread
):
    from mergekit_bmm.cards.merge_record import read_record

    family = families("qwen3_moe")
    direct, cached = tmp_path / "direct", tmp_path / "cached"
    merge_recipe_text(recipe(family), direct, source="direct")
    config = yaml.safe_load(recipe(family))
    config["parameters"]["cache"] = str(tmp_path / "cache")
    for _ in range(2):  # fills the cache, then reads it
        merge_recipe_text(yaml.safe_dump(config), cached, source="cached")
    import safetensors.torch

    one = safetensors.torch.load_file(str(direct / "model.safetensors"))
    two = safetensors.torch.load_file(str(cached / "model.safetensors"))
    stacks = [name for name, tensor in one.items() if tensor.ndim == 3]
    assert stacks and all(relative_error(two[name], one[name]) < 1e-5 for name in one)
    kept = read_record(direct).kept_at_anchor
    assert "model.layers.0.mlp.gate.weight" in kept["routers"]
    assert "model.embed_tokens.weight" in kept["outside_layers"]
    assert not set(stacks) & {name for names in kept.values() for name in names}


def test_a_search_over_a_moe_scores_resident_trials_as_merged_folders(families, tmp_path, one_torch_thread):
    """Resident trials re-solve each expert of a stack in place: the same scores as merging to disk."""
    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

    family = families("qwen3_moe")
    tests = Path(__file__).parent
    results = {}
    for trials in ("memory", "disk"):
        config = {
            "recipe": yaml.safe_load(recipe(family)),
            "blocks": 1,
            "strategy": "random",
            "budget": 2,
            "trials": trials,
            "evaluator": {
                "type": "python",
                "callable": "search_objectives:per_task_scores",
                "python_path": [str(tests)],
            },
        }
        options = SearchOptions(progress=False, device="cpu", plots=False, skip_best=True)
        results[trials] = run_search(parse_search_config(config, tests), tmp_path / trials, options)
    assert results["memory"].summary.trials == "memory"
    # per layer: q, k, v, o; each of 4 experts' fused gate_up (one Gram: they read one input), its down
    assert results["memory"].summary.memory_plan["solved"] == 2 * (4 + 4 + 4)
    assert [r.per_task for r in results["memory"].records] == [r.per_task for r in results["disk"].records]
