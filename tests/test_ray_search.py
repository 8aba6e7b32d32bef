"""Parallel searches on a real Ray cluster: actors score what the serial search scores, survive a kill,
and a trial past its limit replaces its actor."""

from __future__ import annotations

import os

import pytest
from parallel_helpers import make_family, search, serial_search

from mergekit_bmm.search.log import read_trials

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("parallel"))


@pytest.fixture(scope="module")
def serial(family, tmp_path_factory):
    """The serial random search every parallel one is compared with (run once per module)."""
    return serial_search(family, tmp_path_factory.mktemp("serial"))


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
