"""Statistics at scale: collection under a memory budget, compact storage, resuming a task's passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import relative_error
from stats_helpers import write_calibration

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.stats import collect as collect_module
from mergekit_bmm.stats.collect import collect_statistics
from mergekit_bmm.stats.config import parse_stats_config
from mergekit_bmm.stats.passes import accumulator_bytes
from mergekit_bmm.stats.store import GRAM_DIR, load_manifest, read_task_grams, write_grams


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    return write_calibration(tmp_path_factory.mktemp("data") / "calibration.jsonl", lines=40)


def config(tiny_llama, calibration, samples: int = 40):
    tasks = [
        {"name": path.name, "model": str(path), "data": str(calibration), "max_samples": samples}
        for path in tiny_llama.experts[:2]
    ]
    return parse_stats_config({"tasks": tasks, "max_length": 48, "batch_size": 4})


def one_layer_budget(stats: Path) -> int:
    """What layer 0's accumulators take, from a finished one-pass collection."""
    manifest = load_manifest(stats)
    grams = read_task_grams(stats, manifest.tasks[0].name)
    keys = {key for key in manifest.modules.values() if ".layers.0." in key}
    return sum(accumulator_bytes(grams[key].shape[0], manifest.tasks[0].tokens) for key in keys)


def all_grams(stats: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {task.name: read_task_grams(stats, task.name) for task in load_manifest(stats).tasks}


def test_a_budgeted_multi_pass_collection_equals_one_pass(tiny_llama, calibration, tmp_path):
    one = tmp_path / "one-pass"
    collect_statistics(config(tiny_llama, calibration), one, progress=False)
    assert [task.passes for task in load_manifest(one).tasks] == [1, 1]

    import yaml

    from mergekit_bmm.cli.stats import main

    budget = one_layer_budget(one)
    path = tmp_path / "stats.yml"
    path.write_text(yaml.safe_dump(config(tiny_llama, calibration).model_dump(exclude_none=True)))
    result = CliRunner().invoke(main, [str(path), str(tmp_path / "budgeted"), "--max-memory", f"{budget}B"])
    assert result.exit_code == 0, result.output
    budgeted = load_manifest(tmp_path / "budgeted")
    layers = len({name.split(".")[2] for name in budgeted.modules})
    assert [task.passes for task in budgeted.tasks] == [layers, layers], "one pass per layer"
    assert len(list((tmp_path / "budgeted" / GRAM_DIR / budgeted.tasks[0].file).glob("part-*"))) == layers
    assert "passes" in result.output and f"{layers}  " in result.output

    expected, got = all_grams(one), all_grams(tmp_path / "budgeted")
    assert got.keys() == expected.keys()
    for task, grams in expected.items():
        for key, gram in grams.items():
            assert torch.equal(got[task][key], gram), (task, key)


def test_an_interrupted_task_resumes_after_its_last_finished_pass(
    tiny_llama, calibration, tmp_path, monkeypatch
):
    one = tmp_path / "one-pass"
    collect_statistics(config(tiny_llama, calibration), one, progress=False)
    budget = one_layer_budget(one)

    real = collect_module.write_part
    written: list[str] = []

    def killed_after_first_pass(out, folder, index, grams):
        if written:
            raise KeyboardInterrupt  # the process dies while its second pass is being written
        written.append(real(out, folder, index, grams))
        return written[-1]

    out = tmp_path / "stats"
    monkeypatch.setattr(collect_module, "write_part", killed_after_first_pass)
    with pytest.raises(KeyboardInterrupt):
        collect_statistics(config(tiny_llama, calibration), out, progress=False, max_memory=budget)
    monkeypatch.setattr(collect_module, "write_part", real)
    first = out / GRAM_DIR / "expert-a" / "part-00001.safetensors"
    stamp = first.stat().st_mtime_ns
    assert json.loads((out / "manifest.json").read_text())["tasks"] == []

    manifest = collect_statistics(config(tiny_llama, calibration), out, progress=False, max_memory=budget)
    assert first.stat().st_mtime_ns == stamp, "the finished pass was not run again"
    assert not (out / GRAM_DIR / "expert-a" / "progress.json").exists()
    assert manifest.tasks[0].passes == manifest.tasks[1].passes > 1
    expected, got = all_grams(one), all_grams(out)
    for task, grams in expected.items():
        for key, gram in grams.items():
            assert torch.equal(got[task][key], gram), (task, key)


def test_a_budget_below_one_layer_is_refused_in_one_line(tiny_llama, calibration, tmp_path):
    import yaml

    from mergekit_bmm.cli.stats import main

    with pytest.raises(
        ConfigError, match=r"less than layer 0's accumulators alone .*raise --max-memory"
    ) as info:
        collect_statistics(
            config(tiny_llama, calibration), tmp_path / "stats", progress=False, max_memory=1000
        )
    assert "\n" not in str(info.value)

    path = tmp_path / "stats.yml"
    path.write_text(yaml.safe_dump(config(tiny_llama, calibration).model_dump(exclude_none=True)))
    result = CliRunner().invoke(main, [str(path), str(tmp_path / "cli"), "--max-memory", "1KB", "--quiet"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "mergekit-bmm: error: --max-memory 1000 bytes is less than layer 0's accumulators alone "
        f"({info.value.args[0].split('alone (')[1].split(')')[0]}); raise --max-memory to at least "
        f"{info.value.args[0].split('at least ')[1]}"
    ], "--quiet: the error line and nothing else"


def _as_version_1(stats: Path, target: Path) -> Path:
    """The same Grams written as format version 1 (full float32 matrices, one file per task)."""
    manifest = json.loads((stats / "manifest.json").read_text())
    for task in manifest["tasks"]:
        write_grams(target / GRAM_DIR / f"{task['name']}.safetensors", read_task_grams(stats, task["name"]))
        task.update(file=f"{task['name']}.safetensors", parts={}, passes=0)
    manifest["format_version"] = 1
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def _size(stats: Path) -> int:
    return sum(path.stat().st_size for path in (stats / GRAM_DIR).rglob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("samples", [40, 1])
def test_compact_statistics_are_at_most_half_and_merge_the_same(samples, tiny_llama, calibration, tmp_path):
    from conftest import load_weights
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    compact = tmp_path / "v2"
    collect_statistics(config(tiny_llama, calibration, samples), compact, progress=False)
    today = _as_version_1(compact, tmp_path / "v1")
    ratio = _size(compact) / _size(today)
    tokens = load_manifest(compact).tasks[0].tokens
    # Packed triangles hold d(d+1)/2 of d² numbers; fewer tokens than inputs store the rows.
    assert ratio <= (0.51 if samples == 40 else 0.5), (samples, tokens, ratio)

    merged = {}
    for name, stats in (("v2", compact), ("v1", today)):
        recipe = {
            "merge_method": "bmm",
            "base_model": str(tiny_llama.base),
            "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in tiny_llama.experts[:2]],
            "parameters": {
                "anchor_method": "task_arithmetic",
                "lambda": 1e-3,
                "gram": "activations",
                "stats": str(stats),
            },
            "dtype": "float32",
        }
        run_merge(
            MergeConfiguration.model_validate(recipe),
            str(tmp_path / f"merged-{name}"),
            options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False),
        )
        merged[name] = load_weights(tmp_path / f"merged-{name}")
    worst = max(relative_error(merged["v2"][key], merged["v1"][key]) for key in merged["v1"])
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("d_in", [1, 7, 511, 512, 513, 1100])
def test_packed_gram_reads_back_bit_for_bit(d_in):
    """The upper triangle stored, the whole symmetric matrix read (across the mirroring's blocks)."""
    from mergekit_bmm.stats.gram_storage import pack, unpack

    rows = torch.randn(d_in, 3 * d_in, generator=torch.Generator().manual_seed(d_in))
    gram = rows @ rows.T
    gram = (gram + gram.T) / 2  # exactly symmetric, as the collector's mean Gram is stored
    assert torch.equal(unpack(pack(gram), d_in), gram)
