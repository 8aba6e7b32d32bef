"""Statistics anyone can share: Hub experts and data in stats.yml, ``stats: hf://...`` in recipes
(offline, from a cache laid out as huggingface_hub lays it out), refusals, and publishing a
statistics folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_weights, relative_error
from hf_cache import lay_out
from hub_standin import HubStandIn
from stats_helpers import write_calibration

from mergekit_bmm.errors import PublishError, StatisticsError, find_bmm_error
from mergekit_bmm.stats.collect import collect_statistics
from mergekit_bmm.stats.config import parse_stats_config
from mergekit_bmm.stats.store import load_manifest, read_task_grams

BIN = Path(sys.executable).parent


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty huggingface_hub cache that this process (offline) reads from."""
    import huggingface_hub.constants

    from mergekit_bmm.stats import hub as stats_hub
    from mergekit_bmm.stats import store

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    stats_hub.stats_directory.cache_clear()
    store._hub_copy.cache_clear()
    yield cache
    stats_hub.stats_directory.cache_clear()
    store._hub_copy.cache_clear()


def _collect(tasks: list[dict], out: Path) -> Path:
    collect_statistics(
        parse_stats_config({"tasks": tasks, "max_length": 48, "max_samples": 12}), out, progress=False
    )
    return out


@pytest.fixture
def local_stats(tiny_llama, tmp_path) -> Path:
    data = write_calibration(tmp_path / "calibration.jsonl", lines=20)
    tasks = [{"name": p.name, "model": str(p), "data": str(data)} for p in tiny_llama.experts[:2]]
    return _collect(tasks, tmp_path / "local-stats")


def _recipe(tiny_llama, stats: str, experts=None) -> dict:
    experts = experts or tiny_llama.experts[:2]
    return {
        "merge_method": "bmm",
        "base_model": str(tiny_llama.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in experts],
        "parameters": {
            "anchor_method": "task_arithmetic",
            "lambda": 0.01,
            "gram": "activations",
            "stats": stats,
        },
        "dtype": "float32",
    }


def _merge(config: dict, out: Path) -> dict[str, torch.Tensor]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False),
    )
    return load_weights(out)


def test_stats_yml_takes_hub_experts_and_a_hub_dataset(tiny_llama, local_stats, hub, tmp_path):
    experts = {p.name: lay_out(hub, f"org/{p.name}", p) for p in tiny_llama.experts[:2]}
    data = tmp_path / "calib-repo"
    data.mkdir()
    write_calibration(data / "train.jsonl", lines=20)
    data_commit = lay_out(hub, "org/calib", data, repo_type="dataset")

    tasks = [
        {"name": name, "model": f"org/{name}", "data": "org/calib", "split": "train"} for name in experts
    ]
    manifest = load_manifest(_collect(tasks, tmp_path / "hub-stats"))
    for task in manifest.tasks:
        assert (task.model, task.revision) == (f"org/{task.name}", experts[task.name])
        assert task.data == "org/calib" and task.settings["data_fingerprint"] == f"hub:{data_commit}"
        assert task.fingerprint == load_manifest(local_stats).tasks[manifest.tasks.index(task)].fingerprint
    # The same texts through the same weights: the same Grams as from local folders and files.
    for task in manifest.tasks:
        got, expected = (
            read_task_grams(tmp_path / "hub-stats", task.name),
            read_task_grams(local_stats, task.name),
        )
        assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_a_recipe_reads_statistics_from_the_hub_cache_and_checks_whose_they_are(
    tiny_llama, local_stats, hub, tmp_path
):
    expected = _merge(_recipe(tiny_llama, str(local_stats)), tmp_path / "from-folder")
    commit = lay_out(hub, "org/llama-stats", local_stats)
    for reference in ("hf://org/llama-stats", f"hf://org/llama-stats@{commit}"):
        got = _merge(_recipe(tiny_llama, reference), tmp_path / f"from-hub-{len(reference)}")
        assert max(relative_error(got[k], expected[k]) for k in expected) == 0.0

    # Statistics of other experts are refused in one line, naming what they cover.
    with pytest.raises(Exception) as info:
        _merge(_recipe(tiny_llama, "hf://org/llama-stats", tiny_llama.experts[1:]), tmp_path / "other")
    error = find_bmm_error(info.value)
    assert isinstance(error, StatisticsError) and "\n" not in str(error)
    assert "no task for model" in str(error) and "expert-c" in str(error)

    with pytest.raises(StatisticsError, match="cannot fetch it from the Hub"):
        load_manifest("hf://org/missing-stats")


def test_statistics_made_from_hub_ids_serve_local_copies_and_refuse_another_commit(tiny_llama, hub, tmp_path):
    from mergekit.common import ModelReference

    for path in tiny_llama.experts[:2]:
        lay_out(hub, f"org/{path.name}", path)
    data = write_calibration(tmp_path / "calibration.jsonl", lines=20)
    tasks = [{"name": p.name, "model": f"org/{p.name}", "data": str(data)} for p in tiny_llama.experts[:2]]
    stats = _collect(tasks, tmp_path / "stats")
    lay_out(hub, "org/stats", stats)
    merged = _merge(
        _recipe(tiny_llama, "hf://org/stats"), tmp_path / "merged"
    )  # local folders, matched by weights
    assert all(torch.isfinite(t).all() for t in merged.values())

    manifest = load_manifest("hf://org/stats")
    other = ModelReference.parse(f"org/{tiny_llama.experts[0].name}@{'0' * 40}")
    with pytest.raises(
        StatisticsError, match=r"at commit [0-9a-f]{12}, but the recipe uses commit 000000000000"
    ):
        manifest.task_for_model(other, Path("hf://org/stats"))


def test_files_from_the_hub_are_checked_before_use(local_stats, hub, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from mergekit_bmm.stats.gram_storage import METADATA_KEY

    tampered = tmp_path / "tampered"
    shutil.copytree(local_stats, tampered)
    manifest = json.loads((tampered / "manifest.json").read_text())
    task = manifest["tasks"][0]
    key, part = next(iter(task["parts"].items()))
    path = tampered / "grams" / task["file"] / part
    with safe_open(str(path), framework="pt") as handle:
        forms = json.loads(handle.metadata()[METADATA_KEY])
    forms[key][1] = 1 << 20  # declares a million inputs: the tensor does not match
    save_file(load_file(str(path)), str(path), metadata={METADATA_KEY: json.dumps(forms)})
    lay_out(hub, "org/tampered", tampered)
    with pytest.raises(StatisticsError, match="not the packed float32 form its header declares") as info:
        read_task_grams("hf://org/tampered", task["name"])
    assert "\n" not in str(info.value)

    escaping = tmp_path / "escaping"
    shutil.copytree(local_stats, escaping)
    manifest["tasks"][0]["parts"][key] = "../../../secret.safetensors"
    (escaping / "manifest.json").write_text(json.dumps(manifest))
    lay_out(hub, "org/escaping", escaping)
    with pytest.raises(StatisticsError, match="is malformed .*not a plain .safetensors file name"):
        load_manifest("hf://org/escaping")


def test_publish_a_statistics_folder(tiny_llama, local_stats, tmp_path):
    from click.testing import CliRunner

    from mergekit_bmm.cards.stats_card import publish_statistics
    from mergekit_bmm.cli.publish import main

    (local_stats / "grams" / "notes.txt").write_text("not uploaded")
    result = CliRunner().invoke(main, [str(local_stats), "me/llama-stats", "--dry-run"])
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.output.splitlines() if line.startswith("  ")]
    parts = sorted(
        p.relative_to(local_stats).as_posix() for p in (local_stats / "grams").rglob("*.safetensors")
    )
    assert listed == sorted(["README.md", "manifest.json", *parts])
    assert "activation-statistics" in result.output
    assert not (local_stats / "README.md").exists(), "a dry run writes nothing"

    with pytest.raises(PublishError, match="offline mode"):
        publish_statistics(local_stats, "me/llama-stats")  # the test session is offline

    offline = ("HF_", "TRANSFORMERS_OFFLINE")
    env = {key: value for key, value in os.environ.items() if not key.startswith(offline)}
    with HubStandIn() as standin:
        env.update(
            HF_ENDPOINT=standin.endpoint, HF_TOKEN="hf_standin_token", HF_HOME=str(tmp_path / "hf-home")
        )
        command = [str(BIN / "mergekit-bmm-publish"), str(local_stats), "me/llama-stats"]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        uploaded = standin.state.repos["me/llama-stats"].branches["main"] if done.returncode == 0 else {}
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(uploaded) == sorted(["README.md", "manifest.json", *parts])
    card = uploaded["README.md"].decode()
    assert "stats: hf://me/llama-stats" in card and "| expert-a |" in card
    assert uploaded["manifest.json"] == (local_stats / "manifest.json").read_bytes()
