"""The compatibility patch for mergekit 0.1.5's optional-weight alias bug (BERT merges)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import load_weights, relative_error
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from mergekit.plan import MergePlanner
from safetensors.torch import load_file, save_file

import mergekit_bmm  # noqa: F401  (registers bmm, applies the patch)
from mergekit_bmm import compat


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny BERT family whose base, like all-MiniLM-L6-v2, stores embeddings.position_ids."""
    from mergekit_bmm.tiny_models import make_tiny_family

    family = make_tiny_family(tmp_path_factory.mktemp("bert"), "bert", n_experts=2, hidden=32, layers=2)
    path = family.base / "model.safetensors"
    tensors = load_file(str(path))
    tensors["embeddings.position_ids"] = torch.arange(256, dtype=torch.int64).unsqueeze(0)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return family


def merge(family, method: str, out):
    recipe = {
        "merge_method": method,
        "base_model": str(family.base),
        "models": [{"model": str(e), "parameters": {"weight": 0.5}} for e in family.experts],
        "dtype": "float32",
    }
    options = MergeOptions(quiet=True, copy_tokenizer=False, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(recipe), str(out), options)
    return load_weights(out)


def test_patch_is_applied_exactly_when_the_bug_is_present():
    original = getattr(MergePlanner.plan_tensor, "__wrapped__", MergePlanner.plan_tensor)
    assert compat.optional_alias_bug_present() == ("optional_alias_check" in compat.APPLIED)
    assert (original is not MergePlanner.plan_tensor) == ("optional_alias_check" in compat.APPLIED)


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "tsv", "iso_c", "iso_cts", "wudi", "bmm"])
def test_bert_merge_runs_and_passes_position_ids_through(tiny_bert, tmp_path, method):
    merged = merge(tiny_bert, method, tmp_path / method)
    base = load_weights(tiny_bert.base)
    assert torch.equal(merged["embeddings.position_ids"], base["embeddings.position_ids"])
    if method == "task_arithmetic":
        experts = [load_weights(e) for e in tiny_bert.experts]
        for name, value in merged.items():
            if value.is_floating_point():
                expected = base[name].double() + 0.5 * sum(
                    e[name].double() - base[name].double() for e in experts
                )
                assert relative_error(value, expected) < 1e-6, name


def test_optional_weight_absent_everywhere_is_skipped(tmp_path):
    from mergekit_bmm.tiny_models import make_tiny_family

    family = make_tiny_family(tmp_path / "fam", "bert", n_experts=1, hidden=32, layers=1)
    merged = merge(family, "task_arithmetic", tmp_path / "out")
    assert "embeddings.position_ids" not in merged
    assert set(merged) == set(load_weights(family.base))


def test_without_the_patch_mergekit_fails_on_bert(tiny_bert, tmp_path, monkeypatch):
    if "optional_alias_check" not in compat.APPLIED:
        pytest.skip("the installed mergekit does not have the bug")
    monkeypatch.setattr(MergePlanner, "plan_tensor", MergePlanner.plan_tensor.__wrapped__)
    with pytest.raises(TypeError, match="concatenate list"):
        merge(tiny_bert, "task_arithmetic", tmp_path / "out")


def test_a_fixed_mergekit_is_not_patched(monkeypatch):
    def fixed_plan_tensor(self, weight, weights_in, models, cfg_reader):
        return None  # a correct mergekit skips the probe's absent optional weight

    monkeypatch.setattr(MergePlanner, "plan_tensor", fixed_plan_tensor)
    assert compat.optional_alias_bug_present() is False


def test_patch_is_applied_when_mergekit_plan_is_imported_first():
    """``import mergekit.plan`` registers the plugin (start-up hook) while plan is half-loaded;
    the patch is deferred until plan has loaded, with no explicit import of the plugin."""
    if os.environ.get("MERGEKIT_BMM_NO_AUTOLOAD"):
        pytest.skip("the start-up hook is switched off")
    code = (
        "import mergekit.plan\n"
        "print(bool(getattr(mergekit.plan.MergePlanner.plan_tensor, '_mergekit_bmm_patch', False)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(compat.optional_alias_bug_present())]
