"""Data-assisted and mix BMM end to end: statistics → bmm, against float64 formulas."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights, relative_error
from references import expected_bmm_merge
from safetensors.torch import load_file, save_file
from stats_helpers import stored_grams, write_calibration

from mergekit_bmm.core.module_map import classify
from mergekit_bmm.errors import StatisticsError, find_bmm_error
from mergekit_bmm.stats.collect import collect_statistics
from mergekit_bmm.stats.config import parse_stats_config

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
CONFIGS = Path(__file__).parent.parent / "configs"
WEIGHTS = (0.5, 0.3, 0.2)


def collect(
    family, out: Path, data_dir: Path, max_samples: int = 24, experts=None, max_length: int = 64
) -> Path:
    experts = experts or family.experts
    tasks = []
    for index, expert in enumerate(experts):
        data = write_calibration(data_dir / f"{Path(expert).name}.jsonl", lines=24, offset=5 * index)
        tasks.append({"name": Path(expert).name, "model": str(expert), "data": str(data)})
    config = parse_stats_config({"tasks": tasks, "max_samples": max_samples, "max_length": max_length})
    collect_statistics(config, out, progress=False)
    return out


@pytest.fixture(scope="module")
def llama_stats(tiny_llama, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llama-stats")
    return collect(tiny_llama, root / "stats", root)


def recipe(family, gram: str, stats=None, experts=None, **parameters) -> dict:
    experts = experts or family.experts
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": w}} for p, w in zip(experts, WEIGHTS)],
        "parameters": {
            "anchor_method": "task_arithmetic",
            "lambda": 0.05,
            "gram": gram,
            **({"stats": str(stats)} if stats else {}),
            **parameters,
        },
        # float64 end to end where the test compares with a float64 reference to ~1e-9.
        "dtype": "float64" if parameters.get("compute_dtype") == "float64" else "float32",
    }


def merge(config: dict, out: Path) -> dict[str, torch.Tensor]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False),
    )
    return load_weights(out)


def worst_error(got: dict, expected: dict) -> tuple[float, str]:
    assert set(got) == set(expected)
    return max((relative_error(got[name], expected[name]), name) for name in expected)


def test_data_assisted_matches_float64_reference(tiny_llama, llama_stats, tmp_path):
    config = recipe(tiny_llama, "activations", llama_stats, compute_dtype="float64")
    got = merge(config, tmp_path / "out")
    expected = expected_bmm_merge(
        tiny_llama, WEIGHTS, 0.05, gram_mode="activations", grams=stored_grams(llama_stats)
    )
    error, name = worst_error(got, expected)
    assert error < 1e-9, name
    # The activation Grams matter: the data-free merge is a different model.
    free = expected_bmm_merge(tiny_llama, WEIGHTS, 0.05)
    assert (
        relative_error(got["model.layers.1.mlp.up_proj.weight"], free["model.layers.1.mlp.up_proj.weight"])
        > 1e-4
    )


@pytest.mark.parametrize("task_balance", ["trace", "frobenius", "adaptive"])
@pytest.mark.parametrize("gram", ["data_free", "activations", "mix"])
def test_task_balance_matches_float64_reference(gram, task_balance, tiny_llama, llama_stats, tmp_path):
    config = recipe(
        tiny_llama,
        gram,
        llama_stats if gram != "data_free" else None,
        compute_dtype="float64",
        task_balance=task_balance,
    )
    got = merge(config, tmp_path / "out")
    grams = stored_grams(llama_stats) if gram != "data_free" else None
    expected = expected_bmm_merge(
        tiny_llama, WEIGHTS, 0.05, gram_mode=gram, grams=grams, task_balance=task_balance
    )
    error, name = worst_error(got, expected)
    assert error < 1e-8, (name, error)  # Cholesky against LU on the reweighted system, both float64
    if task_balance == "trace":
        plain = expected_bmm_merge(tiny_llama, WEIGHTS, 0.05, gram_mode=gram, grams=grams)
        assert worst_error(got, plain)[0] > 1e-6, "balance changes the merge of unequal tasks"


def test_lambda_zero_is_regmean_on_task_vectors(tiny_llama, llama_stats, tmp_path):
    config = recipe(
        tiny_llama, "activations", llama_stats, compute_dtype="float64", anchor_method="pretrained"
    )
    config["parameters"]["lambda"] = 0.0
    got = merge(config, tmp_path / "out")
    base = load_weights(tiny_llama.base)
    experts = [load_weights(path) for path in tiny_llama.experts]
    grams = stored_grams(llama_stats)
    solved = 0
    for name, w_pre in base.items():
        if w_pre.ndim != 2 or classify(name, "llama") is None:
            continue
        task_grams = [grams[str(path)][name].double() for path in tiny_llama.experts]
        vectors = [e[name].double() - w_pre.double() for e in experts]
        regmean = sum(u @ g for u, g in zip(vectors, task_grams)) @ torch.linalg.inv(sum(task_grams))
        assert relative_error(got[name] - w_pre, regmean) < 1e-8, name
        solved += 1
    assert solved == 4 * 7


def test_huge_lambda_gives_the_anchor(tiny_llama, llama_stats, tmp_path):
    config = recipe(tiny_llama, "activations", llama_stats)
    config["parameters"]["lambda"] = 1e9
    got = merge(config, tmp_path / "out")
    base = load_weights(tiny_llama.base)
    experts = [load_weights(path) for path in tiny_llama.experts]
    for name, w_pre in base.items():
        anchor = w_pre.double() + sum(
            w * (e[name].double() - w_pre.double()) for w, e in zip(WEIGHTS, experts)
        )
        assert relative_error(got[name], anchor) < 1e-6, name


def fill(text: str, family, data_dir: Path, stats: Path) -> str:
    text = text.replace("/models/base", str(family.base))
    for path in family.experts:
        text = text.replace(f"/models/{path.name}", str(path))
        text = text.replace(f"/data/{path.name}.jsonl", str(data_dir / f"{path.name}.jsonl"))
    return text.replace("/stats", str(stats))


def run(command: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [str(BIN / command), *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def test_readme_flow_stats_command_then_stock_mergekit_yaml(tiny_llama, tmp_path):
    """configs/stats.yml → mergekit-bmm-stats, then configs/bmm-*.yml → stock mergekit-yaml."""
    stats = tmp_path / "stats"
    for index, expert in enumerate(tiny_llama.experts):
        write_calibration(tmp_path / f"{expert.name}.jsonl", lines=40, offset=3 * index)
    stats_yml = tmp_path / "stats.yml"
    stats_yml.write_text(fill((CONFIGS / "stats.yml").read_text(), tiny_llama, tmp_path, stats))
    collected = run("mergekit-bmm-stats", stats_yml, stats, "--quiet")
    assert collected.returncode == 0, collected.stderr[-2000:]
    manifest = json.loads((stats / "manifest.json").read_text())
    assert [task["samples"] for task in manifest["tasks"]] == [40, 40, 40]

    for name, mode in [
        ("bmm-data-free", "data_free"),
        ("bmm-activations", "activations"),
        ("bmm-mix", "mix"),
    ]:
        config = yaml.safe_load(fill((CONFIGS / f"{name}.yml").read_text(), tiny_llama, tmp_path, stats))
        config["dtype"] = "float32"  # the shipped recipes write bfloat16; compare in float32
        path = tmp_path / f"{name}.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        arguments = [path, tmp_path / name, "--no-copy-tokenizer"]
        if mode == "data_free":  # the stock command as its own process once (the plugin loads by itself)
            result = run("mergekit-yaml", *arguments)
            assert result.returncode == 0, result.stderr[-2000:]
        else:  # the same stock command in this process: it saves the seconds of importing mergekit
            from click.testing import CliRunner
            from mergekit.scripts.run_yaml import main as mergekit_yaml

            result = CliRunner().invoke(mergekit_yaml, [str(a) for a in arguments])
            assert result.exit_code == 0, result.output[-2000:]
        parameters = config["parameters"]
        expected = expected_bmm_merge(
            tiny_llama,
            (0.3, 0.3, 0.3),
            parameters["lambda"],
            gram_mode=mode,
            grams=stored_grams(stats) if mode != "data_free" else None,
            epsilon=parameters.get("epsilon", 0.5),
        )
        error, worst = worst_error(load_weights(tmp_path / name), expected)
        assert error < 1e-4, (name, worst, error)


@pytest.mark.parametrize("shots", [1, 5])
def test_few_shot_statistics_with_mix(shots, tiny_llama, tmp_path):
    # One short sample (16 tokens) per task: even the sum over three tasks has rank < d_in.
    max_length = 16 if shots == 1 else 64
    stats = collect(tiny_llama, tmp_path / "stats", tmp_path, max_samples=shots, max_length=max_length)
    manifest = json.loads((stats / "manifest.json").read_text())
    assert all(task["samples"] == shots for task in manifest["tasks"])
    for task in manifest["tasks"]:
        gram = stored_grams(stats)[task["model"]]["model.layers.0.mlp.down_proj.weight"].double()
        rank = int(torch.linalg.matrix_rank(gram, rtol=1e-6))
        assert rank <= task["tokens"] and (shots > 1 or rank < 128), "1-shot Grams are rank-deficient"

    for epsilon in (0.3,) if shots == 1 else (0.0, 0.3, 1.0):
        config = recipe(tiny_llama, "mix", stats, compute_dtype="float64", epsilon=epsilon)
        config["parameters"]["lambda"] = 0.01
        got = merge(config, tmp_path / f"mix-{epsilon}")
        expected = expected_bmm_merge(
            tiny_llama, WEIGHTS, 0.01, gram_mode="mix", grams=stored_grams(stats), epsilon=epsilon
        )
        error, name = worst_error(got, expected)
        assert error < 1e-7, (epsilon, name, error)
        if epsilon in (0.0, 1.0):
            mode = "data_free" if epsilon == 0.0 else "activations"
            alone = expected_bmm_merge(tiny_llama, WEIGHTS, 0.01, gram_mode=mode, grams=stored_grams(stats))
            assert worst_error(got, alone)[0] < 1e-7, f"epsilon {epsilon} is the {mode} merge"

    if shots > 1:
        return
    # λ = 0 on rank-deficient few-shot Grams: finite, and the pseudo-inverse limit
    # U = C G⁺ + U0 (I - G G⁺) wherever the spectrum has a clear gap.
    config = recipe(tiny_llama, "activations", stats)
    config["parameters"]["lambda"] = 0.0
    got = merge(config, tmp_path / "lambda0")
    assert all(torch.isfinite(t).all() for t in got.values())
    base = load_weights(tiny_llama.base)
    experts = [load_weights(p) for p in tiny_llama.experts]
    all_grams = stored_grams(stats)
    compared = 0
    for name, w_pre in base.items():
        if w_pre.ndim != 2 or classify(name, "llama") is None:
            continue
        vectors = [e[name].double() - w_pre.double() for e in experts]
        anchor = sum(w * v for w, v in zip(WEIGHTS, vectors))
        gram = sum(all_grams[str(p)][name].double() for p in tiny_llama.experts)
        cross = sum(u @ all_grams[str(p)][name].double() for u, p in zip(vectors, tiny_llama.experts))
        values, basis = torch.linalg.eigh(gram)
        kept = values > gram.shape[0] * torch.finfo(torch.float32).eps * values.max()
        if kept.all() or values[kept].min() < 1e3 * values[~kept].abs().max():
            continue  # full rank, or no clear gap between data and null space
        inverse = basis[:, kept] @ torch.diag(1 / values[kept]) @ basis[:, kept].T
        null = basis[:, ~kept] @ basis[:, ~kept].T
        limit = cross @ inverse + anchor @ null
        # float32 solve: relative error grows with the condition number of the kept part.
        condition = float(values.max() / values[kept].min())
        tolerance = 20 * condition * torch.finfo(torch.float32).eps
        assert relative_error(got[name] - w_pre, limit) < tolerance, (name, condition)
        compared += 1
    assert compared > 0


def _copy_stats(stats: Path, target: Path) -> Path:
    shutil.copytree(stats, target)
    return target


def _edit_manifest(stats: Path, edit) -> None:
    manifest = json.loads((stats / "manifest.json").read_text())
    edit(manifest)
    (stats / "manifest.json").write_text(json.dumps(manifest))


def _edit_gram(stats: Path, weight_name: str, value) -> None:
    """Replace the first task's Gram serving ``weight_name`` (rewritten in the stored form)."""
    from safetensors import safe_open

    from mergekit_bmm.stats.gram_storage import METADATA_KEY, from_mean
    from mergekit_bmm.stats.store import read_task_grams

    manifest = json.loads((stats / "manifest.json").read_text())
    task = manifest["tasks"][0]
    key = manifest["modules"][weight_name]
    path = stats / "grams" / task["file"] / task["parts"][key]
    stored = from_mean(value(read_task_grams(stats, task["name"])[key]), task["tokens"])
    with safe_open(str(path), framework="pt") as handle:
        forms = json.loads(handle.metadata()[METADATA_KEY])
    tensors = load_file(str(path))
    tensors[key], forms[key] = stored.tensor, stored.describe()
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(forms)})


DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize(
    "case, message",
    [
        ("other_checkpoint", r"for task 'expert-a' were made from a different checkpoint than .*expert-a"),
        ("no_task", r"have no task for model .*expert-c"),
        ("missing_module", rf"have no Gram for {DOWN}"),
        ("wrong_shape", rf"task 'expert-a', module {DOWN}: the Gram is 32x32 but the weight has 128 inputs"),
        ("nan", rf"task 'expert-a', module {DOWN}: the Gram contains NaN or Inf"),
        ("version", r"holds statistics format 'mergekit-bmm-stats' version 3; this mergekit-bmm reads"),
    ],
)
def test_unusable_statistics_are_refused(case, message, tiny_llama, llama_stats, tmp_path):
    stats = _copy_stats(llama_stats, tmp_path / "stats")
    family = tiny_llama
    if case == "other_checkpoint":
        # Stats for expert-a, then expert-a's folder holds another checkpoint.
        replaced = tmp_path / "models" / "expert-a"
        shutil.copytree(family.experts[0], replaced)
        stats = collect(
            family,
            tmp_path / "stats-replaced",
            tmp_path,
            max_samples=2,
            experts=[replaced, *family.experts[1:]],
        )
        shutil.copy(family.experts[1] / "model.safetensors", replaced / "model.safetensors")
        config = recipe(family, "activations", stats, experts=[replaced, *family.experts[1:]])
    elif case == "no_task":
        _edit_manifest(stats, lambda m: m.update(tasks=m["tasks"][:2]))
        config = recipe(family, "mix", stats)
    else:
        if case == "missing_module":
            _edit_manifest(stats, lambda m: m["modules"].pop(DOWN))
        elif case == "wrong_shape":
            _edit_gram(stats, DOWN, lambda g: g[:32, :32].contiguous())
        elif case == "nan":
            _edit_gram(stats, DOWN, lambda g: g.index_fill(0, torch.tensor([3]), float("nan")))
        else:
            _edit_manifest(stats, lambda m: m.update(format_version=3))
        config = recipe(family, "activations", stats)
    with pytest.raises(Exception) as info:
        merge(config, tmp_path / "out")
    error = find_bmm_error(info.value)
    assert isinstance(error, StatisticsError), info.value
    assert "\n" not in str(error)
    assert re.search(message, str(error)), str(error)
    assert str(stats) in str(error), "the message names the statistics directory"


def test_refusal_through_stock_mergekit_yaml_is_one_line(tiny_llama, llama_stats, tmp_path):
    stats = _copy_stats(llama_stats, tmp_path / "stats")
    _edit_manifest(stats, lambda m: m["tasks"][1].update(fingerprint="sha256:" + "0" * 32))
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe(tiny_llama, "mix", stats)))
    result = run("mergekit-yaml", path, tmp_path / "out", "--no-copy-tokenizer")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mergekit-bmm: error: statistics in {stats} for task 'expert-b' were made from")


def test_weights_reading_one_input_share_one_factorisation(tiny_llama, llama_stats, tmp_path, monkeypatch):
    """``gram: activations``: q, k and v (gate and up) have one ``G + λ'I``, factored once for them; the
    merge equals one that factors every weight itself."""
    from mergekit_bmm.core import closed_form as cf
    from mergekit_bmm.merge_methods import shared_factor

    config = recipe(tiny_llama, "activations", llama_stats)
    monkeypatch.setattr(shared_factor, "_KEEP", 0)  # nothing kept: every weight factors its own
    alone = merge(config, tmp_path / "alone")
    monkeypatch.undo()
    factored = []
    original = cf.ridge_factor
    monkeypatch.setattr(cf, "ridge_factor", lambda *a: factored.append(a) or original(*a))
    shared_factor._FACTORS.clear()
    together = merge(config, tmp_path / "together")
    modules = json.loads((llama_stats / "manifest.json").read_text())["modules"]
    inputs = {modules[name] for name in together if name in modules}
    assert len(factored) == len(inputs) < len([name for name in together if name in modules])
    assert all(torch.equal(alone[name], together[name]) for name in alone)
