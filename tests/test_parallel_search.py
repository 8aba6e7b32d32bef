"""Parallel searches: local worker processes and a real Ray cluster, batches, lost workers, resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mergekit_bmm.search import SearchOptions, parse_search_config, run_search
from mergekit_bmm.search.log import read_trials

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("parallel"), "llama", n_experts=3, hidden=16, layers=2)


def config_dict(
    family, function: str = "per_task_scores", workers: int = 2, backend: str = "local", **fields
):
    return {
        "recipe": {
            "merge_method": "bmm",
            "base_model": str(family.base),
            "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
            "parameters": {"anchor_method": "task_arithmetic"},
            "dtype": "float32",
        },
        "blocks": 1,
        "evaluator": {
            "type": "python",
            "callable": f"search_objectives:{function}",
            "python_path": [str(TESTS)],
            "args": fields.pop("args", {}),
        },
        "parallel": {"workers": workers, "backend": backend},
        **fields,
    }


def search(family, out: Path, **fields):
    config = parse_search_config(config_dict(family, **fields), TESTS)
    return run_search(config, out, SearchOptions(progress=False, device="cpu", plots=False, skip_best=True))


@pytest.fixture(scope="module")
def serial(family, tmp_path_factory):
    """The serial random search every parallel one is compared with (run once per module)."""
    return search(family, tmp_path_factory.mktemp("serial"), strategy="random", budget=6, workers=1)


def by_point(records):
    return {json.dumps(r.values, sort_keys=True): r.per_task for r in records}


def test_local_workers_score_points_as_the_serial_search_does(family, tmp_path, serial):
    """random proposes the same points whatever the batch size: the scores must match one for one."""
    parallel = search(family, tmp_path / "parallel", strategy="random", budget=6)
    assert [r.values for r in parallel.records] == [r.values for r in serial.records]
    assert by_point(parallel.records) == by_point(serial.records)
    assert {r.worker for r in parallel.records} == {"w0", "w1"}
    assert {r.batch_size for r in parallel.records} == {2} and parallel.summary.workers == 2
    assert parallel.summary.trials == "memory"


def test_batched_bo_is_reproducible_and_resumes_an_open_batch(family, tmp_path):
    """Constant-liar batches are told in trial order: the same seed gives the same points, whatever
    order trials finish in; a batch cut short (a trial in flight when the run died) is completed."""
    # two batches of two: the random start, then one constant-liar batch. The copy of the first
    # run, its last batch left open, is resumed: a new batch is proposed from the same seed and log.
    first = search(family, tmp_path / "a", strategy="bo", budget=4, n_initial=2)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    log = tmp_path / "b" / "trials.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    dropped = next(line for line in lines if json.loads(line).get("trial") == 2)
    log.write_text("".join(line for line in lines if line is not dropped))  # trial 2 "was in flight"
    resumed = search(family, tmp_path / "b", strategy="bo", budget=4, n_initial=2)
    records, _ = read_trials(log)
    assert [r.trial for r in records] == list(range(4))
    assert [r.values for r in records] == [r.values for r in first.records]
    assert [r.per_task for r in records] == [r.per_task for r in first.records]
    assert resumed.replayed == 2


def test_a_killed_local_worker_loses_no_trial(family, tmp_path, serial):
    marker = tmp_path / "killed"
    search(
        family, tmp_path / "out", strategy="random", budget=6, function="kills_its_worker_once",
        args={"marker": str(marker)},
    )  # fmt: skip
    assert marker.exists()  # a worker really died mid-trial
    records, _ = read_trials(tmp_path / "out" / "trials.jsonl")
    assert [r.trial for r in records] == list(range(6)) and all(r.ok for r in records)
    assert [r.per_task for r in records] == [r.per_task for r in serial.records]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_trial_past_its_time_limit_fails_and_the_search_goes_on(family, tmp_path, workers):
    """One evaluation hangs: it is stopped at its limit (its worker killed and restarted, or, in a
    serial search, interrupted), recorded failed with the reason, and the search finishes its budget."""
    marker = tmp_path / "hung"
    started = time.perf_counter()
    result = search(
        family, tmp_path / "out", strategy="random", budget=4, workers=workers, trial_timeout=3,
        function="hangs_once", args={"marker": str(marker), "seconds": 120},
    )  # fmt: skip
    assert time.perf_counter() - started < 100  # nobody waited for the 120 s hang
    records, _ = read_trials(tmp_path / "out" / "trials.jsonl")
    assert [r.trial for r in records] == list(range(4))
    failed = [r for r in records if not r.ok]
    assert len(failed) == 1 and failed[0].error.startswith("timeout: the trial ran past its limit of 3 s")
    assert all(r.ok for r in records if r is not failed[0])
    assert result.summary.status == "finished" and result.summary.failed_trials == 1


def _start_driver(search_file: Path, out: Path, sigint: str) -> subprocess.Popen:
    """The search command as a child process. ``sigint`` is what the child starts with:
    ``default`` (what a terminal's Ctrl-C reaches, whatever the test runner inherited: a runner
    started in the background of a non-interactive shell ignores SIGINT and would pass that on)
    or ``ignored`` (a background job's)."""
    handler = signal.SIG_DFL if sigint == "default" else signal.SIG_IGN
    return subprocess.Popen(
        [str(BIN / "mergekit-bmm-search"), str(search_file), str(out), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, handler),
    )


@pytest.mark.parametrize(("sigint", "stop"), [("default", signal.SIGINT), ("ignored", signal.SIGTERM)])
def test_ctrl_c_stops_the_search_and_its_workers(family, tmp_path, sigint, stop):
    """Ctrl-C stops a search and its workers; a search that ignores SIGINT (a background job)
    stops the same way on SIGTERM. Holds however the test runner itself was started."""
    search_file = tmp_path / "search.yml"
    raw = config_dict(family, "sleeps", strategy="random", budget=8, args={"seconds": 30})
    search_file.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    driver = _start_driver(search_file, out, sigint)
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "trials" / "trial-0001.yml").exists():
        time.sleep(0.5)
    assert (out / "trials" / "trial-0001.yml").exists(), driver.stderr.read() if driver.poll() else ""
    workers = _worker_pids(driver.pid)
    assert len(workers) == 2
    driver.send_signal(stop)
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode == 130, stderr[-2000:]
    assert "Run the same command again to resume" in stderr
    time.sleep(1)
    assert not (set(_worker_pids()) & set(workers))  # any left, whoever their parent now is
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


def _worker_pids(ancestor: int | None = None) -> list[int]:
    """Search worker processes on this machine; with ``ancestor``, only those it started (other
    searches may be running beside the tests)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "mergekit_bmm.search.workers import main" in command:
                if ancestor is None or ancestor in _ancestors(int(entry.name)):
                    pids.append(int(entry.name))
    return pids


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            stat = (Path("/proc") / str(pid) / "stat").read_text()
        except OSError:
            break
        pid = int(stat.rpartition(")")[2].split()[1])
        chain.append(pid)
    return chain


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_actors_score_points_as_the_serial_search_does_and_survive_a_kill(
    family, tmp_path, ray_cluster, serial
):
    marker = tmp_path / "killed"
    result = search(
        family, tmp_path / "ray", strategy="random", budget=6, backend="ray",
        function="kills_its_worker_once", args={"marker": str(marker)},
    )  # fmt: skip
    assert marker.exists()  # an actor's process really died mid-trial
    records, _ = read_trials(tmp_path / "ray" / "trials.jsonl")
    assert [r.trial for r in records] == list(range(6)) and all(r.ok for r in records)
    assert {r.worker for r in records} == {"a0", "a1"} and result.summary.workers == 2
    assert [r.values for r in records] == [r.values for r in serial.records]
    assert [r.per_task for r in records] == [r.per_task for r in serial.records]


def test_a_ray_trial_past_its_time_limit_fails_and_its_actor_is_replaced(family, tmp_path, ray_cluster):
    marker = tmp_path / "hung"
    result = search(
        family, tmp_path / "ray", strategy="random", budget=3, backend="ray", trial_timeout=3,
        function="hangs_once", args={"marker": str(marker), "seconds": 120},
    )  # fmt: skip
    records, _ = read_trials(tmp_path / "ray" / "trials.jsonl")
    assert [r.trial for r in records] == list(range(3))
    failed = [r for r in records if not r.ok]
    assert len(failed) == 1 and failed[0].error.startswith("timeout: the trial ran past its limit of 3 s")
    assert result.summary.status == "finished"
