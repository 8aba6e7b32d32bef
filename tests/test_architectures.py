"""Every architecture transformers and mergekit both know: bmm through mergekit, against float64.

For each tiny model (docs/architectures.md), a data-free ``bmm`` recipe over a Task Arithmetic
anchor is merged through mergekit's ``run_merge``; the merged folder must load in transformers
and run forward, and every tensor must equal an independent float64 closed form: the weights of
``nn.Linear`` / ``Conv1D`` modules inside the layers (routers excepted) and every expert of a
mixture-of-experts stack are solved in the orientation their module uses, everything else is
Task Arithmetic.
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


def expected_merge(family, model_type: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    base = load(family.base, model_type)
    layouts = solved_layouts(base)
    pre = base.state_dict()
    experts = [load(path, model_type).state_dict() for path in family.experts]
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
            gram = sum(m.T @ m for m in matrices)
            cross = sum(m @ m.T @ m for m in matrices)
            prior = flip(anchor[index] if stacked else anchor)
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
