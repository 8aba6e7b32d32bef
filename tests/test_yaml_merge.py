"""End to end: stock ``mergekit-yaml`` runs ``merge_method: bmm`` recipes on tiny models."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights, relative_error
from references import expected_bmm_merge

from mergekit_bmm.core.module_map import classify
from mergekit_bmm.recipes.blockwise import BlockSetting, blockwise_recipe

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def run(command: str, *args, env_extra=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run(
        [str(BIN / command), *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def recipe(family, weights=(0.3, 0.3, 0.3), dtype="float32", **parameters):
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [
            {"model": str(path), "parameters": {"weight": w}} for path, w in zip(family.experts, weights)
        ],
        "parameters": {
            "anchor_method": "task_arithmetic",
            "lambda": 0.05,
            "scale": 1.0,
            "gram": "data_free",
            **parameters,
        },
        "dtype": dtype,
    }


def write(tmp_path: Path, config: dict, name="recipe.yml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def assert_matches(out_dir: Path, expected: dict, tolerance: float):
    got = load_weights(out_dir)
    missing = set(expected) - set(got)
    assert not missing, f"output lacks {sorted(missing)[:5]}"
    worst = max((relative_error(got[name], expected[name]), name) for name in expected)
    assert worst[0] <= tolerance, worst


def test_stock_mergekit_yaml_llama_matches_closed_form(tiny_llama, tmp_path):
    path = write(tmp_path, recipe(tiny_llama))
    result = run("mergekit-yaml", path, tmp_path / "out", "--no-copy-tokenizer")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch_dtype" not in result.stderr  # mergekit's own deprecated call is not the user's concern
    expected = expected_bmm_merge(tiny_llama, (0.3,) * 3, lambda n: 0.05, lambda n: 1.0, "llama")
    assert_matches(tmp_path / "out", expected, 1e-5)


def test_bfloat16_recipe_writes_bfloat16(tiny_llama, tmp_path):
    path = write(tmp_path, recipe(tiny_llama, dtype="bfloat16"))
    result = run("mergekit-yaml", path, tmp_path / "out", "--no-copy-tokenizer")
    assert result.returncode == 0, result.stderr[-2000:]
    got = load_weights(tmp_path / "out")
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    expected = expected_bmm_merge(tiny_llama, (0.3,) * 3, lambda n: 0.05, lambda n: 1.0, "llama")
    assert_matches(tmp_path / "out", expected, 1e-2)


def test_qwen2_biases_and_tied_embeddings(tiny_qwen2, tmp_path):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    config = recipe(tiny_qwen2, weights=(0.5, 0.3, 0.2), **{"lambda": 0.2, "scale": 1.1})
    run_merge(
        MergeConfiguration.model_validate(config),
        str(tmp_path / "out"),
        options=MergeOptions(copy_tokenizer=False, quiet=True),
    )
    got = load_weights(tmp_path / "out")
    assert "lm_head.weight" not in got
    assert any(name.endswith("q_proj.bias") for name in got)
    expected = expected_bmm_merge(tiny_qwen2, (0.5, 0.3, 0.2), lambda n: 0.2, lambda n: 1.1, "qwen2")
    assert_matches(tmp_path / "out", expected, 1e-5)


def test_gpt2_conv1d_through_yaml(tiny_gpt2, tmp_path):
    # GPT-2's mlp.c_proj Gram here has condition number ~1e3, which float32 turns into
    # ~1e-5 relative error; solve in float64 so the check is about orientation only.
    config = recipe(tiny_gpt2, weights=(0.5, 0.5), compute_dtype="float64")
    path = write(tmp_path, config)
    result = run("mergekit-yaml", path, tmp_path / "out", "--no-copy-tokenizer")
    assert result.returncode == 0, result.stderr[-2000:]
    expected = expected_bmm_merge(tiny_gpt2, (0.5, 0.5), lambda n: 0.05, lambda n: 1.0, "gpt2")
    assert_matches(tmp_path / "out", expected, 1e-6)


def test_blockwise_recipe_sets_lambda_per_group_and_scale_per_block(tiny_llama, tmp_path):
    lambdas = [
        {"attn_in": 0.01, "attn_out": 0.02, "mlp_in": 0.03, "mlp_out": 0.04},
        {"attn_in": 0.5, "attn_out": 0.6, "mlp_in": 0.7, "mlp_out": 0.8},
    ]
    scales = [1.2, 0.9]
    settings = [BlockSetting(0, 2, lambdas[0], scales[0]), BlockSetting(2, 4, lambdas[1], scales[1])]
    config = blockwise_recipe(recipe(tiny_llama), settings)
    path = write(tmp_path, config)
    result = run("mergekit-yaml", path, tmp_path / "out", "--no-copy-tokenizer")
    assert result.returncode == 0, result.stderr[-2000:]

    def block(name):
        return 0 if classify(name).layer < 2 else 1

    expected = expected_bmm_merge(
        tiny_llama,
        (0.3,) * 3,
        lambda n: lambdas[block(n)][classify(n).group.value],
        lambda n: scales[block(n)],
        "llama",
    )
    assert_matches(tmp_path / "out", expected, 1e-5)


def test_wrapper_command_works_without_the_startup_hook(tiny_llama, tmp_path):
    path = write(tmp_path, recipe(tiny_llama))
    off = {"MERGEKIT_BMM_NO_AUTOLOAD": "1"}
    stock = run("mergekit-yaml", path, tmp_path / "stock", "--no-copy-tokenizer", env_extra=off)
    assert stock.returncode != 0 and "Unimplemented merge method bmm" in stock.stderr
    wrapped = run("mergekit-bmm-yaml", path, tmp_path / "wrapped", "--no-copy-tokenizer", env_extra=off)
    assert wrapped.returncode == 0, wrapped.stderr[-2000:]
    assert "bmm" in yaml.safe_load((tmp_path / "wrapped" / "README.md").read_text().split("---")[1])["tags"]
    expected = expected_bmm_merge(tiny_llama, (0.3,) * 3, lambda n: 0.05, lambda n: 1.0, "llama")
    assert_matches(tmp_path / "wrapped", expected, 1e-5)


def _broken_family(tmp_path, tiny_llama, kind):
    """An expert folder with a NaN, or with a different hidden size."""
    import shutil

    from safetensors.torch import save_file

    target = tmp_path / f"broken-{kind}"
    shutil.copytree(tiny_llama.experts[0], target)
    weights = load_weights(target)
    name = "model.layers.1.mlp.down_proj.weight"
    if kind == "nan":
        weights[name][0, 0] = float("nan")
    else:
        weights[name] = weights[name][:, :7].contiguous()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target, name


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown_anchor", "unknown method 'nonexistent'"),
        ("negative_lambda", "`lambda` must be a finite number >= 0"),
        ("activations_without_stats", "needs activation statistics"),
        ("nan", "contains NaN or Inf"),
        ("shape", r"down_proj.weight has different shapes in the inputs \(\(64, 7\) vs \(64, 128\)\)"),
    ],
)
def test_bad_input_gives_one_line_and_nonzero_exit(tiny_llama, tmp_path, case, message):
    config = recipe(tiny_llama)
    if case == "unknown_anchor":
        config["parameters"]["anchor_method"] = "nonexistent"
    elif case == "negative_lambda":
        config["parameters"]["lambda"] = -0.5
    elif case == "activations_without_stats":
        config["parameters"]["gram"] = "activations"
    else:
        broken, name = _broken_family(tmp_path, tiny_llama, case)
        config["models"][0]["model"] = str(broken)
        message = f"{name}.*{message}" if case == "nan" else message
    path = write(tmp_path, config)
    result = run("mergekit-yaml", path, tmp_path / "out", "--no-copy-tokenizer")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mergekit-bmm: error:")
    assert re.search(message, last), last
    if case == "nan":
        assert str(broken) in last
