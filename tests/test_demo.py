"""``mergekit-bmm-demo``: every step's output exists and the table has every row (reduced size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
ROWS = (
    "base (before fine-tuning)",
    "each expert on its own task",
    "Task Arithmetic",
    "TIES",
    "BMM at its defaults",
    "BMM searched",
    "BMM searched, no labels",
)


def _demo(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(BIN / "mergekit-bmm-demo"), *args], capture_output=True, text=True, env=env)


def test_the_demo_merges_searches_and_prints_test_accuracy(tmp_path):
    out = tmp_path / "demo"
    done = _demo(str(out), "--small")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("test accuracy (%)"))
    assert header.split()[-5:] == ["first", "second", "even", "rising", "mean"]
    for label in ROWS:
        row = next(line for line in lines if line.startswith(label))
        cells = [float(cell) for cell in row[len(label) :].split()]
        assert len(cells) == 5 and all(0.0 <= cell <= 100.0 for cell in cells), row
    for merged in ("task_arithmetic", "ties", "bmm", "search/best"):
        assert (out / merged / "config.json").is_file(), merged
        assert list((out / merged).glob("*.safetensors")), merged
    summary = json.loads((out / "search" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["completed_trials"] == 3
    assert summary["fidelity"]["trials"] == 3  # the demo's python evaluator scores single examples
    no_labels = json.loads((out / "search-label-free" / "summary.json").read_text())
    assert no_labels["status"] == "finished" and no_labels["completed_trials"] == 3
    unlabelled = sorted((out / "unlabelled").glob("*.jsonl"))
    assert len(unlabelled) == 4  # one text file per task: what the no-label search read
    assert all(set(json.loads(line)) == {"text"} for p in unlabelled for line in p.read_text().splitlines())
    assert "This search used no labels" in (out / "search-label-free" / "best" / "README.md").read_text()
    png = out / "search" / "convergence.png"
    assert png.is_file() and f"convergence: {png}" in done.stdout
    for command in ("mergekit-yaml", "mergekit-bmm-search"):
        assert any(line.strip().startswith(command) for line in lines), command


def test_the_weight_space_table_of_the_earlier_demo_is_behind_a_flag(tmp_path):
    done = _demo(str(tmp_path / "weights"), "--architecture", "qwen2")  # the earlier option implies --weights
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generating a tiny qwen2 base" in done.stdout and "dist a" in done.stdout
