"""``mergekit-bmm-lora``: a merge of LoRA experts written as one PEFT adapter that PEFT loads and that
equals the full merge; truncation and anchors outside the adapters' span reported per module."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import load_weights

from mergekit_bmm.cli.lora import main as lora_command
from mergekit_bmm.plugin.run import merge_recipe_text


@pytest.fixture(scope="module")
def lora_family(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_lora_adapter, make_tiny_family

    root = tmp_path_factory.mktemp("export")
    family = make_tiny_family(root, "llama", n_experts=1, hidden=32, layers=2)
    adapters = [make_lora_adapter(family.base, root / f"adapter-{i}", seed=i, rank=2 + i) for i in range(3)]
    return family.base, adapters, family.experts[0]


@pytest.fixture(autouse=True)
def lora_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEKIT_BMM_CACHE", str(tmp_path / "plugin-cache"))


def _recipe(tmp_path, base, models, method="bmm", **parameters):
    body = {
        "merge_method": method,
        "base_model": str(base),
        "models": [{"model": m, "parameters": {"weight": 0.3, "density": 0.5}} for m in models],
        "dtype": "float32",
    }
    if method == "bmm":
        body["parameters"] = {"anchor_method": "task_arithmetic", "lambda": 0.05, **parameters}
    path = tmp_path / f"{method}.yml"
    path.write_text(yaml.safe_dump(body))
    return path


def _peft_merged(base, adapter_dir) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter_dir))
    return {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}


@pytest.mark.parametrize("method", ["bmm", "task_arithmetic"])
def test_the_adapter_loads_in_peft_and_equals_the_full_merge(lora_family, tmp_path, method):
    base, adapters, dense = lora_family
    recipe = _recipe(tmp_path, base, [f"{base}+{a}" for a in adapters], method)
    out = tmp_path / "adapter"
    result = CliRunner().invoke(lora_command, [str(recipe), str(out)], prog_name="mergekit-bmm-lora")
    assert result.exit_code == 0, result.output
    assert "(exact)" in result.output and "best fit" not in result.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 + 3 + 4 and len(config["target_modules"]) == 6
    from safetensors.torch import load_file

    assert all(".lora_" in key for key in load_file(str(out / "adapter_model.safetensors")))
    full = tmp_path / "full"
    merge_recipe_text(recipe.read_text(), full)
    expected, ours = load_weights(full), _peft_merged(base, out)
    for name, tensor in expected.items():
        scale = float(tensor.norm()) or 1.0
        assert float((ours[name] - tensor).norm()) / scale < 1e-5, name
    assert "library_name: peft" in (out / "README.md").read_text()


def test_truncation_and_an_anchor_outside_the_span_are_best_fits_with_their_errors(lora_family, tmp_path):
    base, adapters, dense = lora_family
    recipe = _recipe(tmp_path, base, [f"{base}+{a}" for a in adapters])
    result = CliRunner().invoke(lora_command, [str(recipe), str(tmp_path / "r2"), "--rank", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r2" / "adapter_config.json").read_text())["r"] == 2
    errors = [
        float(line.split("error ")[1].split()[0]) for line in result.output.splitlines() if "rank" in line
    ]
    assert errors and all(0 < e < 1 for e in errors) and "best fit" in result.output
    ties = _recipe(tmp_path, base, [f"{base}+{a}" for a in adapters], "ties")  # elementwise: leaves the span
    result = CliRunner().invoke(lora_command, [str(ties), str(tmp_path / "ties")])
    assert result.exit_code == 0, result.output
    assert "best fit" in result.output


def test_the_reported_error_is_the_written_factors_residual():
    """Exact through the span, and truncated by SVD: each error equals ‖ΔW − B A‖ / ‖ΔW‖ (float64)."""
    from mergekit_bmm.adapters.export import factors_of

    generator = torch.Generator().manual_seed(0)
    rights = torch.randn(6, 40, generator=generator, dtype=torch.float64)
    basis, _ = torch.linalg.qr(rights.T)
    inside = torch.randn(30, 6, generator=generator, dtype=torch.float64) @ rights
    outside = inside + 1e-2 * torch.randn(30, 40, generator=generator, dtype=torch.float64)
    for delta, rank, exact in ((inside, None, True), (inside, 3, False), (outside, None, False)):
        left, right, error, was_exact = factors_of(delta, basis, rank)
        residual = float((delta - left @ right).norm() / delta.norm())
        assert was_exact is exact and right.shape[0] == (rank or 6)
        assert abs(error - residual) <= 1e-12 + 1e-9 * residual, (rank, error, residual)


def test_a_dense_expert_is_one_line(lora_family, tmp_path):
    base, adapters, dense = lora_family
    recipe = _recipe(tmp_path, base, [f"{base}+{adapters[0]}", str(dense)])
    result = CliRunner().invoke(lora_command, [str(recipe), str(tmp_path / "x")])
    assert result.exit_code != 0
    assert "is not `" in result.output and "+ADAPTER`" in result.output
