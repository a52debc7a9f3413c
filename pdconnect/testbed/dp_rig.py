"""A data-parallel decode engine on one machine: its per-rank KV event ports and the router that pins ranks.

vLLM binds data-parallel rank r's KV event publisher (and replay socket) at the
configured port plus r, so a DP engine needs runs of consecutive free ports, and a
router that reads every rank's events from those bases (`--kv-events-port`,
`--kv-events-replay-port`) and pins each decode leg to a rank (`--decode-dp-size`,
vLLM's `X-data-parallel-rank`). Shared by `make bench-parallel` and the DP decode
engine tests.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from pdconnect.testbed.processes import Cluster

__all__ = ["DPEvents", "free_port_run"]


def free_port_run(cluster: Cluster, length: int) -> int:
    """The first of `length` consecutive free ports (vLLM adds a rank to a base port)."""
    for _ in range(100):
        base = cluster.free_port()
        held: list[socket.socket] = []
        try:
            for port in range(base, base + length):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {length} consecutive free ports")


@dataclass(frozen=True)
class DPEvents:
    """The KV event and replay base ports of one engine of `ranks` data-parallel ranks."""

    ranks: int
    events: int
    replay: int

    @classmethod
    def reserve(cls, cluster: Cluster, ranks: int) -> DPEvents:
        return cls(ranks, free_port_run(cluster, ranks), free_port_run(cluster, ranks))

    def engine_config(self) -> dict[str, Any]:
        """The engine's `--kv-events-config` (a wildcard host: vLLM binds only those)."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }

    def router_args(self) -> list[str]:
        """A kv-aware router reading every rank's events and pinning each decode leg to a rank."""
        return [
            "--policy",
            "kv-aware",
            "--decode-dp-size",
            str(self.ranks),
            "--kv-events-port",
            str(self.events),
            "--kv-events-replay-port",
            str(self.replay),
        ]
