"""Faults injected into one rank of a real decode engine: a failed read, a dropped handshake.

Loaded into every worker process of an engine started with
`--worker-extension-cls tests.rank_faults.RankFaults` (vLLM imports that class's module in
each worker before the KV caches are registered) and `RANK_FAULTS_ENV` naming a control
file. The test writes the file (`set_faults`) to turn a fault on or off while the engine
runs; without the file every rank behaves as the product does. What it changes, per rank:

- `fail_reads`: decode ranks whose reads fail. The seam is the worker's transport: the
  rank's real read is posted and runs to its end (its bytes may well land), and is then
  reported FAILED, as a library reports a read that broke (`Transfer` stays pending
  until the real one stopped writing, as a real failure does).
- `drop_handshakes`: (decode rank, prefill rank) pairs whose side-channel handshake is
  sent to a socket that takes it and never answers, so it meets the worker's real
  handshake timeout, as a handshake lost on the way does.

Every other call reaches the product's code unchanged. This patches `PDWorker` at
import, in engine worker processes only (the test process never imports it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import zmq

from connectors.metadata import PullSpec
from connectors.worker import PDWorker
from pdconnect.protocol import HandshakeReply
from pdconnect.transfer import Range, Transfer, TransferState

__all__ = ["RANK_FAULTS_ENV", "RankFaults", "set_faults"]

RANK_FAULTS_ENV = "PDCONNECT_TEST_RANK_FAULTS"
# The injected failure's reason, as the decode engine's log shows it.
INJECTED = "FAULT INJECTED"


@dataclass(frozen=True)
class Faults:
    fail_reads: tuple[int, ...] = ()
    drop_handshakes: tuple[tuple[int, int], ...] = ()


def set_faults(path: Path, *, fail_reads: Sequence[int] = (), drop_handshakes: Sequence[tuple[int, int]] = ()) -> None:
    """Turn faults on (or all off) for the engines reading `path`; atomic, so a worker
    never reads half a file."""
    staged = path.with_suffix(".tmp")
    staged.write_text(
        json.dumps({"fail_reads": list(fail_reads), "drop_handshakes": [list(p) for p in drop_handshakes]})
    )
    staged.replace(path)


def _faults() -> Faults:
    """The faults now on (read at each call: the test flips them while the engine runs)."""
    path = os.environ.get(RANK_FAULTS_ENV)
    if not path:
        return Faults()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return Faults()
    return Faults(
        tuple(int(r) for r in data.get("fail_reads", ())),
        tuple((int(d), int(p)) for d, p in data.get("drop_handshakes", ())),
    )


class _FailsAtItsEnd(Transfer):
    """A real read, reported FAILED once the library stopped writing into it."""

    def __init__(self, real: Transfer, reason: str) -> None:
        super().__init__(real.description, timeout=3600.0)  # the real read keeps its own deadline
        self._real = real
        self._reason = reason

    def _status(self) -> tuple[TransferState, str | None]:
        if self._real.poll() is TransferState.PENDING:
            return TransferState.PENDING, None
        return TransferState.FAILED, self._reason

    def _release(self) -> bool:
        return self._real.quiescent


@cache
def _black_hole() -> tuple[zmq.Socket[Any], str]:
    """A zmq socket of this process that accepts messages and answers none, and its
    endpoint: made once, kept (by the cache) for the process's life, never read."""
    sink = zmq.Context.instance().socket(zmq.ROUTER)
    sink.setsockopt(zmq.LINGER, 0)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    return sink, f"tcp://127.0.0.1:{port}"


def _failing_pull(rank: int, real: Callable[..., Transfer]) -> Callable[..., Transfer]:
    def pull(peer: str, ranges: Sequence[Range], timeout: float) -> Transfer:
        transfer = real(peer, ranges, timeout=timeout)
        if rank in _faults().fail_reads:
            return _FailsAtItsEnd(transfer, f"{INJECTED}: decode rank {rank}'s read from {peer} failed")
        return transfer

    return pull


def _install() -> None:
    """Wrap the worker's transport seam and handshake (a module runs once per process)."""
    register = PDWorker.register_kv_caches
    ask = PDWorker._ask

    def register_kv_caches(self: PDWorker, kv_caches: Any) -> None:
        register(self, kv_caches)
        transport = self._transport
        assert transport is not None
        transport.pull = _failing_pull(self.tp_rank, transport.pull)  # type: ignore[method-assign]

    def ask_or_drop(self: PDWorker, spec: PullSpec, rank: int) -> HandshakeReply:
        if (self.tp_rank, rank) in _faults().drop_handshakes:
            spec = dataclasses.replace(spec, side_channel=_black_hole()[1])
        return ask(self, spec, rank)

    PDWorker.register_kv_caches = register_kv_caches  # type: ignore[method-assign]
    PDWorker._ask = ask_or_drop  # type: ignore[method-assign]


class RankFaults:
    """vLLM's worker extension hook: naming it makes vLLM import this module in every worker."""


_install()
