"""The GPU check's CPU run: every part runs and the device merge matches the float64 reference."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One model cache for every part: each family is generated once per test run."""
    return tmp_path_factory.mktemp("gpu-check-models")


def _check(models, out, part: str, *extra: str) -> dict:
    from bench.gpu_check import main

    main(["--device", "cpu", "--size", "small", "--models", str(models), "--budget", "2",
          "--parts", part, "--out", str(out), *extra])  # fmt: skip
    result = json.loads(out.read_text())
    assert "GPU check on CPU" in result["report"] and list(result["seconds"]) == [part]
    return result[part]


# One test per part (the whole check is `--parts accuracy,speed,search,billion`, the default).
def test_gpu_check_accuracy_on_the_cpu_with_small_shapes(models, tmp_path):
    accuracy = _check(models, tmp_path / "check.json", "accuracy")
    assert {row["case"] for row in accuracy} == {
        "data_free", "activations", "mix", "ace anchor", "balance mix",
    }  # fmt: skip
    assert all(row["tensors"] > 0 and row["max_relative_error"] < 1e-4 for row in accuracy)


@pytest.mark.parametrize(
    "cases",  # each case is a merge in a child process: two halves, so no test runs past 30 s
    ["task_arithmetic,ties,bmm over task_arithmetic", "bmm over ties,cache fill,cached trial"],
)
def test_gpu_check_speed_on_the_cpu_with_small_shapes(models, tmp_path, cases):
    speed = _check(models, tmp_path / "check.json", "speed", "--speed-cases", cases)
    assert set(speed["rows"]) == set(cases.split(","))
    assert all(row["seconds"] > 0 for row in speed["rows"].values())
    assert speed["gemm_floor_seconds"] > 0


def test_gpu_check_search_on_the_cpu_with_small_shapes(models, tmp_path):
    search = _check(models, tmp_path / "check.json", "search")
    assert search["trials"] == 2 and search["trials_mode"] == "memory"


def test_gpu_check_billion_on_the_cpu_with_small_shapes(models, tmp_path):
    billion = _check(models, tmp_path / "check.json", "billion")
    assert set(billion["rows"]) == {"task_arithmetic", "bmm data-free over task_arithmetic"}


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


def test_gpu_check_moe_statistics_on_the_cpu_with_small_shapes(models, tmp_path):
    moe = _check(models, tmp_path / "check.json", "moe")
    collect = next(row for row in moe["rows"] if row["label"].startswith("per-expert statistics"))
    assert collect["seconds"] > 0 and collect["baseline"].startswith("one forward pass")
    assert moe["figures"]["expert slices without a token"].endswith(f"of {2 * 2 * 4}")
    assert moe["figures"]["passes planned"] >= 1
