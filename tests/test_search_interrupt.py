"""Ctrl-C and SIGTERM stop a parallel search and its local workers, and it can be resumed."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from parallel_helpers import BIN, config_dict, make_family

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("parallel"))


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
