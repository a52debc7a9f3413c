"""Start, health-check and reliably stop real local processes (vLLM servers, our router).

A `Cluster` owns every process it starts: each runs in its own process group with its
own log file, and the whole group is terminated when the cluster closes — on normal
exit, on an exception, on Ctrl-C, on SIGTERM to the owner, and (as a backstop) at
interpreter exit. A vLLM server is several processes (API server, engine core, its
workers); killing the group rather than the leader is what leaves nothing behind.

What to start is described by a `ProcessSpec`; the recipes for vLLM servers and our
router are in `pdconnect.testbed.recipes`. This module imports neither vLLM nor torch:
servers are started as separate interpreters.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Self

import httpx

from pdconnect.bench.scrape import engine_client
from pdconnect.testbed.paths import default_build_dir

__all__ = [
    "Cluster",
    "ManagedProcess",
    "ProcessSpec",
    "StartupError",
    "free_port",
    "freeze",
    "freeze_group",
    "thaw_group",
]

_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A process exited or never became healthy; the message ends with its log tail."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(exclude: Iterable[int] = ()) -> int:
    """A TCP port free right now on 127.0.0.1, not in `exclude`.

    The port is released before the caller binds it, so another program could take it
    in between; random probing (rather than asking the kernel for port 0 each time)
    keeps ports handed out by one cluster apart even before their servers bind. Ports
    come from below the kernel's ephemeral range, which every bind to port 0 and every
    outgoing connection draws from (an engine's KV-event port was once taken that way
    during its start-up).
    """
    taken = set(exclude)
    low = _ephemeral_low()
    first, last = (max(1024, low - 12000), low - 1) if low > 2048 else (20000, 60000)
    for _ in range(200):
        port = random.randint(first, last)
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port found")


@dataclass(frozen=True)
class ProcessSpec:
    """How to start one process and how to know it is ready.

    `env` is laid over the owner's environment. `health_url` is polled until it answers
    200; without one the process counts as ready once started.
    """

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    health_url: str | None = None
    # Where clients talk to it (e.g. "http://127.0.0.1:8123"); informational.
    base_url: str | None = None
    startup_timeout_s: float = 300.0
    cwd: Path | None = None


@dataclass
class ManagedProcess:
    """A started process: its spec, handle and log file."""

    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def base_url(self) -> str:
        if self.spec.base_url is None:
            raise ValueError(f"{self.name} has no base_url")
        return self.spec.base_url

    def is_running(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        """Everything the process has written so far (stdout and stderr together)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<cannot read {self.log_path}: {exc}>"

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class Cluster:
    """Starts processes and guarantees they are all stopped when it closes.

    Invariant: every process started through `start` is in `self._procs` until it has
    been stopped, and `close` stops every one of them (process group, TERM then KILL)
    even if stopping another failed. Use it as a context manager.
    """

    def __init__(
        self,
        log_dir: Path | None = None,
        *,
        stop_timeout_s: float = 20.0,
        progress: IO[str] | None = None,
    ) -> None:
        self.log_dir = log_dir if log_dir is not None else default_build_dir() / "logs"
        self.stop_timeout_s = stop_timeout_s
        self._progress = progress if progress is not None else sys.stderr
        self._procs: list[ManagedProcess] = []
        self._ports: set[int] = set()
        self._lock = threading.Lock()
        self._previous_sigterm: Any = None
        atexit.register(self.close)

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Self:
        # SIGTERM would otherwise kill the owner without unwinding, leaving servers
        # behind; turning it into SystemExit runs __exit__. Only the main thread may
        # install handlers, and a handler someone else installed is left alone.
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGTERM)
            if current in (signal.SIG_DFL, None):
                self._previous_sigterm = current
                signal.signal(signal.SIGTERM, _raise_system_exit)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process still owned; idempotent."""
        with self._lock:
            procs, self._procs = self._procs, []
        _stop_groups(procs, self.stop_timeout_s)
        if self._previous_sigterm is not None:
            with contextlib.suppress(ValueError):  # not on the main thread any more
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        atexit.unregister(self.close)

    # -- starting --------------------------------------------------------------------

    def free_port(self) -> int:
        """A free port not yet handed out by this cluster."""
        with self._lock:
            port = free_port(self._ports)
            self._ports.add(port)
            return port

    def start(self, spec: ProcessSpec) -> ManagedProcess:
        """Start `spec` in a new process group, stdout+stderr into its own log file."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_path = self.log_dir / f"{spec.name}-{stamp}-{os.getpid()}.log"
        env = {**os.environ, **spec.env}
        with open(log_path, "wb") as log:
            log.write(f"$ {' '.join(spec.argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.cwd,
                # A process group of its own (killed whole, see `_stop_groups`) but this
                # session: a session is a scheduling group (autogroup), and with every engine
                # in a group of its own, one engine's busy-wait loops kept both cores for
                # minutes while another's runnable threads waited (measured: a stock NIXL
                # prefill engine held the cores for 196 s and its decode request timed out;
                # docs/transfer-under-contention.md). In one group they yield to each other.
                process_group=0,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - one prctl(), no lock taken
            )
        proc = ManagedProcess(spec, popen, log_path, time.monotonic())
        with self._lock:
            self._procs.append(proc)
        return proc

    def wait_healthy(self, procs: Sequence[ManagedProcess]) -> None:
        """Block until every process answers its health URL, showing progress.

        Raises StartupError (with the log tail) when one exits or runs past its
        `startup_timeout_s`; the cluster still owns and will stop all of them.
        """
        pending = [p for p in procs if p.spec.health_url is not None]
        last_report = 0.0
        with engine_client(2.0) as client:
            while pending:
                for proc in list(pending):
                    elapsed = time.monotonic() - proc.started_at
                    if not proc.is_running():
                        raise StartupError(
                            f"{proc.name} exited with {proc.popen.returncode} after "
                            f"{elapsed:.0f}s; log {proc.log_path}:\n{proc.log_tail()}"
                        )
                    if elapsed > proc.spec.startup_timeout_s:
                        raise StartupError(
                            f"{proc.name} not healthy after {elapsed:.0f}s; log {proc.log_path}:\n{proc.log_tail()}"
                        )
                    if _answers(client, proc.spec.health_url):
                        pending.remove(proc)
                        self._report(f"{proc.name} healthy after {elapsed:.1f}s", final=True)
                now = time.monotonic()
                if pending and now - last_report >= self._report_interval():
                    last_report = now
                    self._report("waiting for " + ", ".join(f"{p.name} {now - p.started_at:.0f}s" for p in pending))
                if pending:
                    time.sleep(0.5)

    def launch(self, *specs: ProcessSpec) -> list[ManagedProcess]:
        """Start all `specs` at once (they boot in parallel), then wait for all."""
        procs = [self.start(spec) for spec in specs]
        self.wait_healthy(procs)
        return procs

    def stop(self, *procs: ManagedProcess) -> None:
        """Stop process groups early (e.g. to restart engines cold), all in one timeout."""
        with self._lock:
            for proc in procs:
                if proc in self._procs:
                    self._procs.remove(proc)
        _stop_groups(procs, self.stop_timeout_s)

    def kill(self, proc: ManagedProcess) -> None:
        """SIGKILL a process group at once, no TERM first (fault tests: a crash, not a
        shutdown), and wait until the group is gone so its ports are free again."""
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)
        _signal_group(proc.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5.0)
        _wait_group_gone(proc.popen.pid, timeout_s=10.0)

    @property
    def processes(self) -> tuple[ManagedProcess, ...]:
        return tuple(self._procs)

    # -- progress display --------------------------------------------------------------

    def _report_interval(self) -> float:
        # A terminal gets a live line; logs and CI get one line every 15 s.
        return 1.0 if self._progress.isatty() else 15.0

    def _report(self, message: str, *, final: bool = False) -> None:
        if self._progress.isatty():
            end = "\n" if final else ""
            self._progress.write(f"\r\033[K[cluster] {message}{end}")
        else:
            self._progress.write(f"[cluster] {message}\n")
        self._progress.flush()


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the owner dies without cleanup
    (e.g. SIGKILL), the one case neither atexit nor __exit__ can cover."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_groups(procs: Sequence[ManagedProcess], timeout_s: float) -> None:
    """TERM every process group, give them `timeout_s` together, then KILL what is left.

    All groups are signalled before any is waited for, so N servers take one timeout,
    not N. Groups are KILLed even after their leader exited: vLLM's engine core may
    outlive its API server for a moment and would otherwise be orphaned.
    """
    for proc in procs:
        # process_group=0 made each child the leader of a group with its own pid.
        _signal_group(proc.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_group(proc.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5.0)
        # Signals are delivered asynchronously: wait until the group is really empty,
        # so a caller may rely on ports and memory being free once this returns.
        _wait_group_gone(proc.popen.pid, timeout_s=5.0)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_has_live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_has_live_members(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies do not count).

    `killpg(pgid, 0)` is not enough: orphaned members become zombies that this
    container's init reaps only after a second or two.
    """
    if not Path("/proc").is_dir():  # not Linux: fall back to the signal probe
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return any(state not in ("Z", "X") for state in _group_states(pgid).values())


def _group_states(pgid: int) -> dict[int, str]:
    """The state letter of each process of group `pgid`, by pid (zombies included)."""
    states = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                states[int(stat_path.parent.name)] = fields[0]
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
    return states


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _answers(client: httpx.Client, url: str | None) -> bool:
    if url is None:
        return True
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP a process and return once every thread of it has really stopped.

    A signal is delivered asynchronously: on a loaded host a process was seen to serve
    several more requests after `kill` returned, which makes a test race its own setup.
    `/proc/<pid>/task/*/stat` says when each thread is stopped (state T).
    """
    os.kill(pid, signal.SIGSTOP)
    _wait_stopped(lambda: [pid], f"process {pid}", timeout)


def freeze_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGSTOP every process of group `pgid` (a vLLM server: API server, engine core,
    workers, the lease desk) and return once every thread of each has really stopped.
    SIGCONT the group (`thaw_group`) or SIGKILL it to end the freeze."""
    _signal_group(pgid, signal.SIGSTOP)
    _wait_stopped(lambda: _group_states(pgid), f"process group {pgid}", timeout)


def thaw_group(pgid: int) -> None:
    """SIGCONT every process of group `pgid`: a frozen group runs on where it stopped."""
    _signal_group(pgid, signal.SIGCONT)


def _wait_stopped(pids: Callable[[], Iterable[int]], what: str, timeout: float) -> None:
    give_up = time.monotonic() + timeout
    while True:
        states = []
        for pid in pids():
            with contextlib.suppress(FileNotFoundError):  # a process that ended meanwhile
                for task in Path(f"/proc/{pid}/task").iterdir():
                    with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                        states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t", "Z", "X") for state in states):
            return
        if time.monotonic() >= give_up:
            raise TimeoutError(f"{what} did not stop within {timeout:.0f} s")
        time.sleep(0.01)
