"""The performance workloads: one protocol (bench/perf/harness.py), and every workload at its quick size,
so that none rots between the runs that report its figures."""

from __future__ import annotations

import json

import pytest

from bench.perf import workloads
from bench.perf.harness import Group, Job, Workload, run_workload


def test_the_protocol_alternates_writes_fresh_folders_and_pairs_rounds(tmp_path):
    seen: list[tuple[str, bool]] = []

    def job(label: str):
        def run(out):
            seen.append((label, out.exists()))  # a fresh folder: the last round's output is gone
            out.mkdir(parents=True)
            (out / "written").write_text(label)

        return run

    jobs = [Job("baseline", job("baseline")), Job("variant", job("variant"), "baseline")]
    toy = Workload(
        "toy", "a toy", {"quick": {"rounds": 3}, "full": {"rounds": 3}}, lambda p, r: [Group(jobs)]
    )
    result = run_workload(toy, "quick", warmup=1, out_root=tmp_path, echo=lambda line: None)
    assert [label for label, _ in seen] == ["baseline", "variant", "variant", "baseline"] * 2
    assert not any(existed for _, existed in seen)
    rows = {row["label"]: row for row in result["rows"]}
    assert len(rows["variant"]["runs"]) == 3 and rows["variant"]["baseline"] == "baseline"  # warm-up dropped
    assert rows["variant"]["min"] <= rows["variant"]["seconds"] <= rows["variant"]["max"]
    recorded = json.loads((tmp_path / "toy.json").read_text())
    assert recorded["machine"]["omp_wait_policy"] and recorded["machine"]["versions"]["torch"]


@pytest.mark.parametrize("name", workloads.names())
def test_every_workload_runs_at_its_quick_size(name, tmp_path):
    result = run_workload(
        workloads.workload(name), "quick", warmup=0, out_root=tmp_path, echo=lambda line: None
    )
    assert result["rows"] and all(row["seconds"] >= 0 for row in result["rows"])
    assert (tmp_path / f"{name}.json").is_file()
    if name == "lora_merge":  # the routes against a float64 solve of the adapters' exact updates
        errors = {key: float(value) for key, value in result["figures"].items()}
        assert errors["relative error vs float64, bmm, low-rank route"] < 1e-5
        assert any(row["label"].startswith("mergekit-bmm-lora") for row in result["rows"])
