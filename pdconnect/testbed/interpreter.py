"""Hold this process's interpreter lock for a while: the worst a busy engine thread can do to its neighbours.

A thread that runs Python gives the lock up every switch interval; one inside a long C
call does not give it up at all, so every other thread of the process that needs the
lock (a side-channel server, a transport's poller) waits for the call to end. The tests
use this to show which of our threads depend on an engine process's lock and which do
not.
"""

from __future__ import annotations

import time

__all__ = ["hold_the_interpreter_lock"]

_CALIBRATION_ITEMS = 2_000_000
_CALIBRATIONS = 5


def hold_the_interpreter_lock(seconds: float) -> float:
    """Keep the lock for at least about `seconds` in one C call; the seconds it was really held.

    The call is the builtin `sum` over a range, which never checks for a request to drop
    the lock. It is sized for this machine by timing short sums first: a fixed count ran
    for 2 s on one machine and under 0.8 s on another. The fastest of several timings is
    the one used: a timing stretched by the process being descheduled (a loaded machine)
    would size the call too short, and the tests that use it need the lock held at least
    as long as they asked (one failed that way under load). Descheduled during the call
    itself, it only holds longer.
    """
    per_item = min(_time_per_item() for _ in range(_CALIBRATIONS))
    # The timings kept other threads from the lock: let them catch up first, so the hold
    # starts from a quiet process (a watcher caught mid-sample would not see it start).
    time.sleep(0.1)
    started = time.perf_counter()
    sum(range(int(seconds / per_item)))
    return time.perf_counter() - started


def _time_per_item() -> float:
    started = time.perf_counter()
    sum(range(_CALIBRATION_ITEMS))
    return (time.perf_counter() - started) / _CALIBRATION_ITEMS
