"""Tells a prefill engine to free a request's blocks now, off the event loop, when its decode leg will not pull them.

A request that ends without decode pulling its KV (the client left, decode failed, the
answer was refused) would leave the blocks held on the prefill engine until the plan's
lease runs out; `PrefillReleaser` sends the side channel's release instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

from pdconnect.keyring import Keyring
from pdconnect.notifier import PeerNotifier
from pdconnect.protocol import Message, ProtocolError, Release, decode_plan
from pdconnect.router.metrics import RouterMetrics
from pdconnect.sidechannel import is_loopback_host

__all__ = ["PrefillReleaser"]

logger = logging.getLogger("pdconnect.router.releaser")


class PrefillReleaser:
    """Tells a prefill engine to free a request's blocks now, without delaying anyone.

    Releases go through a `PeerNotifier` signing as "router": one worker and one kept
    connection per prefill address, so a release never waits for a connection of its
    own, and a stalled prefill engine delays only its own releases. Releases due for one
    address go out together; one the engine did not answer is sent again until the
    plan's lease would have run out anyway (`lease_expires_at`, at most
    `MAX_RELEASE_SECONDS`), and at most `MAX_PENDING` wait per address. Every outcome is
    counted in `pdconnect_router_prefill_releases` (ok, error, retried, expired, dropped,
    insecure), never raised. Params that are not a pdconnect plan (e.g. vLLM's
    NixlConnector) have no release channel and are left to their lease. Without keys,
    releases go to prefill engines on this machine only: nothing unsigned leaves it.
    """

    MAX_RELEASE_SECONDS: ClassVar[float] = 600.0
    MAX_PENDING: ClassVar[int] = 4096
    # Notifier counter -> the `result` label it is counted under.
    _RESULTS: ClassVar[dict[str, str]] = {
        "notification_failures": "error",
        "release_retries": "retried",
        "releases_expired": "expired",
        "releases_dropped": "dropped",
    }

    def __init__(self, keys: Keyring | None, timeout: float, metrics: RouterMetrics) -> None:
        self._keys = keys
        self._timeout = timeout
        self._metrics = metrics
        self._notifier = PeerNotifier(
            sender="router",
            keys=keys,
            timeout_seconds=timeout,
            heartbeat_seconds=3600.0,  # the router watches nothing: no heartbeats
            count=self._count,
            on_reply=self._answered,
            max_pending_releases=self.MAX_PENDING,
        )

    def release(self, params: dict[str, Any] | None, reason: str) -> None:
        if not params:
            return
        try:
            plan = decode_plan(params)
        except ProtocolError:
            return
        if self._keys is None and not is_loopback_host(plan.remote_host):
            self._metrics.releases.labels("insecure").inc()
            logger.warning("no side-channel keys: release to %s not sent (its lease will run out)", plan.side_channel)
            return
        lifetime = min(max(plan.lease_expires_at - time.time(), 0.0), self.MAX_RELEASE_SECONDS)
        # At least one try, even if the plan's clock says the lease is over already.
        until = time.monotonic() + max(lifetime, self._timeout)
        self._notifier.release(plan.side_channel, plan.remote_engine_id, [plan.remote_request_id], reason, until)

    def _answered(self, address: str, sent: Message, reply: Message) -> None:
        if isinstance(sent, Release):
            self._metrics.releases.labels("ok").inc(len(sent.request_ids))

    def _count(self, name: str, amount: int) -> None:
        self._metrics.releases.labels(self._RESULTS.get(name, name)).inc(amount)

    def close(self, wait: bool = True) -> None:
        """Stop; with `wait`, first give releases still pending one release timeout to go out."""
        if wait:
            deadline = time.monotonic() + self._timeout
            while self._notifier.pending_releases() and time.monotonic() < deadline:
                time.sleep(0.05)
        self._notifier.close()
