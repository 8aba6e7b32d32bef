"""Bad input through the real merge commands: one line, a non-zero exit, no traceback, nothing
non-finite written, and every file the user already had left byte for byte.

``mergekit-bmm-yaml`` runs in process (its one-line contract is the command's own); the stock
``mergekit-yaml`` runs as a subprocess, where the plugin's start-up hook and excepthook act.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import load_weights

from mergekit_bmm.cli.merge import main as bmm_yaml

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def recipe(family, **parameters) -> dict:
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(path), "parameters": {"weight": 0.3}} for path in family.experts],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.05, "scale": 1.0, **parameters},
        "dtype": "float32",
    }


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip() and "it/s]" not in line]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in lines if line.startswith("mergekit-bmm: error:")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def run_bmm_yaml(recipe_path: Path, out: Path, *extra: str):
    return CliRunner().invoke(bmm_yaml, [str(recipe_path), str(out), "--quiet", *extra])


def run_stock(recipe_path: Path, out: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MERGEKIT_BMM_TRACEBACK", None)
    env.update(env_extra)
    command = [str(BIN / "mergekit-yaml"), str(recipe_path), str(out), "--quiet"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def bad_recipes(family, tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name → (recipe text, what the one line must say)."""
    good = recipe(family)
    missing = {**good, "models": [*good["models"][:2], {"model": str(tmp_path / "no-such-expert")}]}
    no_config = tmp_path / "not-a-model"
    no_config.mkdir(exist_ok=True)
    return {
        "not YAML": ("merge_method: bmm\nbase_model: [\n", "is not valid YAML"),
        "not a mapping": ("- a\n- b\n", "mapping"),
        "unknown method": (yaml.safe_dump({**good, "merge_method": "bmn"}), "unknown merge_method 'bmn'"),
        "missing folder": (
            yaml.safe_dump(missing),
            f"{tmp_path / 'no-such-expert'} in the recipe does not exist",
        ),
        "no config.json": (yaml.safe_dump({**good, "base_model": str(no_config)}), "has no config.json"),
        "no base model": (
            yaml.safe_dump({k: v for k, v in good.items() if k != "base_model"}),
            "needs `base_model:`",
        ),
        "scale 0": (yaml.safe_dump(recipe(family, scale=0)), "`scale` must be a finite number > 0; got 0"),
        "scale -1": (yaml.safe_dump(recipe(family, scale=-1)), "`scale` must be a finite number > 0; got -1"),
        "lambda -1": (
            yaml.safe_dump(recipe(family, **{"lambda": -1})),
            "`lambda` must be a finite number >= 0",
        ),
        "epsilon 2": (
            yaml.safe_dump(recipe(family, epsilon=2)),
            "`epsilon` must be a finite number in [0, 1]",
        ),
        "overflowing scale": (
            yaml.safe_dump(recipe(family, scale=1e40)),
            "produced NaN or Inf in model.layers.",
        ),
        "huge anchor name": (
            yaml.safe_dump(recipe(family, anchor_method="x" * 100_000)),
            "(100002 characters)",
        ),
    }


CASES = [
    "not YAML",
    "not a mapping",
    "unknown method",
    "missing folder",
    "no config.json",
    "no base model",
    "scale 0",
    "scale -1",
    "lambda -1",
    "epsilon 2",
    "overflowing scale",
    "huge anchor name",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_recipe_is_one_line_and_writes_nothing(case, tiny_llama, tmp_path):
    text, expected = bad_recipes(tiny_llama, tmp_path)[case]
    path = tmp_path / "recipe.yml"
    path.write_text(text)
    out = tmp_path / "out"
    result = run_bmm_yaml(path, out)
    assert result.exit_code == 2, result.output[-3000:]
    line = error_line(result.output)
    assert expected in line and len(line) < 1300, line
    assert not out.exists()  # a failed merge into a new folder leaves nothing behind


@pytest.mark.parametrize("case", ["not YAML", "missing folder", "unknown method", "overflowing scale"])
def test_stock_mergekit_yaml_gives_the_same_one_line(case, tiny_llama, tmp_path):
    text, expected = bad_recipes(tiny_llama, tmp_path)[case]
    path = tmp_path / "recipe.yml"
    path.write_text(text)
    result = run_stock(path, tmp_path / "out")
    assert result.returncode != 0
    assert expected in error_line(result.stderr)
    assert not (tmp_path / "out").exists()


def test_output_that_is_a_file_or_cannot_be_written(tiny_llama, tmp_path):
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe(tiny_llama)))
    a_file = tmp_path / "taken.txt"
    a_file.write_text("mine")
    result = run_bmm_yaml(path, a_file)
    assert result.exit_code == 2 and "is a file" in error_line(result.output)
    assert a_file.read_text() == "mine"

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        probe = locked / "probe"
        try:
            probe.mkdir()  # root ignores permissions: then there is nothing to refuse
            pytest.skip("this user can write anywhere")
        except PermissionError:
            pass
        result = run_bmm_yaml(path, locked / "merged")
        assert result.exit_code == 2 and "cannot write to OUT_PATH" in error_line(result.output)
    finally:
        locked.chmod(0o700)


def test_a_users_folder_is_never_written_over_silently(tiny_llama, tmp_path):
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe(tiny_llama)))
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "README.md").write_text("my notes")
    (folder / "config.json").write_text("{}")
    (folder / "data.csv").write_text("1,2\n")
    before = snapshot(folder)

    refused = run_bmm_yaml(path, folder)
    assert refused.exit_code == 2
    assert "holds files a merge did not write (README.md, config.json, data.csv)" in error_line(
        refused.output
    )
    assert snapshot(folder) == before

    stock = run_stock(path, folder)  # the plugin's method through the stock command: refused too
    assert stock.returncode != 0 and "holds files a merge did not write" in error_line(stock.stderr)
    assert snapshot(folder) == before

    forced = run_bmm_yaml(path, folder, "--force")
    assert forced.exit_code == 0, forced.output[-2000:]
    assert "replacing README.md, config.json" in forced.output  # said, not silent
    assert (folder / "data.csv").read_text() == "1,2\n"  # other files are kept
    assert (folder / "model.safetensors").exists()

    again = run_bmm_yaml(path, folder)  # a previous merge's folder: merging again is fine...
    assert again.exit_code == 2 and "(data.csv)" in error_line(again.output)  # ...but not over data.csv


def test_huge_lambda_gives_the_anchor_and_nothing_non_finite(tiny_llama, tmp_path):
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe(tiny_llama, **{"lambda": 1e45})))
    result = run_bmm_yaml(path, tmp_path / "huge")
    assert result.exit_code == 0, result.output[-2000:]
    ta = {k: v for k, v in recipe(tiny_llama).items() if k != "parameters"}
    ta["merge_method"] = "task_arithmetic"
    (tmp_path / "ta.yml").write_text(yaml.safe_dump(ta))
    assert run_bmm_yaml(tmp_path / "ta.yml", tmp_path / "ta").exit_code == 0
    huge, anchor = load_weights(tmp_path / "huge"), load_weights(tmp_path / "ta")
    assert all(torch.isfinite(tensor).all() for tensor in huge.values())
    for name, tensor in huge.items():  # λ → ∞ is the anchor
        assert torch.allclose(tensor, anchor[name], rtol=0, atol=1e-6), name


def test_hidden_size_mismatch_names_the_cause(tiny_llama, tmp_path):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    other = make_tiny_family(tmp_path / "narrow", "llama", n_experts=1, hidden=32)
    config = recipe(tiny_llama)
    config["models"][0] = {"model": str(other.experts[0]), "parameters": {"weight": 0.3}}
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_bmm_yaml(path, tmp_path / "out")
    line = error_line(result.output)
    assert result.exit_code == 2 and "hidden sizes differ" in line and "(32)" in line and "(64)" in line


def test_an_unforeseen_error_is_one_line_with_its_traceback_kept(tiny_llama, tmp_path):
    import shutil

    broken = tmp_path / "broken-expert"
    shutil.copytree(tiny_llama.experts[0], broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    config = recipe(tiny_llama)
    config["models"][0]["model"] = str(broken)
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_stock(path, tmp_path / "out")
    assert result.returncode != 0
    line = error_line(result.stderr)
    kept = Path(line.split("the full traceback is in ", 1)[1].split(" ", 1)[0])
    assert "Traceback (most recent call last)" in kept.read_text()
    kept.unlink()
    verbose = run_stock(path, tmp_path / "out", MERGEKIT_BMM_TRACEBACK="1")
    assert verbose.returncode != 0 and "Traceback (most recent call last)" in verbose.stderr


def test_every_parameter_range_is_checked_at_its_boundaries():
    """The one table of ranges: each edge accepted or refused as documented, NaN and ±inf refused."""
    import math

    from mergekit_bmm.errors import ConfigError
    from mergekit_bmm.merge_methods.parameter_ranges import RANGES, check_range

    for (owner, name), allowed in RANGES.items():
        low, high = allowed.low, allowed.high
        step = 1 if allowed.integer else 1e-9
        if low is not None:
            if allowed.low_open:
                with pytest.raises(ConfigError, match=rf"{owner} parameter `{name}` must be"):
                    check_range(owner, name, low)
                assert check_range(owner, name, low + step) == low + step
            else:
                assert check_range(owner, name, low) == low
            with pytest.raises(ConfigError):
                check_range(owner, name, low - step)
        if high is not None:
            assert check_range(owner, name, high) == high
            with pytest.raises(ConfigError):
                check_range(owner, name, high + step)
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ConfigError):
                check_range(owner, name, bad)
    assert ("bmm", "scale") in RANGES and ("tsv", "alpha") in RANGES
