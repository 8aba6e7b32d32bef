"""The performance workloads: one protocol (bench/perf/harness.py), and every workload at its quick size,
so that none rots between the runs that report its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def test_a_stopped_resumable_job_goes_on_from_its_folder_and_new_parameters_start_it_afresh(tmp_path):
    """A search of hours (``resumes``) that stops keeps its progress for the next run of the same
    workload; under other parameters its folder is not the run's to resume."""

    def search(out):
        out.mkdir(parents=True, exist_ok=True)
        steps = out / "steps"
        done = len(steps.read_text()) if steps.is_file() else 0
        steps.write_text("x" * (done + 1))
        if done == 0:
            raise KeyboardInterrupt  # stopped after its first step

    def build(parameters, root):
        return [Group([Job("search", search)], rounds=1, warmup=0, resumes=True)]

    toy = Workload("toy", "a toy", {"quick": {"rounds": 1, "k": 1}, "full": {"rounds": 1}}, build)
    steps = tmp_path / "out" / "group-0" / "0" / "steps"
    with pytest.raises(KeyboardInterrupt):
        run_workload(toy, "quick", warmup=0, out_root=tmp_path, echo=lambda line: None)
    run_workload(toy, "quick", warmup=0, out_root=tmp_path, echo=lambda line: None)
    assert steps.read_text() == "xx"  # went on from its first step
    with pytest.raises(KeyboardInterrupt):
        run_workload(toy, "quick", warmup=0, out_root=tmp_path, echo=lambda line: None, overrides={"k": 2})
    assert steps.read_text() == "x"  # other parameters: begun again


def test_a_forked_run_longer_than_the_limit_goes_on_while_it_writes_and_a_silent_one_is_stopped(
    tmp_path, monkeypatch
):
    """A search of hours runs in a forked child: its length is no sign of a hang, its silence is."""
    from bench.perf import harness

    monkeypatch.setattr(harness, "FORKED_LIMIT", 2.0)
    monkeypatch.setattr(harness, "PROGRESS_POLL", 0.1)

    def writing(out):
        out.mkdir(parents=True, exist_ok=True)
        for step in range(12):  # 3 s in all, well past the limit, a write every 0.25 s
            (out / f"trial-{step}").write_text("done")
            time.sleep(0.25)

    def silent(out):
        time.sleep(30)

    def build(parameters, root):
        job = writing if parameters["job"] == "writing" else silent
        return [Group([Job(parameters["job"], job)], rounds=1, warmup=0, fork=True, resumes=True)]

    toy = Workload("toy", "a toy", {"quick": {"rounds": 1, "job": "writing"}, "full": {"rounds": 1}}, build)
    result = run_workload(toy, "quick", warmup=0, out_root=tmp_path, echo=lambda line: None)
    assert result["rows"][0]["seconds"] > 2.5
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="nothing written"):
        run_workload(
            toy, "quick", warmup=0, out_root=tmp_path, echo=lambda line: None, overrides={"job": "silent"}
        )
    assert time.monotonic() - started < 15


def test_a_command_ends_when_its_harness_is_killed(tmp_path):
    """A merge the harness started must not outlive it (it would write into a later run's folder)."""
    pid_file = tmp_path / "child.pid"
    child_code = tmp_path / "child.py"
    child_code.write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    script = (
        f"import sys; from bench.perf.harness import command; command([sys.executable, {str(child_code)!r}])"
    )
    harness = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd())
    for _ in range(400):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    harness.kill()
    harness.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, 9)
    pytest.fail("the command outlived its harness")


def test_a_merge_in_a_fresh_interpreter_reports_its_memory_and_a_discarded_output_is_gone(tmp_path):
    """``child_job`` (GPU merges, the depth rows): the merge's own process, its peaks sampled from
    outside; ``discard``: the run's output deleted once measured (an 8B output would fill the disk)."""
    from bench.common import ensure_llama_family
    from bench.perf.merges import child_job, recipe

    family = ensure_llama_family(tmp_path / "models", 32, 64, 1, 2, heads=4, kv_heads=2)
    job = Job("bmm in a fresh interpreter", child_job(recipe(family, "bmm", "task_arithmetic"), "cpu"))
    toy = Workload("toy", "a toy", {"quick": {"rounds": 1}, "full": {"rounds": 1}},
                   lambda p, r: [Group([job], warmup=0, discard=True)])  # fmt: skip
    result = run_workload(toy, "quick", warmup=0, out_root=tmp_path / "run", echo=lambda line: None)
    row = result["rows"][0]
    assert row["private_mib"] > 50 and row["rss_mib"] >= row["private_mib"]  # the interpreter's own
    assert not (tmp_path / "run" / "out" / "group-0" / "0").exists()


# workloads another test already runs at their quick size, with the same settings (suite time)
RUN_ELSEWHERE = {
    "billion_merge": "bench/tests/test_gpu_check.py::test_gpu_check_billion_runs_the_billion_merge_workload",
}


@pytest.mark.parametrize("name", [name for name in workloads.names() if name not in RUN_ELSEWHERE])
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
    if name == "search_fidelity":  # both arms searched and tested; the staged one scored fewer examples
        arms = json.loads(Path(result["figures"]["arms"]).read_text())["arms"]
        assert arms["full"]["examples_scored_share"] == 1.0
        assert arms["cheap 0.25"]["examples_scored_share"] < 1.0
        assert len(arms["full"]["cpu_by_position"]) == 1  # three trials: one step of ten
        assert Path(result["figures"]["picture"]).is_file()
