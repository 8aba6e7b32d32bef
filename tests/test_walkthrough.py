"""docs/your-own-models.md, steps 1–5, as a user runs them: the real commands on Hub ids served from a
cache laid out as huggingface_hub lays it out, with ``HF_HUB_OFFLINE=1`` (tiny models stand in for the
Hub's; publishing is ``--dry-run``). The steps run in order on one shared folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights
from hf_cache import lay_out
from search_objectives import EVALUATOR
from stats_helpers import write_calibration

from mergekit_bmm.cards.merge_record import read_record
from mergekit_bmm.plugin.run import merge_recipe_text

BIN = Path(sys.executable).parent
TESTS = Path(__file__).parent
EXPERTS = ("you/tiny-math", "you/tiny-code")


@dataclass
class Walk:
    root: Path
    env: dict[str, str]
    commits: dict[str, str]
    local: dict[str, Path]

    def run(self, *command: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(BIN / command[0]), *command[1:]], capture_output=True, text=True, env=self.env, cwd=self.root
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> Walk:
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    root = tmp_path_factory.mktemp("walkthrough")
    family = make_tiny_family(root / "made", "llama", n_experts=2, hidden=32, layers=2)
    cache = root / "hf" / "hub"
    local = {"you/tiny-base": family.base, **dict(zip(EXPERTS, family.experts))}
    commits = {repo: lay_out(cache, repo, folder) for repo, folder in local.items()}
    env = {**os.environ, "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    recipe = {
        "merge_method": "bmm",
        "base_model": "you/tiny-base",
        "models": [{"model": repo, "parameters": {"weight": 0.3}} for repo in EXPERTS],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.1, "scale": 1.0},
        "dtype": "float32",
    }
    (root / "merge.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return Walk(root, env, commits, local)


def test_step_1_a_first_merge_of_hub_ids_offline(walk):
    walk.run("mergekit-yaml", "merge.yml", "out/merged")
    merged = walk.root / "out" / "merged"
    record = read_record(merged)
    assert {item.model: item.revision for item in record.inputs} == walk.commits
    card = (merged / "README.md").read_text()
    assert "[you/tiny-math](https://huggingface.co/you/tiny-math)" in card
    # the same model as a merge of the local folders, with the same fingerprints on record
    recipe = yaml.safe_load((walk.root / "merge.yml").read_text())
    recipe["base_model"] = str(walk.local[recipe["base_model"]])
    for item in recipe["models"]:
        item["model"] = str(walk.local[item["model"]])
    local = walk.root / "local-merge"
    merge_recipe_text(yaml.safe_dump(recipe), local)
    by_id, by_path = load_weights(merged), load_weights(local)
    assert all(torch.equal(by_id[name], by_path[name]) for name in by_path)
    prints = {item.fingerprint for item in read_record(local).inputs}
    assert {item.fingerprint for item in record.inputs} == prints


def test_step_2_the_search_on_hub_ids_offline(walk):
    search = {
        "recipe": "merge.yml",
        "blocks": 1,
        "budget": 2,
        "n_initial": 2,
        "evaluator": EVALUATOR,
    }
    (walk.root / "search.yml").write_text(yaml.safe_dump(search))
    walk.run("mergekit-bmm-search", "search.yml", "out/search", "--eval-anchor", "--quiet")
    best = yaml.safe_load((walk.root / "out" / "search" / "best.yml").read_text())
    assert best["base_model"] == "you/tiny-base"  # the recipe still names the Hub ids
    experiment = json.loads((walk.root / "out" / "search" / "experiment.json").read_text())
    assert experiment["definition"]["revisions"] == walk.commits  # the commits searched over
    assert {item.revision for item in read_record(walk.root / "out" / "search" / "best").inputs} == set(
        walk.commits.values()
    )


def test_step_3_statistics_of_hub_experts_then_a_data_assisted_merge(walk):
    data = write_calibration(walk.root / "calibration.jsonl", lines=16)
    stats = {
        "max_samples": 8,
        "max_length": 32,
        "tasks": [{"name": repo.split("-")[-1], "model": repo, "data": str(data)} for repo in EXPERTS],
    }
    (walk.root / "stats.yml").write_text(yaml.safe_dump(stats))
    walk.run("mergekit-bmm-stats", "stats.yml", "out/stats", "--quiet")
    manifest = json.loads((walk.root / "out" / "stats" / "manifest.json").read_text())
    assert {task["revision"] for task in manifest["tasks"]} == {walk.commits[repo] for repo in EXPERTS}
    recipe = yaml.safe_load((walk.root / "merge.yml").read_text())
    recipe["parameters"].update(gram="activations", stats="out/stats")
    (walk.root / "assisted.yml").write_text(yaml.safe_dump(recipe))
    walk.run("mergekit-yaml", "assisted.yml", "out/assisted")
    assert read_record(walk.root / "out" / "assisted").weights_fingerprint


def test_step_4_the_results_are_where_the_page_says(walk):
    search = walk.root / "out" / "search"
    for name in ("summary.json", "best.yml", "convergence.png", "lambdas.png", "trials.jsonl"):
        assert (search / name).is_file(), name
    assert (search / "best" / "README.md").is_file()
    summary = json.loads((search / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["completed_trials"] == 2


def test_step_5_publish_dry_run_offline(walk):
    done = walk.run("mergekit-bmm-publish", "out/search/best", "you/tiny-bmm", "--dry-run")
    assert "model.safetensors" in done.stdout and "you/tiny-base" in done.stdout
