"""Transport throughput: each library's bare API against our interface, side by side.

For every transport, a spawned "prefill" process serves a registered pool of random
bytes and this process pulls the same block sets two ways, interleaved run by run:
- bare: the library called directly, one descriptor per block, the way a careful user
  without pdconnect would (Mooncake `batch_transfer_sync_read`; NIXL `initialize_xfer`
  + `transfer` + polling `check_xfer_state`);
- ours: `kvlayout.pull_ranges` (layout arithmetic + `coalesce`) + `Transport.pull` +
  `Transfer.wait`, i.e. everything the connector pays per request.
Each path's bytes are checked against the prefill side once per case. GB/s are medians;
ours/bare below 1 is our overhead, above 1 is coalescing paying off; best/best compares
the fastest run of each, which is steadier than the median on a busy shared host.

    python -m pdconnect.bench.transfer [--transport mooncake|nixl|all] [--repeats 7]
                                       [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from pdconnect.kvlayout import TensorLayout, pull_ranges
from pdconnect.transfer import (
    TRANSPORT_KINDS, Range, TransferState, Transport, create_transport, decode_metadata,
)
from pdconnect.transfer.loopback import Buffer, LoopbackPeer, digest

POOL_BYTES = 256 << 20
PEER = "bench-prefill"
TIMEOUT = 60.0


@dataclass(frozen=True)
class Case:
    """One block set: `count` blocks of `block_bytes`, scattered or one contiguous run."""

    count: int
    block_bytes: int
    scattered: bool = True

    @property
    def name(self) -> str:
        size = (f"{self.block_bytes >> 20} MiB" if self.block_bytes >= 1 << 20
                else f"{self.block_bytes >> 10} KiB")
        return f"{self.count} x {size} {'scattered' if self.scattered else 'contiguous'}"

    @property
    def total_bytes(self) -> int:
        return self.count * self.block_bytes

    def block_pairs(self, pool_blocks: int, seed: int) -> list[tuple[int, int]]:
        """(local_block, remote_block) pairs, drawn from the whole pool when scattered."""
        if not self.scattered:
            return [(i, i) for i in range(self.count)]
        rng = random.Random(seed)
        return list(zip(rng.sample(range(pool_blocks), self.count),
                        rng.sample(range(pool_blocks), self.count)))


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
    ours_gbps: float
    ratio: float
    best_ratio: float
    bare_descriptors: int
    ours_descriptors: int
    repeats: int


def kv_layout(base_addr: int, pool_bytes: int, block_bytes: int) -> TensorLayout:
    """The CPU backend's layout [blocks, 2 kv heads, tokens, 2*64 head dims], fp16."""
    tokens = block_bytes // (2 * 128 * 2)
    shape = (pool_bytes // block_bytes, 2, tokens, 128)
    return TensorLayout(base_addr, shape, (2 * tokens * 128, tokens * 128, 128, 1), 2, 0)


# --- the bare libraries ------------------------------------------------------------------


class BareMooncake:
    """A second Mooncake engine in this process, used exactly as its examples do."""

    def __init__(self, local: Buffer, peer_metadata: bytes, protocol: str) -> None:
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        if self._engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError("bare Mooncake engine did not initialize")
        if self._engine.register_memory(local.addr, local.size) != 0:
            raise RuntimeError("bare Mooncake engine did not register the pool")
        self._session = decode_metadata(peer_metadata).endpoint.decode()

    def read(self, blocks: Sequence[Range]) -> bool:
        rc = self._engine.batch_transfer_sync_read(
            self._session, [b[0] for b in blocks], [b[1] for b in blocks],
            [b[2] for b in blocks])
        return bool(rc == 0)

    def close(self) -> None:
        del self._engine


class BareNixl:
    """A second NIXL agent in this process: descriptors, READ, poll until done."""

    def __init__(self, local: Buffer, peer_metadata: bytes, protocol: str) -> None:
        from pdconnect.transfer.nixl import load_nixl_api

        api = load_nixl_api()
        self._agent = api.nixl_agent(f"bare-{uuid.uuid4().hex[:8]}",
                                     api.nixl_agent_config(backends=["UCX"]))
        self._agent.register_memory([(local.addr, local.size, 0, "")], "DRAM")
        self._remote = self._agent.add_remote_agent(decode_metadata(peer_metadata).endpoint)

    def read(self, blocks: Sequence[Range]) -> bool:
        from pdconnect.transfer.nixl import xfer_tables

        local, remote = xfer_tables(blocks)  # the same numpy tables a careful user builds
        handle = self._agent.initialize_xfer(
            "READ", self._agent.get_xfer_descs(local, "DRAM"),
            self._agent.get_xfer_descs(remote, "DRAM"), self._remote)
        state = self._agent.transfer(handle)
        while state == "PROC":
            state = self._agent.check_xfer_state(handle)
        self._agent.release_xfer_handle(handle)
        return bool(state == "DONE")

    def close(self) -> None:
        self._agent.remove_remote_agent(self._remote)
        del self._agent


BARE: dict[str, Callable[[Buffer, bytes, str], BareMooncake | BareNixl]] = {
    "mooncake": BareMooncake, "nixl": BareNixl,
}


# --- measuring ---------------------------------------------------------------------------


def _timed(run: Callable[[], bool]) -> float:
    start = time.perf_counter()
    if not run():
        raise RuntimeError("a benchmark transfer failed")
    return time.perf_counter() - start


def bench_transport(kind: str, repeats: int, log: Callable[[str], None]) -> list[Result]:
    """Every case for one transport; the peer and both clients live for the whole run."""
    results: list[Result] = []
    with LoopbackPeer(kind, POOL_BYTES) as peer:
        ours = create_transport(kind, host="127.0.0.1")
        local = Buffer(POOL_BYTES)
        ours.register([local.region])
        ours.connect(PEER, peer.ready.metadata)
        bare = BARE[kind](local, peer.ready.metadata, ours.effective_protocol)
        try:
            for number, case in enumerate(CASES):
                results.append(_bench_case(kind, case, number, repeats, ours, bare, local, peer))
                log(_row(results[-1]))
        finally:
            bare.close()
            ours.close()
    return results


def _bench_case(kind: str, case: Case, seed: int, repeats: int, ours: Transport[Any],
                bare: BareMooncake | BareNixl, local: Buffer, peer: LoopbackPeer) -> Result:
    local_layout = kv_layout(local.addr, POOL_BYTES, case.block_bytes)
    remote_layout = kv_layout(peer.ready.pool_addr, POOL_BYTES, case.block_bytes)
    pairs = case.block_pairs(local_layout.num_blocks, seed)
    per_block = [(local_layout.block_segments(lb)[0][0], remote_layout.block_segments(rb)[0][0],
                  case.block_bytes) for lb, rb in pairs]

    def run_bare() -> bool:
        return bare.read(per_block)

    def run_ours() -> bool:
        ranges = pull_ranges(local_layout, remote_layout, pairs)
        return ours.pull(PEER, ranges, timeout=TIMEOUT).wait(TIMEOUT) is TransferState.DONE

    expected = peer.digest([(remote, n) for _, remote, n in per_block])
    for run in (run_bare, run_ours):  # warm-up doubles as the correctness check
        local.zero()
        _timed(run)
        if digest(local, [(addr, n) for addr, _, n in per_block]) != expected:
            raise RuntimeError(f"{kind} {case.name}: pulled bytes differ from the peer's")
    bare_times: list[float] = []
    ours_times: list[float] = []
    for repeat in range(repeats):
        # Alternate who goes first so neither always inherits a warm (or busy) system.
        order = [(run_bare, bare_times), (run_ours, ours_times)]
        for run, times in (order if repeat % 2 == 0 else reversed(order)):
            times.append(_timed(run))
    bare_gbps = case.total_bytes / statistics.median(bare_times) / 1e9
    ours_gbps = case.total_bytes / statistics.median(ours_times) / 1e9
    return Result(kind, ours.effective_protocol, case.name, case.total_bytes,
                  round(bare_gbps, 3), round(ours_gbps, 3), round(ours_gbps / bare_gbps, 3),
                  round(min(bare_times) / min(ours_times), 3), len(per_block),
                  len(pull_ranges(local_layout, remote_layout, pairs)), repeats)


_HEADER = (f"{'transport':<16} {'case':<28} {'bare GB/s':>9} {'ours GB/s':>9} "
           f"{'ours/bare':>9} {'best/best':>9} {'descriptors bare->ours':>23}")


def _row(r: Result) -> str:
    descriptors = f"{r.bare_descriptors}->{r.ours_descriptors}"
    return (f"{r.transport + '/' + r.effective_protocol:<16} {r.case:<28} {r.bare_gbps:>9.2f} "
            f"{r.ours_gbps:>9.2f} {r.ratio:>9.2f} {r.best_ratio:>9.2f} {descriptors:>23}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=(*TRANSPORT_KINDS, "all"), default="all")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per path and case")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    kinds = TRANSPORT_KINDS if args.transport == "all" else (args.transport,)
    print(f"pool {POOL_BYTES >> 20} MiB per side, {args.repeats} interleaved runs per path "
          f"and case, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    print(_HEADER, flush=True)
    started = time.monotonic()
    results: list[Result] = []
    for kind in kinds:
        results.extend(bench_transport(kind, args.repeats, lambda line: print(line, flush=True)))
    print(f"({time.monotonic() - started:.0f} s)", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(msgspec.json.format(
            msgspec.json.encode([asdict(r) for r in results]), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
