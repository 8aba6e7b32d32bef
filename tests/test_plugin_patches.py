"""The plugin's mergekit patches: the optional-weight alias fix (BERT merges), version gating, start-up."""

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

from mergekit_bmm.plugin import patches


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny BERT family whose base, like all-MiniLM-L6-v2, stores embeddings.position_ids."""
    from mergekit_bmm.examples.tiny_models import make_tiny_family

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
    assert patches.optional_alias_bug_present() == ("optional_alias_check" in patches.APPLIED)
    assert (original is not MergePlanner.plan_tensor) == ("optional_alias_check" in patches.APPLIED)


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
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    family = make_tiny_family(tmp_path / "fam", "bert", n_experts=1, hidden=32, layers=1)
    merged = merge(family, "task_arithmetic", tmp_path / "out")
    assert "embeddings.position_ids" not in merged
    assert set(merged) == set(load_weights(family.base))


def test_without_the_patch_mergekit_fails_on_bert(tiny_bert, tmp_path, monkeypatch):
    if "optional_alias_check" not in patches.APPLIED:
        pytest.skip("the installed mergekit does not have the bug")
    monkeypatch.setattr(MergePlanner, "plan_tensor", MergePlanner.plan_tensor.__wrapped__)
    with pytest.raises(TypeError, match="concatenate list"):
        merge(tiny_bert, "task_arithmetic", tmp_path / "out")


def test_a_fixed_mergekit_is_not_patched(monkeypatch):
    def fixed_plan_tensor(self, weight, weights_in, models, cfg_reader):
        return None  # a correct mergekit skips the probe's absent optional weight

    monkeypatch.setattr(MergePlanner, "plan_tensor", fixed_plan_tensor)
    assert patches.optional_alias_bug_present() is False


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
    assert out.split() == [str(patches.optional_alias_bug_present())]


def test_the_wrapper_uses_only_public_mergekit_attributes():
    """Cards, records and pre-flight need no private attribute of mergekit's: only the alias fix reads one."""
    import inspect

    for patch in patches.PATCHES:
        if patch.name == "optional_alias_check":
            continue
        source = inspect.getsource(patch.install)
        assert "._" not in source.replace("functools.wraps", ""), patch.name


def test_a_mergekit_upgrade_is_said_with_what_the_user_loses():
    """Against a mergekit of another version, every patch stays off and one warning each names the loss."""
    code = (
        "import importlib.metadata as metadata\n"
        "real = metadata.version\n"
        "metadata.version = lambda name: '0.2.0' if name == 'mergekit' else real(name)\n"
        "import mergekit.merge\n"
        "from mergekit_bmm.plugin import activate\n"
        "activate()\n"
        "activate()\n"
        "print(getattr(mergekit.merge.run_merge, '_mergekit_bmm_patch', False))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False"], "nothing of a newer mergekit is patched"
    for patch in patches.PATCHES:
        line = f"mergekit 0.2.0 is installed; the {patch.name} patch is off, so {patch.loses}"
        assert result.stderr.count(line) == 1, (patch.name, result.stderr)


def test_start_up_installs_one_finder_and_imports_nothing():
    """At interpreter start the hook adds one import finder and loads neither torch nor mergekit."""
    if os.environ.get("MERGEKIT_BMM_NO_AUTOLOAD"):
        pytest.skip("the start-up hook is switched off")
    code = (
        "import sys\n"
        "ours = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == 'mergekit_bmm_autoload']\n"
        "heavy = [m for m in ('mergekit', 'mergekit_bmm', 'torch', 'transformers') if m in sys.modules]\n"
        "print(ours, heavy, sys.excepthook is sys.__excepthook__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['_MergekitFinder'] [] True"
