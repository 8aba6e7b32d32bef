"""The GPU check's CPU run: every part runs and the device merge matches the float64 reference."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


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
    assert {row["case"] for row in result["accuracy"]} == {
        "data_free", "activations", "mix", "ace anchor", "balance mix",
    }  # fmt: skip
    assert all(row["tensors"] > 0 and row["max_relative_error"] < 1e-4 for row in result["accuracy"])
    assert set(result["speed"]["rows"]) == {
        "task_arithmetic", "ties", "bmm over task_arithmetic", "bmm over ties", "cache fill", "cached trial",
    }  # fmt: skip
    assert result["speed"]["gemm_floor_seconds"] > 0
    assert result["search"]["trials"] == 2 and result["search"]["trials_mode"] == "memory"
    assert set(result["billion"]["rows"]) == {"task_arithmetic", "bmm data-free over task_arithmetic"}
    assert "GPU check on CPU" in result["report"]


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path):
    """On a machine without CUDA every merge child fails: each part says so, the JSON keeps both."""
    import torch

    from bench.gpu_check import main

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    out = tmp_path / "check.json"
    main(["--device", "cuda", "--size", "small", "--models", str(tmp_path / "models"),
          "--parts", "billion,speed", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert list(result["seconds"]) == ["billion", "speed"]
    assert "error" in result["billion"] and "error" in result["speed"]
    assert "billion: failed:" in result["report"] and "accuracy: not run" in result["report"]


def test_an_unknown_part_is_refused_in_one_line(capsys):
    from bench.gpu_check import main

    with pytest.raises(SystemExit):
        main(["--parts", "accuracy,speeed"])
    assert "unknown part(s) speeed" in capsys.readouterr().err
