"""The stall watch names what a stalled process's threads did: real stalls of real processes.

Two kinds of stall a prefill engine can have: one thread keeps the interpreter lock in a
long C call (here: the builtin sum over a range, a C loop that never gives the lock up),
or the whole process is kept from running (here: SIGSTOP). The watch must tell them apart
from its own output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from pdconnect.stallwatch import STALL_WATCH_ENV, StallWatch, records_in, sample_threads, start_from_environment

WAIT_S = 60.0  # bound on every wait for the child; none is a performance claim

_CHILD = r"""
import sys, time
from pdconnect.stallwatch import start_from_environment
from pdconnect.testbed.interpreter import hold_the_interpreter_lock

watch = start_from_environment()
assert watch is not None
time.sleep(0.5)
print("ready", flush=True)
if sys.argv[1] == "hold":
    print(f"held {hold_the_interpreter_lock(2.5):.2f}", flush=True)
else:
    sys.stdin.readline()  # the test stops us meanwhile
time.sleep(0.5)
print(f"stalls {watch.stalls}", flush=True)
"""


def _child(mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, STALL_WATCH_ENV: "0.8"}
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_a_thread_keeping_the_interpreter_lock_is_the_one_that_used_the_stall() -> None:
    child = _child("hold")
    out, err = child.communicate(timeout=WAIT_S)
    assert child.returncode == 0, err
    held = re.search(r"held (\d+\.\d+)", out)
    assert held is not None and float(held.group(1)) >= 1.2, out  # the stall the test means to make
    assert "stalls 1" in out, err
    report = re.search(r"ran no Python for (\d+\.\d) s", err)
    assert report is not None and float(report.group(1)) >= 0.8, err
    main = re.search(r"tid \d+ MainThread: (\d+\.\d+) s on CPU", err)
    assert main is not None and float(main.group(1)) >= 0.5, err  # it burned the stall's seconds
    # What a failed test's report carries of this log: the record, and nothing else.
    records = records_in("engine says hello\n" + err + "engine says goodbye\n")
    assert records[0].startswith("stall watch: pid") and "  stack of pdconnect-stallwatch" not in records
    assert any(line.startswith("  stack of MainThread") for line in records)
    assert not any("engine says" in line for line in records)


def test_a_stopped_process_is_reported_with_no_thread_busy() -> None:
    child = _child("stop")
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    os.kill(child.pid, signal.SIGSTOP)
    time.sleep(2.0)
    os.kill(child.pid, signal.SIGCONT)
    out, err = child.communicate("go\n", timeout=WAIT_S)
    assert child.returncode == 0, err
    assert "stalls 1" in out, err
    busy = [float(used) for used in re.findall(r"tid \d+ .*?: (\d+\.\d+) s on CPU", err)]
    assert busy and max(busy) < 0.5, err  # nobody ran: the process was kept from running


def test_an_idle_process_reports_nothing() -> None:
    watch = StallWatch(5.0).start()
    try:
        time.sleep(0.3)
        assert watch.stalls == 0
    finally:
        watch.close()


def test_threads_are_sampled_by_kernel_id() -> None:
    samples = sample_threads()
    assert os.getpid() in samples  # the main thread's tid is the pid
    assert samples[os.getpid()].cpu_seconds > 0


def test_a_bad_setting_starts_no_watch(monkeypatch) -> None:
    for value in ("", "0", "-1", "soon", "nan"):
        monkeypatch.setenv(STALL_WATCH_ENV, value)
        assert start_from_environment() is None
