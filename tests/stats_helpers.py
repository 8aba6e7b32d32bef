"""Helpers shared by the statistics tests: calibration data and the Grams as stored."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mergekit_bmm.examples.tiny_models import _CORPUS
from mergekit_bmm.stats.store import read_task_grams


def write_calibration(path: Path, lines: int = 24, offset: int = 0) -> Path:
    """JSONL of texts of varying length (1 to 3 corpus sentences each)."""
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(lines):
            count = 1 + (index + offset) % 3
            text = " ".join(_CORPUS[(index + offset + k) % len(_CORPUS)] for k in range(count))
            handle.write(json.dumps({"text": text, "split": "train" if index % 4 else "validation"}) + "\n")
    return path


def stored_grams(stats_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{model path: {weight name: Gram}}: every task's Grams as full matrices."""
    manifest = json.loads((Path(stats_dir) / "manifest.json").read_text())
    grams = {}
    for task in manifest["tasks"]:
        tensors = read_task_grams(stats_dir, task["name"])
        grams[task["model"]] = {name: tensors[key] for name, key in manifest["modules"].items()}
    return grams
