"""The benchmark's clocks: a stage's time survives a killed run, a resumed search counts its runs."""

from __future__ import annotations

import json
import time

from bench.merging import stage_clock
from bench.merging.searches import search_seconds
from bench.merging.stage_clock import StageClock


def test_a_running_stage_writes_its_time_as_it_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(stage_clock, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(stage_clock, "REPLAY_SECONDS", 0.1)
    clock = StageClock(tmp_path)
    with clock.stage("bmm"):
        time.sleep(0.4)
        # what a run killed now would leave behind: the time so far, one invocation
        written = json.loads((tmp_path / "stage_seconds.json").read_text())["bmm"]
        assert written["invocations"] == 1 and written["seconds"] >= 0.1
    with clock.stage("bmm"):
        time.sleep(0.2)
    final = StageClock(tmp_path).table()["bmm"]
    assert final["invocations"] == 2 and final["seconds"] >= 0.6
    with clock.stage("replayed"):  # a cached replay is not counted
        pass
    assert "replayed" not in StageClock(tmp_path).table()


def test_records_raise_a_stage_that_a_killed_run_undercounted(tmp_path):
    clock = StageClock(tmp_path)
    clock.entries["bmm"] = {"seconds": 100.0, "invocations": 2}
    clock.at_least("bmm", 900.0)
    clock.at_least("bmm", 50.0)  # never lowers it
    assert StageClock(tmp_path).table()["bmm"] == {"seconds": 900.0, "invocations": 2, "from_records": True}


def test_a_resumed_search_counts_the_time_of_every_run():
    def trial(elapsed, at):
        return {"time": {"elapsed": elapsed}, "finished_at": at}

    first_run = [trial(10.0, "2026-01-01T00:00:10"), trial(20.0, "2026-01-01T00:00:20")]
    second_run = [trial(5.0, "2026-01-02T00:00:05"), trial(12.0, "2026-01-02T00:00:12")]
    assert search_seconds(first_run + second_run) == 32.0
    assert search_seconds([]) == 0.0
