"""Transport throughput: each library's bare API against our pull path, made fair.

For every transport, a spawned "prefill" process serves a registered pool of random
bytes and this process pulls the same block sets three ways, interleaved run by run
(in every order of the three in turn, so no path always inherits a warm or a busy
system):
- bare: the library called directly by a careful user, starting from the same block
  ids: descriptors computed with numpy (one per block, no merging), Mooncake
  `batch_transfer_sync_read` in an engine started under the same environment ours sets
  (raised TCP queue limits, the forced data path); NIXL `initialize_xfer` + `transfer` +
  `check_xfer_state` polled with the same 20 us -> 1 ms backoff as ours, on an agent
  without a progress thread (the public knob; the default is a busy loop that would
  burn a core while the other paths are timed);
- ours, unmerged: `kvlayout.pull_ranges(..., merged=False)` + `Transport.pull` +
  `Transfer.wait`, i.e. everything the connector pays, sending the same ranges as bare;
- ours: the same with merging, as the connector runs.
"fair" = ours unmerged / bare (our overhead alone; >= 0.9 is the bar); "merging"
= ours / ours unmerged (what merging adjacent ranges buys, reported on its own; the
merged ranges are also sorted by address, which Mooncake's TCP path likes). Both ratios
are medians over rounds of the ratio within a round, where the three paths ran back
to back: on a shared host the load drifts between rounds far more than within one, so
pairing cancels most of it; GB/s are per-path medians; "best" compares the fastest run
of each path.
CPU s/GB is the median over runs of (this process's + the peer process's CPU seconds)
per GB moved, from `time.process_time` on both sides (every thread: the libraries'
own threads count). Each path has its own client (our two paths two transports), all
living in this process for the whole run, so each path's CPU also holds the other
clients' idle threads (ours: a NIXL serving agent's progress thread, about 2% of a core
each).

A table "behind a busy caller" times our pulls the way a live engine sees them: the
caller runs Python for a step (`--step-ms`, holding the interpreter lock as an engine's
step loop does) between polls, polling once per step, against the same pull with an idle
caller (`Transfer.wait`'s backoff); 1.5 MiB split into 1, 8 and 48 ranges.

A further table (NIXL) sweeps the serving agent's progress-thread delay
(`nixl_progress_delay_us`): the serving process's idle CPU against our read rate and
the first read after connecting (which waits on the server's wire-up progress).

    python -m benchmarks.transfer_speed [--transport mooncake|nixl|all] [--repeats 24]
                                       [--step-ms 5] [--delays 0,50,200,1000,5000] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from pdconnect.kvlayout import TensorLayout, pull_ranges
from pdconnect.transfer import (
    TRANSPORT_KINDS,
    TransferState,
    Transport,
    create_transport,
    decode_metadata,
)
from pdconnect.transfer._host import scoped_env
from pdconnect.transfer.loopback import Buffer, LoopbackPeer, digest

POOL_BYTES = 256 << 20
PEER = "bench-prefill"
TIMEOUT = 60.0
PATHS = ("bare", "ours_unmerged", "ours")


@dataclass(frozen=True)
class Case:
    """One block set: `count` blocks of `block_bytes`, scattered or one contiguous run."""

    count: int
    block_bytes: int
    scattered: bool = True

    @property
    def name(self) -> str:
        size = f"{self.block_bytes >> 20} MiB" if self.block_bytes >= 1 << 20 else f"{self.block_bytes >> 10} KiB"
        return f"{self.count} x {size} {'scattered' if self.scattered else 'contiguous'}"

    @property
    def total_bytes(self) -> int:
        return self.count * self.block_bytes

    def block_pairs(self, pool_blocks: int, seed: int) -> list[tuple[int, int]]:
        """(local_block, remote_block) pairs, drawn from the whole pool when scattered."""
        if not self.scattered:
            return [(i, i) for i in range(self.count)]
        rng = random.Random(seed)
        return list(zip(rng.sample(range(pool_blocks), self.count), rng.sample(range(pool_blocks), self.count)))


CASES = (
    Case(64, 1 << 20),
    Case(1024, 64 << 10),
    Case(4096, 16 << 10),
    Case(4096, 16 << 10, scattered=False),
)


@dataclass(frozen=True)
class Result:
    """One row of the table (and of --json)."""

    transport: str
    effective_protocol: str
    case: str
    bytes: int
    bare_gbps: float
    ours_unmerged_gbps: float
    ours_gbps: float
    fair_ratio: float  # ours unmerged / bare: median of per-round ratios
    fair_best_ratio: float  # the same, fastest run of each
    merging_gain: float  # ours / ours unmerged: median of per-round ratios
    bare_cpu_s_per_gb: float
    ours_unmerged_cpu_s_per_gb: float
    ours_cpu_s_per_gb: float
    bare_descriptors: int
    ours_descriptors: int
    repeats: int


def kv_layout(base_addr: int, pool_bytes: int, block_bytes: int) -> TensorLayout:
    """The CPU backend's layout [blocks, 2 kv heads, tokens, 2*64 head dims], fp16."""
    tokens = block_bytes // (2 * 128 * 2)
    shape = (pool_bytes // block_bytes, 2, tokens, 128)
    return TensorLayout(base_addr, shape, (2 * tokens * 128, tokens * 128, 128, 1), 2, 0)


# --- the bare libraries ------------------------------------------------------------------


@dataclass
class Blocks:
    """What either client starts from: two pools' addresses, a block size, and the
    `(local, remote)` block ids as the Python list a scheduler hands over."""

    local_base: int
    remote_base: int
    block_bytes: int
    pairs: list[tuple[int, int]] = field(repr=False)

    def addresses(self) -> tuple[Any, Any]:
        """Per-block local and remote addresses, the vectorized way a careful user would."""
        ids = np.array(self.pairs, dtype=np.int64).reshape(-1, 2)
        return (self.local_base + ids[:, 0] * self.block_bytes, self.remote_base + ids[:, 1] * self.block_bytes)


class BareMooncake:
    """A second Mooncake engine in this process, started under our engine's environment."""

    def __init__(self, local: Buffer, peer_metadata: bytes, protocol: str) -> None:
        from mooncake.engine import TransferEngine

        from pdconnect.transfer.mooncake import engine_env

        self._engine = TransferEngine()
        # The same variables our transport sets (queue limits for thousands of
        # descriptors, the forced data path): only the API in front differs.
        with scoped_env(engine_env(protocol)):
            if self._engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
                raise RuntimeError("bare Mooncake engine did not initialize")
        if self._engine.register_memory(local.addr, local.size) != 0:
            raise RuntimeError("bare Mooncake engine did not register the pool")
        self._session = decode_metadata(peer_metadata).endpoint.decode()

    def read(self, blocks: Blocks) -> bool:
        local, remote = blocks.addresses()
        rc = self._engine.batch_transfer_sync_read(
            self._session, local.tolist(), remote.tolist(), [blocks.block_bytes] * len(local)
        )
        return bool(rc == 0)

    def close(self) -> None:
        del self._engine


class BareNixl:
    """A second NIXL agent in this process: descriptors, READ, poll with backoff."""

    def __init__(self, local: Buffer, peer_metadata: bytes, protocol: str) -> None:
        from pdconnect.transfer.nixl import load_nixl_api

        api = load_nixl_api()
        # No progress thread: the reader's own polls progress it (the Python API's
        # default thread is a busy loop that would eat a core during every timed run).
        self._agent = api.nixl_agent(
            f"bare-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self._agent.register_memory([(local.addr, local.size, 0, "")], "DRAM")
        self._remote = self._agent.add_remote_agent(decode_metadata(peer_metadata).endpoint)

    def read(self, blocks: Blocks) -> bool:
        local_addrs, remote_addrs = blocks.addresses()
        local = np.zeros((len(local_addrs), 3), dtype=np.uint64)
        remote = np.zeros((len(local_addrs), 3), dtype=np.uint64)
        local[:, 0], remote[:, 0] = local_addrs, remote_addrs
        local[:, 1] = remote[:, 1] = blocks.block_bytes
        handle = self._agent.initialize_xfer(
            "READ", self._agent.get_xfer_descs(local, "DRAM"), self._agent.get_xfer_descs(remote, "DRAM"), self._remote
        )
        state = self._agent.transfer(handle)
        pause = 20e-6  # the backoff `Transfer.wait` uses
        while state == "PROC":
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            state = self._agent.check_xfer_state(handle)
        self._agent.release_xfer_handle(handle)
        return bool(state == "DONE")

    def close(self) -> None:
        self._agent.remove_remote_agent(self._remote)
        del self._agent


BARE: dict[str, Callable[[Buffer, bytes, str], BareMooncake | BareNixl]] = {
    "mooncake": BareMooncake,
    "nixl": BareNixl,
}


# --- measuring ---------------------------------------------------------------------------


@dataclass
class Runs:
    """One path's timed runs: wall seconds and CPU seconds (this process + the peer)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def timed(run: Callable[[], bool], peer: LoopbackPeer, runs: Runs) -> None:
    peer_before = peer.cpu_seconds()
    cpu_before = time.process_time()
    start = time.perf_counter()
    ok = run()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_before
    if not ok:
        raise RuntimeError("a benchmark transfer failed")
    runs.wall.append(wall)
    runs.cpu.append(cpu + peer.cpu_seconds() - peer_before)


def bench_transport(kind: str, repeats: int, log: Callable[[str], None]) -> list[Result]:
    """Every case for one transport; the peer and the clients live for the whole run.

    Each path has a client of its own (two of our transports, one bare), so each path's
    connection to the peer sits idle for the same two runs of every round. With one
    transport shared by both of our paths, the bare connection idled twice as long and
    bare Mooncake came out 6-30% slower than the very same calls through ours (likely
    TCP's slow start after idle; not proven), a bias in our favour this removes.
    """
    results: list[Result] = []
    with LoopbackPeer(kind, POOL_BYTES) as peer:
        local = Buffer(POOL_BYTES)
        ours: list[Transport[Any]] = []
        bare: BareMooncake | BareNixl | None = None
        try:
            for _ in range(2):
                ours.append(create_transport(kind, host="127.0.0.1"))
                ours[-1].register([local.region])
                ours[-1].connect(PEER, peer.ready.metadata)
            bare = BARE[kind](local, peer.ready.metadata, ours[0].effective_protocol)
            for number, case in enumerate(CASES):
                results.append(_bench_case(kind, case, number, repeats, ours[0], ours[1], bare, local, peer))
                log(_row(results[-1]))
        finally:
            if bare is not None:
                bare.close()
            for transport in ours:
                transport.close()
    return results


def _bench_case(
    kind: str,
    case: Case,
    seed: int,
    repeats: int,
    ours: Transport[Any],
    ours_unmerged: Transport[Any],
    bare: BareMooncake | BareNixl,
    local: Buffer,
    peer: LoopbackPeer,
) -> Result:
    local_layout = kv_layout(local.addr, POOL_BYTES, case.block_bytes)
    remote_layout = kv_layout(peer.ready.pool_addr, POOL_BYTES, case.block_bytes)
    pairs = case.block_pairs(local_layout.num_blocks, seed)
    blocks = Blocks(local.addr, peer.ready.pool_addr, case.block_bytes, pairs)
    per_block = pull_ranges(local_layout, remote_layout, pairs, merged=False)
    merged = pull_ranges(local_layout, remote_layout, pairs)
    local_addrs, remote_addrs = blocks.addresses()
    if (
        len(per_block) != case.count
        or local_addrs.tolist() != per_block.table[:, 0].tolist()
        or remote_addrs.tolist() != per_block.table[:, 1].tolist()
    ):
        raise RuntimeError(f"{kind} {case.name}: bare and ours would not send the same ranges")

    def run_ours(transport: Transport[Any], merge: bool) -> bool:
        ranges = pull_ranges(local_layout, remote_layout, pairs, merged=merge)
        return transport.pull(PEER, ranges, timeout=TIMEOUT).wait(TIMEOUT) is TransferState.DONE

    paths: dict[str, Callable[[], bool]] = {
        "bare": lambda: bare.read(blocks),
        "ours_unmerged": lambda: run_ours(ours_unmerged, False),
        "ours": lambda: run_ours(ours, True),
    }
    expected = peer.digest([(remote, n) for _, remote, n in per_block])
    for name, run in paths.items():  # warm-up doubles as the correctness check
        local.zero()
        if not run() or digest(local, [(addr, n) for addr, _, n in per_block]) != expected:
            raise RuntimeError(f"{kind} {case.name} {name}: pulled bytes differ from the peer's")
    runs = {name: Runs() for name in PATHS}
    # Cycle through every order of the three paths, so each goes first, and follows each
    # other path, equally often: no path always inherits a warm (or busy) system.
    orders = list(itertools.permutations(PATHS))
    for repeat in range(repeats):
        for name in orders[repeat % len(orders)]:
            timed(paths[name], peer, runs[name])
    gb = case.total_bytes / 1e9
    gbps = {name: gb / statistics.median(r.wall) for name, r in runs.items()}
    cpu = {name: statistics.median(r.cpu) / gb for name, r in runs.items()}

    def paired(path: str, baseline: str) -> float:
        """Median over rounds of `path`'s speed relative to `baseline`'s in that round."""
        return statistics.median(base / mine for mine, base in zip(runs[path].wall, runs[baseline].wall))

    return Result(
        kind,
        ours.effective_protocol,
        case.name,
        case.total_bytes,
        round(gbps["bare"], 3),
        round(gbps["ours_unmerged"], 3),
        round(gbps["ours"], 3),
        round(paired("ours_unmerged", "bare"), 3),
        round(min(runs["bare"].wall) / min(runs["ours_unmerged"].wall), 3),
        round(paired("ours", "ours_unmerged"), 3),
        round(cpu["bare"], 3),
        round(cpu["ours_unmerged"], 3),
        round(cpu["ours"], 3),
        case.count,
        len(merged),
        repeats,
    )


@dataclass(frozen=True)
class BusyCallerResult:
    """One row of the busy-caller table: pull latency in ms, idle and busy caller."""

    transport: str
    ranges: int
    idle_p50_ms: float
    idle_p90_ms: float
    busy_p50_ms: float
    busy_p90_ms: float


BUSY_PULL_BYTES = 3 << 19  # 1.5 MiB, a long-suffix request's pull on the tiny models
BUSY_RANGES = (1, 8, 48)


def _hold_the_interpreter(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bench_busy_caller(kind: str, repeats: int, step_s: float) -> list[BusyCallerResult]:
    """Our pulls' latency behind an idle caller and behind one polling once per step."""
    results = []
    with LoopbackPeer(kind, POOL_BYTES) as peer:
        local = Buffer(POOL_BYTES)
        ours = create_transport(kind, host="127.0.0.1")
        try:
            ours.register([local.region])
            ours.connect(PEER, peer.ready.metadata)
            for count in BUSY_RANGES:
                size = BUSY_PULL_BYTES // count
                # Every other slot, so no two ranges merge into one.
                ranges = [(local.addr + 2 * i * size, peer.ready.pool_addr + 2 * i * size, size) for i in range(count)]
                times: dict[bool, list[float]] = {False: [], True: []}
                for repeat in range(repeats + 1):  # round 0 is a warm-up, not counted
                    for busy in (repeat % 2 == 0, repeat % 2 == 1):
                        start = time.perf_counter()
                        transfer = ours.pull(PEER, ranges, TIMEOUT)
                        if busy:
                            while (state := transfer.poll()) is TransferState.PENDING:
                                _hold_the_interpreter(step_s)
                        else:
                            state = transfer.wait(TIMEOUT)
                        if state is not TransferState.DONE:
                            raise RuntimeError(f"{kind}, {count} ranges: a read failed")
                        if not repeat and digest(local, [(a, n) for a, _, n in ranges]) != peer.digest(
                            [(r, n) for _, r, n in ranges]
                        ):
                            raise RuntimeError(f"{kind}, {count} ranges: pulled bytes differ from the peer's")
                        if repeat:
                            times[busy].append((time.perf_counter() - start) * 1e3)
                idle, busy_ms = sorted(times[False]), sorted(times[True])
                results.append(
                    BusyCallerResult(
                        kind,
                        count,
                        round(statistics.median(idle), 2),
                        round(idle[int(0.9 * len(idle))], 2),
                        round(statistics.median(busy_ms), 2),
                        round(busy_ms[int(0.9 * len(busy_ms))], 2),
                    )
                )
        finally:
            ours.close()
    return results


@dataclass(frozen=True)
class DelayResult:
    """One row of the progress-delay sweep."""

    delay_us: int
    idle_cpu_percent: float  # the serving process, % of one core, nothing moving
    first_read_ms: float  # the first one-block read after connecting (wire-up)
    rates_gbps: dict[str, float]  # case name -> our median read rate


SWEEP_CASES = (Case(64, 1 << 20), Case(4096, 16 << 10))
SWEEP_POOL_BYTES = 64 << 20  # both cases fit; several peers at once stay small
IDLE_SECONDS = 2.0


def sweep_progress_delay(delays: Sequence[int], repeats: int, log: Callable[[str], None]) -> list[DelayResult]:
    """Our NIXL reads against serving peers run with each progress-thread delay.

    The peers with a delay run side by side and are read in interleaved rounds (so load
    drift hits them alike), and their idle CPU is taken over one common window. A delay
    of 0 is NIXL's busy loop, which would slow every other measurement on a small host:
    it runs alone, afterwards.
    """
    log(
        f"{'nixl serving delay':>18}  {'idle CPU':>9}  {'first read':>10}  "
        + "  ".join(f"{c.name + ' GB/s':>30}" for c in SWEEP_CASES)
    )
    together = [d for d in dict.fromkeys(delays) if d > 0]
    alone = [d for d in dict.fromkeys(delays) if d == 0]
    results = {}
    for group in (together, alone):
        if group:
            results.update(_sweep_group(group, repeats))
    for delay in delays:
        r = results[delay]
        log(
            f"{delay:>15} us  {r.idle_cpu_percent:>8.1f}%  {r.first_read_ms:>7.1f} ms  "
            + "  ".join(f"{r.rates_gbps[c.name]:>30.2f}" for c in SWEEP_CASES)
            + ("  (measured alone)" if delay == 0 and together else "")
        )
    return [results[d] for d in dict.fromkeys(delays)]


def _sweep_group(delays: Sequence[int], repeats: int) -> dict[int, DelayResult]:
    peers: dict[int, LoopbackPeer] = {}
    ours = create_transport("nixl", host="127.0.0.1")
    try:
        for delay in delays:
            peers[delay] = LoopbackPeer("nixl", SWEEP_POOL_BYTES, nixl_progress_delay_us=delay)
        local = Buffer(SWEEP_POOL_BYTES)
        local.zero()  # fault every page in now, not inside a timed read
        ours.register([local.region])
        first_ms = {}
        for delay, peer in peers.items():
            ours.connect(f"{PEER}-{delay}", peer.ready.metadata)
            started = time.perf_counter()
            first = ours.pull(f"{PEER}-{delay}", [(local.addr, peer.ready.pool_addr, 4096)], TIMEOUT)
            if first.wait(TIMEOUT) is not TransferState.DONE:
                raise RuntimeError(f"delay {delay} us: the first read failed")
            first_ms[delay] = (time.perf_counter() - started) * 1e3
        idle_before = {delay: peer.cpu_seconds() for delay, peer in peers.items()}
        time.sleep(IDLE_SECONDS)
        idle = {delay: (peer.cpu_seconds() - idle_before[delay]) / IDLE_SECONDS * 100 for delay, peer in peers.items()}
        rates: dict[int, dict[str, float]] = {delay: {} for delay in peers}
        for number, case in enumerate(SWEEP_CASES):
            layout = kv_layout(local.addr, SWEEP_POOL_BYTES, case.block_bytes)
            reads = {}
            for delay, peer in peers.items():
                remote = kv_layout(peer.ready.pool_addr, SWEEP_POOL_BYTES, case.block_bytes)
                reads[delay] = (remote, case.block_pairs(layout.num_blocks, number))
            times: dict[int, list[float]] = {delay: [] for delay in peers}
            for repeat in range(repeats + 1):  # round 0 is a warm-up, not counted
                order = list(peers)[repeat % len(peers) :] + list(peers)[: repeat % len(peers)]
                for delay in order:
                    remote, pairs = reads[delay]
                    start = time.perf_counter()
                    ranges = pull_ranges(layout, remote, pairs)
                    transfer = ours.pull(f"{PEER}-{delay}", ranges, TIMEOUT)
                    if transfer.wait(TIMEOUT) is not TransferState.DONE:
                        raise RuntimeError(f"delay {delay} us, {case.name}: a read failed")
                    if repeat:
                        times[delay].append(time.perf_counter() - start)
            for delay in peers:
                rates[delay][case.name] = round(case.total_bytes / statistics.median(times[delay]) / 1e9, 3)
    finally:
        ours.close()
        for peer in peers.values():
            peer.close()
    return {
        delay: DelayResult(delay, round(idle[delay], 1), round(first_ms[delay], 1), rates[delay]) for delay in peers
    }


_HEADER = (
    f"{'':16} {'':27} {'GB/s (median)':^23}  {'fair':^16} {'coal.':>6}  "
    f"{'CPU s/GB (both processes)':^25}  {'':>12}\n"
    f"{'transport':<16} {'case':<27} {'bare':>7} {'unc.':>7} {'ours':>7}  {'unc/bare':>8} "
    f"{'best':>7} {'gain':>6}  {'bare':>7} {'unc.':>8} {'ours':>8}  {'descriptors':>12}"
)


def _row(r: Result) -> str:
    descriptors = f"{r.bare_descriptors}->{r.ours_descriptors}"
    return (
        f"{r.transport + '/' + r.effective_protocol:<16} {r.case:<27} {r.bare_gbps:>7.2f} "
        f"{r.ours_unmerged_gbps:>7.2f} {r.ours_gbps:>7.2f}  {r.fair_ratio:>8.2f} "
        f"{r.fair_best_ratio:>7.2f} {r.merging_gain:>6.2f}  {r.bare_cpu_s_per_gb:>7.3f} "
        f"{r.ours_unmerged_cpu_s_per_gb:>8.3f} {r.ours_cpu_s_per_gb:>8.3f}  "
        f"{descriptors:>12}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=(*TRANSPORT_KINDS, "all"), default="all")
    parser.add_argument(
        "--repeats", type=int, default=24, help="timed runs per path and case (a multiple of 6 balances orders)"
    )
    parser.add_argument(
        "--step-ms", type=float, default=5.0, help="the busy caller's Python time between polls (an engine step)"
    )
    parser.add_argument(
        "--delays", default="0,50,200,1000,5000", help="NIXL serving progress-thread delays to sweep, in us ('' = none)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        delays = [int(d) for d in args.delays.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--delays must be comma-separated integers, got {args.delays!r}")
    kinds = TRANSPORT_KINDS if args.transport == "all" else (args.transport,)
    print(
        f"pool {POOL_BYTES >> 20} MiB per side, {args.repeats} interleaved runs per path "
        f"and case, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        "unc. = ours without merging (same ranges as bare); fair = unc./bare and "
        "coal. gain = ours/unc. (medians of per-round ratios; best = fastest runs)",
        flush=True,
    )
    print(_HEADER, flush=True)
    started = time.monotonic()
    results: list[Result] = []
    for kind in kinds:
        results.extend(bench_transport(kind, args.repeats, lambda line: print(line, flush=True)))
    worst = min(r.fair_ratio for r in results)
    print(
        f"({time.monotonic() - started:.0f} s; lowest fair ratio {worst:.2f}, load average "
        f"now {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    print(
        f"\nOur pulls behind a busy caller: {BUSY_PULL_BYTES >> 10} KiB in N ranges; idle = "
        f"Transfer.wait's backoff, busy = one poll per {args.step_ms:g} ms of Python (an "
        "engine step); latency in ms",
        flush=True,
    )
    print(f"{'transport':<10} {'ranges':>6}  {'idle p50':>8} {'p90':>7}  {'busy p50':>8} {'p90':>7}", flush=True)
    busy_rows: list[BusyCallerResult] = []
    for kind in kinds:
        for row in bench_busy_caller(kind, args.repeats, args.step_ms / 1e3):
            busy_rows.append(row)
            print(
                f"{row.transport:<10} {row.ranges:>6}  {row.idle_p50_ms:>8.2f} {row.idle_p90_ms:>7.2f}  "
                f"{row.busy_p50_ms:>8.2f} {row.busy_p90_ms:>7.2f}",
                flush=True,
            )
    sweep: list[DelayResult] = []
    if "nixl" in kinds and delays:
        print(
            "\nNIXL serving agent's progress-thread delay (ours reads with no progress "
            f"thread; serving process idle CPU over {IDLE_SECONDS:g} s, % of one core; "
            f"rates: medians of {min(args.repeats, 7)} interleaved reads)",
            flush=True,
        )
        sweep = sweep_progress_delay(delays, min(args.repeats, 7), lambda line: print(line, flush=True))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(
            msgspec.json.format(
                msgspec.json.encode(
                    {
                        "paths": [asdict(r) for r in results],
                        "busy_caller": [asdict(r) for r in busy_rows],
                        "nixl_progress_delay": [asdict(r) for r in sweep],
                    }
                ),
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
