"""End to end: the anchor methods merge tiny checkpoints, standalone and as bmm's anchor.

Every output tensor is compared with the method applied in float64 to the loaded
checkpoints (2D body weights: the matrix algorithm; everything else: the mean).
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights, reference_solve, relative_error
from references import shared_input_grams

from mergekit_bmm.core import iso_c_merge, iso_cts_merge, regmean_merge, tsv_merge, wudi_merge
from mergekit_bmm.core.module_map import classify
from mergekit_bmm.examples.synthetic_stats import stats_for_family

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # tiny tensors (conftest.py)

CONFIGS = Path(__file__).parent.parent / "configs"

ALGORITHMS = {
    "tsv": tsv_merge,
    "iso_c": iso_c_merge,
    "iso_cts": partial(iso_cts_merge, common_space_fraction=0.8),
    "wudi": wudi_merge,
}


def run(config: dict, out: Path) -> dict[str, torch.Tensor]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False),
    )
    return load_weights(out)


def recipe(family, method, **parameters) -> dict:
    return {
        "merge_method": method,
        "base_model": str(family.base),
        "models": [{"model": str(path)} for path in family.experts],
        "parameters": parameters,
        "dtype": "float32",
    }


def expected_merge(family, algorithm, scale=1.0) -> dict[str, torch.Tensor]:
    """``W_pre + scale·τ`` for every tensor, from the checkpoints in float64."""
    base = load_weights(family.base)
    experts = [load_weights(path) for path in family.experts]
    expected = {}
    for name, w_pre in base.items():
        w_pre = w_pre.double()
        vectors = [e[name].double() - w_pre for e in experts]
        info = classify(name, family.architecture) if w_pre.ndim == 2 else None
        if info is None:
            merged = sum(vectors) / len(vectors)
        elif info.stored_in_out:
            merged = algorithm([v.T for v in vectors], name).T
        else:
            merged = algorithm(vectors, name)
        expected[name] = w_pre + scale * merged
    return expected


def compare(got: dict, expected: dict, base: dict, tolerance: float) -> None:
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))[:5]
    errors = [
        (relative_error(got[name].double() - base[name].double(), expected[name] - base[name].double()), name)
        for name in expected
    ]
    worst = max(errors)
    assert worst[0] < tolerance, worst


@pytest.mark.parametrize("method", sorted(ALGORITHMS))
def test_standalone_merge_matches_float64(method, tiny_llama, tmp_path):
    alpha = 0.8 if method != "wudi" else 1.0
    parameters = {"alpha": alpha} if method != "wudi" else {}
    got = run(recipe(tiny_llama, method, **parameters), tmp_path / "out")
    algorithm = ALGORITHMS[method]
    expected = expected_merge(tiny_llama, lambda vectors, name: algorithm(vectors), scale=alpha)
    compare(got, expected, load_weights(tiny_llama.base), 1e-4)


@pytest.mark.parametrize("method", sorted(ALGORITHMS))
def test_bmm_over_each_anchor_matches_float64(method, tiny_llama, tmp_path):
    got = run(recipe(tiny_llama, "bmm", anchor_method=method, **{"lambda": 0.05}), tmp_path / "out")
    algorithm = ALGORITHMS[method]
    anchors = expected_merge(tiny_llama, lambda vectors, name: algorithm(vectors))
    base = load_weights(tiny_llama.base)
    experts = [load_weights(path) for path in tiny_llama.experts]
    pooled = shared_input_grams(base, experts, "llama")  # bmm's default: q/k/v, gate/up one Gram
    expected = {}
    for name, w_pre in base.items():
        w_pre = w_pre.double()
        if w_pre.ndim != 2 or classify(name, "llama") is None:
            expected[name] = anchors[name]
            continue
        vectors = [e[name].double() - w_pre for e in experts]
        expected[name] = w_pre + reference_solve(vectors, anchors[name] - w_pre, 0.05, pooled.get(name))
    compare(got, expected, base, 1e-4)


def test_regmean_standalone_and_as_bmm_anchor(tiny_llama, tmp_path):
    stats_dir, grams = stats_for_family(tmp_path / "stats", tiny_llama)
    got = run(recipe(tiny_llama, "regmean", stats=str(stats_dir)), tmp_path / "regmean")

    def regmean(vectors, name):
        return regmean_merge(vectors, [g.double() for g in grams[name]], 0.5)

    expected = expected_merge(tiny_llama, regmean)
    base = load_weights(tiny_llama.base)
    compare(got, expected, base, 1e-4)

    through_bmm = run(
        recipe(tiny_llama, "bmm", anchor_method="regmean", stats=str(stats_dir), **{"lambda": 1e9}),
        tmp_path / "bmm",
    )
    compare(through_bmm, expected, base, 1e-4)


def test_shipped_regmean_recipe_with_statistics(tiny_llama, tmp_path):
    stats_dir, _ = stats_for_family(tmp_path / "stats", tiny_llama)
    text = (CONFIGS / "bmm-regmean.yml").read_text().replace("/models/stats", str(stats_dir))
    text = text.replace("/models/base", str(tiny_llama.base))
    for path in tiny_llama.experts:
        text = text.replace(f"/models/{path.name}", str(path))
    got = run(yaml.safe_load(text), tmp_path / "out")
    base = load_weights(tiny_llama.base)
    assert all(torch.isfinite(t.float()).all() for t in got.values())
    assert any(not torch.equal(got[n].float(), base[n].float()) for n in got)


def test_gpt2_conv1d_checkpoint(tiny_gpt2, tmp_path):
    got = run(recipe(tiny_gpt2, "iso_cts"), tmp_path / "out")
    expected = expected_merge(tiny_gpt2, lambda vectors, name: iso_cts_merge(vectors))
    compare(got, expected, load_weights(tiny_gpt2.base), 1e-4)


def test_materialised_anchor_equals_inline_anchor(tiny_llama, tmp_path):
    """Merge WUDI once, feed it as `anchor: true`: the same bmm result as computing it inline."""
    anchor_dir = tmp_path / "wudi"
    run(recipe(tiny_llama, "wudi", iterations=50), anchor_dir)
    inline = run(
        recipe(tiny_llama, "bmm", anchor_method="wudi", iterations=50, **{"lambda": 0.05}), tmp_path / "a"
    )
    materialised_recipe = recipe(tiny_llama, "bmm", **{"lambda": 0.05})
    materialised_recipe["models"].append({"model": str(anchor_dir), "parameters": {"anchor": True}})
    materialised = run(materialised_recipe, tmp_path / "b")
    compare(materialised, {k: v.double() for k, v in inline.items()}, load_weights(tiny_llama.base), 1e-5)


def test_stock_mergekit_yaml_runs_an_anchor_method(tiny_llama, tmp_path):
    config = recipe(tiny_llama, "tsv", alpha=0.8)
    path = tmp_path / "tsv.yml"
    path.write_text(yaml.safe_dump(config))
    command = [str(Path(sys.executable).parent / "mergekit-yaml"), str(path), str(tmp_path / "out")]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    expected = expected_merge(tiny_llama, lambda vectors, name: tsv_merge(vectors), scale=0.8)
    compare(load_weights(tmp_path / "out"), expected, load_weights(tiny_llama.base), 1e-4)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Task Singular Vectors" in card
