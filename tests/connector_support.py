"""Connector settings the lease-desk and scheduler-half tests share: Mooncake over tcp on loopback.

The side channel binds any free port (0; plans carry the bound one), heartbeats every
second, and the waits are long enough for two shared cores; a module passes what its
cases need differently (a shorter lease, a tighter handshake) as overrides.
"""

from __future__ import annotations


def loopback_settings(**overrides: float | bool) -> dict[str, object]:
    """`kv_connector_extra_config` for a connector or desk on 127.0.0.1, `overrides` applied."""
    return {
        "transport": "mooncake",
        "protocol": "tcp",
        "side_channel_port": 0,
        "lease_seconds": 30.0,
        "heartbeat_seconds": 1.0,
        "handshake_timeout_seconds": 5.0,
        "transfer_timeout_seconds": 10.0,
        **overrides,
    }
