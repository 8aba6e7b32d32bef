"""Parallel searches on local worker processes: batches, lost workers, trials past their limit."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from parallel_helpers import by_point, make_family, search, serial_search

from mergekit_bmm.search.log import read_trials

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("parallel"))


@pytest.fixture(scope="module")
def serial(family, tmp_path_factory):
    """The serial random search every parallel one is compared with (run once per module)."""
    return serial_search(family, tmp_path_factory.mktemp("serial"))


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
