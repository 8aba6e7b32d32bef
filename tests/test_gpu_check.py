"""The GPU check's CPU run: every part runs and the device merge matches the float64 reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_gpu_check_runs_on_the_cpu_with_small_shapes(tmp_path):
    from bench.gpu_check import main

    out = tmp_path / "check.json"
    main(
        [
            "--device",
            "cpu",
            "--size",
            "small",
            "--models",
            str(tmp_path / "models"),
            "--budget",
            "2",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert {row["gram"] for row in result["accuracy"]} == {"data_free", "activations", "mix"}
    assert all(row["tensors"] > 0 and row["max_relative_error"] < 1e-4 for row in result["accuracy"])
    assert set(result["speed"]["rows"]) == {
        "task_arithmetic", "ties", "bmm over task_arithmetic", "bmm over ties", "cache fill", "cached trial",
    }  # fmt: skip
    assert result["speed"]["gemm_floor_seconds"] > 0
    assert result["search"]["trials"] == 2 and result["search"]["trials_mode"] == "memory"
    assert set(result["billion"]["rows"]) == {"task_arithmetic", "bmm data-free over task_arithmetic"}
    assert "GPU check on CPU" in result["report"]
