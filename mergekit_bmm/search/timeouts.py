"""How long a trial may run before it is stopped, and stopping it in this process.

A trial that never returns (a stuck lm-eval request, a deadlocked evaluator) must not stall
the search. ``trial_timeout`` in search.yml is a number of seconds, ``null`` (no limit) or
``auto`` (the default): no limit until a trial has succeeded, then ``AUTO_FACTOR`` × the
slowest successful trial so far, at least ``AUTO_FLOOR_SECONDS``. A trial past its limit is
recorded as failed with the reason; a worker process running it is killed and restarted;
the search goes on.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

AUTO_FACTOR = 10.0
AUTO_FLOOR_SECONDS = 300.0


def time_left(started_and_limits: Iterable[tuple[float, float | None]]) -> float | None:
    """Seconds until the first running trial reaches its limit, from each trial's start
    (``time.perf_counter``) and limit; None when none has a limit (a pool's wait timeout)."""
    now = time.perf_counter()
    left = [started + limit - now for started, limit in started_and_limits if limit]
    return max(0.0, min(left)) if left else None


class TrialTimeout(BaseException):
    """Raised in the search's own process when a trial runs past its limit (a BaseException,
    so an evaluator's ``except Exception`` cannot swallow it)."""


def trial_limit(setting: float | str | None, records: Sequence[Any]) -> float | None:
    """The limit, in seconds, for the next trials given ``trial_timeout`` and the trials so far."""
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    times = [record.time.get("total", 0.0) for record in records if record.ok]
    if not times:
        return None
    return max(AUTO_FLOOR_SECONDS, AUTO_FACTOR * max(times))


def timeout_error(limit: float, restarted: bool) -> str:
    """The one-line reason a trial past its limit is recorded with."""
    what = "its worker was stopped and restarted" if restarted else "it was interrupted"
    return f"timeout: the trial ran past its limit of {limit:.0f} s ({what}); set trial_timeout in search.yml"


@contextmanager
def alarm(seconds: float | None) -> Iterator[None]:
    """Raise :class:`TrialTimeout` in this (main) thread after ``seconds``; no-op elsewhere."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TrialTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
