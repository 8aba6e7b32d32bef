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


def test_gpu_check_speed_runs_the_merge_speed_workload_on_the_device(models, tmp_path):
    speed = _check(models, tmp_path / "check.json", "speed")
    assert speed["workload"] == "merge_speed" and speed["parameters"]["device"] == "cpu"
    labels = {row["label"] for row in speed["rows"]}
    assert {"task_arithmetic", "bmm over task_arithmetic", "cached trial (new λ and s)"} <= labels
    assert all(row["seconds"] > 0 for row in speed["rows"])


def test_gpu_check_search_on_the_cpu_with_small_shapes(models, tmp_path):
    search = _check(models, tmp_path / "check.json", "search")
    assert search["trials"] == 2 and search["trials_mode"] == "memory"


def test_gpu_check_billion_runs_the_billion_merge_workload(models, tmp_path):
    """Also the billion_merge workload's quick-size run (test_perf leaves it to this test)."""
    found = _check(models, tmp_path / "billion.json", "billion")
    assert found["workload"] == "billion_merge" and found["size"] == "quick"
    assert {"task_arithmetic", "bmm data-free"} <= {row["label"] for row in found["rows"]}
    assert all(row["seconds"] >= 0 for row in found["rows"])


def test_gpu_check_eight_b_is_the_billion_merge_workload_at_llama_3_8b_depth(tmp_path, monkeypatch):
    """At the small size ``eight_b`` runs exactly the ``billion`` part's workload (tested above); at
    the full size it sets the 8B body: hidden 4096, MLP 14336, 32 layers, T = 2, no warm-up."""
    import bench.gpu_check as check

    asked = []
    monkeypatch.setattr(check, "workload", lambda *args, **kwargs: asked.append((args, kwargs)) or {})
    check.eight_b(tmp_path, "cuda", "full")
    (name, _, device, size, shape), options = asked[0]
    assert (name, device, size, options) == ("billion_merge", "cuda", "full", {"warmup": 0})
    assert {k: shape[k] for k in ("hidden", "intermediate", "layers", "experts")} == {
        "hidden": 4096, "intermediate": 14336, "layers": 32, "experts": 2,
    }  # fmt: skip


def test_gpu_check_label_free_search(models, tmp_path):
    label_free = _check(models, tmp_path / "label-free.json", "label_free")
    assert label_free["objective"] == "agreement (no labels)" and label_free["trials"] == 2
    assert label_free["before_trials_seconds"] > 0


def test_gpu_check_lora_routes_data_free_and_data_assisted(models, tmp_path):
    lora = _check(models, tmp_path / "lora.json", "lora")
    assert set(lora) == {"8B data_free", "8B activations", "1B activations"}
    assert {run["parameters"]["gram"] for run in lora.values()} == {"data_free", "activations"}


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


def test_the_retired_speed_cases_option_says_where_to_go(capsys):
    from bench.gpu_check import main

    with pytest.raises(SystemExit):
        main(["--parts", "speed", "--speed-cases", "ties"])
    assert "--speed-cases is gone" in capsys.readouterr().err
