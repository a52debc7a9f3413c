"""Stall watch: which threads of a process used the seconds its Python stopped running.

A prefill engine that stops answering its side channel for seconds leaves two questions:
was it kept from running (no CPU, the process stopped), or did one of its threads keep
the interpreter lock or the CPU, and which? A watcher thread wakes every `seconds / 4`;
when it wakes `seconds` late it writes how late, and for each thread of the process (read
from `/proc/self/task`) the seconds it spent on a CPU and runnable but waiting for one
over the stall, its state and the kernel function it waits in, then every Python
thread's stack as the stall ends: a thread that burned the stall's seconds kept the lock
or the CPU; threads that waited for a CPU were starved by other processes; if none did
either, the process was stopped or blocked.

Stacks are taken once the watcher runs again, with the interpreter lock held, so they
show where each thread is as the stall ends. Stacks taken during the stall would need
`faulthandler`'s timer, which reads running threads' frames without the lock: a prefill
process being stepped died in the middle of such a dump, so the watch does not use it.

It is a diagnostic for operators and the test rig, off unless started, one per process
(`start_stall_watch` is a no-op when one runs). `STALL_WATCH_ENV` names the variable that
turns it on (its value: the seconds) for every process that calls
`start_from_environment`, which our vLLM plugin does in each process vLLM starts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

__all__ = ["STALL_WATCH_ENV", "StallWatch", "records_in", "start_from_environment", "start_stall_watch"]

STALL_WATCH_ENV = "PDCONNECT_STALL_WATCH_SECONDS"
THREAD_NAME = "pdconnect-stallwatch"
# How each record the watch writes begins.
_RECORD_START = "stall watch:"


@dataclass(frozen=True)
class ThreadSample:
    """One thread as /proc/self/task has it: seconds on a CPU and seconds runnable but
    waiting for one (schedstat), its state and the kernel function it waits in."""

    tid: int
    cpu_seconds: float
    waiting_seconds: float
    state: str
    wchan: str


def sample_threads(task_dir: str = "/proc/self/task") -> dict[int, ThreadSample]:
    """Every thread of this process, by kernel thread id; empty where /proc is not there."""
    samples: dict[int, ThreadSample] = {}
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return samples
    for name in tids:
        try:
            with open(f"{task_dir}/{name}/stat") as stat:
                # The command may hold spaces and parentheses: the fields follow the last ')'.
                state = stat.read().rsplit(")", 1)[1].split()[0]
            with open(f"{task_dir}/{name}/schedstat") as schedstat:
                on_cpu, waiting = (int(field) / 1e9 for field in schedstat.read().split()[:2])
            with open(f"{task_dir}/{name}/wchan") as wchan:
                waits_in = wchan.read().strip() or "-"
        except (OSError, IndexError, ValueError):
            continue  # the thread ended while we read
        samples[int(name)] = ThreadSample(int(name), on_cpu, waiting, state, waits_in)
    return samples


class StallWatch:
    """Watches this process for stalls of `seconds` or more and writes what its threads did.

    Invariant: while the watch runs, a stall of `seconds` leaves one record in `file` once
    Python runs again: the stall's length, every thread's CPU and run-queue seconds over
    it, and every Python thread's stack. Each stall is counted in `stalls`.
    """

    def __init__(self, seconds: float, file: TextIO = sys.stderr, clock: Callable[[], float] = time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError(f"a stall watch needs seconds > 0, got {seconds}")
        self.seconds = seconds
        self.stalls = 0
        self._file, self._clock = file, clock
        self._tick = seconds / 4
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=THREAD_NAME, daemon=True)

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.seconds)

    def _watch(self) -> None:
        before = sample_threads()
        woke_at = self._clock()
        while not self._stop.wait(self._tick):
            now = self._clock()
            after = sample_threads()
            if (gap := now - woke_at) >= self.seconds:
                self.stalls += 1
                self._report(gap, before, after)
            # From after the sampling: slow /proc reads are not a stall of the process.
            before, woke_at = after, self._clock()

    def _report(self, gap: float, before: dict[int, ThreadSample], after: dict[int, ThreadSample]) -> None:
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        heading = "seconds on a CPU and seconds runnable but waiting for one"
        lines = [f"{_RECORD_START} pid {os.getpid()} ran no Python for {gap:.1f} s; per thread over it, {heading}:"]
        used = {tid: _delta(before, sample) for tid, sample in after.items()}
        for tid in sorted(used, key=lambda tid: used[tid], reverse=True):
            sample, (on_cpu, waiting) = after[tid], used[tid]
            name = names.get(tid, "(not a Python thread)")
            lines.append(
                f"  tid {tid} {name}: {on_cpu:.2f} s on CPU, {waiting:.2f} s waiting, "
                f"now {sample.state} in {sample.wchan}"
            )
        frames = sys._current_frames()
        for thread in threading.enumerate():
            if thread.ident in frames and thread is not threading.current_thread():
                lines.append(f"  stack of {thread.name} as the stall ends:")
                lines.extend(
                    f"    {line}"
                    for entry in traceback.format_stack(frames[thread.ident])
                    for line in entry.rstrip().splitlines()
                )
        with contextlib.suppress(ValueError, OSError):  # the file closed under us: `stalls` still counts it
            print("\n".join(lines), file=self._file, flush=True)


def _delta(before: dict[int, ThreadSample], after: ThreadSample) -> tuple[float, float]:
    """Seconds on a CPU and seconds waiting for one since `before` (since its start if new)."""
    earlier = before.get(after.tid)
    if earlier is None:
        return after.cpu_seconds, after.waiting_seconds
    return after.cpu_seconds - earlier.cpu_seconds, after.waiting_seconds - earlier.waiting_seconds


def start_stall_watch(seconds: float, file: TextIO = sys.stderr) -> StallWatch | None:
    """Start this process's one watch; None if one already runs."""
    if any(thread.name == THREAD_NAME for thread in threading.enumerate()):
        return None
    return StallWatch(seconds, file).start()


def start_from_environment() -> StallWatch | None:
    """Start a watch if `STALL_WATCH_ENV` holds a positive number of seconds; warn on a bad value."""
    value = os.environ.get(STALL_WATCH_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
        if not seconds > 0:
            raise ValueError(value)
    except ValueError:
        print(
            f"stall watch: {STALL_WATCH_ENV}={value!r} is not a positive number of seconds; not watching",
            file=sys.stderr,
        )
        return None
    return start_stall_watch(seconds)


def records_in(log: str) -> list[str]:
    """The lines of every stall record in a process's log, in order, other lines left out.

    A record is a "stall watch:" line and the indented lines after it.
    """
    kept: list[str] = []
    inside = False
    for line in log.splitlines():
        if line.startswith(_RECORD_START):
            inside = True
        elif inside:
            inside = line.startswith(" ")
        if inside:
            kept.append(line)
    return kept
