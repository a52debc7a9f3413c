"""The prefill engine's loans: which hand-offs it still holds, for whom, and until when.

A lease is one hand-off's promise that its blocks stay intact. The side-channel thread
answers claims and heartbeats from this table directly (a decode engine must learn at
once that a lease is gone), while only the scheduler thread touches the block pool.
The table bridges the two under one lock, with one invariant that makes every answer
safe: **a lease leaves the table before its blocks are freed.** Ending a lease (done,
release, expiry) moves it to `ended`, and the scheduler thread frees what it held only
after taking it from there. So "lease L is in the table" at any instant proves L's
blocks were held from the plan's creation until that instant; and lease ids are never
reused, so a lease that ended can never be answered for again.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from pdconnect.protocol import Ack, Claim
from pdconnect.sidechannel import NoAnswer, SideChannelClient, SideChannelError

__all__ = ["CLAIM_ATTEMPTS", "ClaimAnswer", "Lease", "LeaseTable", "confirm_claim", "new_lease_id"]

# A claim the prefill engine did not answer within the handshake timeout is sent once
# more before its load fails. Silence proves nothing about the lease (a prefill engine
# on busy cores answered a claim 5 s late, after the lease had been held all along),
# and a claim is idempotent for its claimant; a refusal is final.
CLAIM_ATTEMPTS = 2

Held = TypeVar("Held")


def new_lease_id() -> str:
    """A lease id never seen before, on this engine or any other."""
    return uuid.uuid4().hex


class ClaimAnswer(Enum):
    HELD = "held"  # held, and now (still) claimed by the asker
    UNKNOWN = "unknown"  # not held: never was, ended, or expired
    TAKEN = "taken"  # held, but claimed by another decode request
    ALTERED = "altered"  # held, but the claim names a plan other than the one lent


@dataclass
class Lease(Generic[Held]):
    """One hand-off: the prefill request it came from and what the scheduler holds for it."""

    request_id: str
    lease_id: str
    plan_digest: str
    expires_at: float
    held: Held
    claimant: str | None = None
    ended_because: str = ""


@dataclass
class LeaseTable(Generic[Held]):
    """Leases by id, shared by the lease desk's main thread (expiry) and its side-channel thread."""

    lease_seconds: float
    _by_lease: dict[str, Lease[Held]] = field(default_factory=dict)
    _by_request: dict[str, str] = field(default_factory=dict)
    _ended: list[Lease[Held]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self, request_id: str, lease_id: str, plan_digest: str, held: Held) -> float:
        """Start a lease (scheduler thread); returns its monotonic expiry."""
        expires_at = time.monotonic() + self.lease_seconds
        with self._lock:
            self._by_lease[lease_id] = Lease(request_id, lease_id, plan_digest, expires_at, held)
            self._by_request[request_id] = lease_id
        return expires_at

    def claim(self, lease_id: str, claimant: str, plan_digest: str) -> ClaimAnswer:
        """Take the lease for `claimant`, or confirm it holds it; extends the lease."""
        with self._lock:
            # Past its expiry but not yet collected by `expire`, a lease still holds its blocks:
            # "held" stays true, and a late heartbeat keeps it. Only `expire` judges silence.
            lease = self._by_lease.get(lease_id)
            if lease is None:
                return ClaimAnswer.UNKNOWN
            if lease.plan_digest != plan_digest:
                return ClaimAnswer.ALTERED
            if lease.claimant not in (None, claimant):
                return ClaimAnswer.TAKEN
            lease.claimant = claimant
            lease.expires_at = time.monotonic() + self.lease_seconds
            return ClaimAnswer.HELD

    def beat(self, ids: list[str]) -> list[str]:
        """Extend the named leases (lease or request ids); returns the ids not held."""
        now = time.monotonic()
        unknown = []
        with self._lock:
            for some_id in ids:
                lease = self._by_lease.get(self._by_request.get(some_id, some_id))
                if lease is None:
                    unknown.append(some_id)
                else:
                    lease.expires_at = now + self.lease_seconds
        return unknown

    def end(self, some_id: str, why: str, claimant: str | None = None) -> bool:
        """End a lease (lease or request id) now.

        A decode request (`claimant` set) may end only a lease it holds the claim on: one
        whose claim was refused must not free blocks another request may be reading. An
        operator's release (the router's, no claimant) ends it whoever holds it.
        """
        with self._lock:
            lease = self._by_lease.get(self._by_request.get(some_id, some_id))
            if lease is None or (claimant is not None and lease.claimant != claimant):
                return False
            self._retire(lease, why)
            return True

    def expire(self, now: float | None = None) -> int:
        """End every lease past its expiry at `now` (the desk's main thread); returns how many.

        `now` is the side channel's `drained_at` where there is one: a heartbeat still
        queued behind a starved serving thread must not lose its lease.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [lease for lease in self._by_lease.values() if lease.expires_at <= now]
            for lease in expired:
                self._retire(lease, "lease expired")
        return len(expired)

    def take_ended(self) -> list[Lease[Held]]:
        """Leases ended since the last call: their blocks may be freed now (the desk reports them)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_lease)

    def _retire(self, lease: Lease[Held], why: str) -> None:
        del self._by_lease[lease.lease_id]
        if self._by_request.get(lease.request_id) == lease.lease_id:
            del self._by_request[lease.request_id]
        lease.ended_because = why
        self._ended.append(lease)


def confirm_claim(client: SideChannelClient, claim: Claim, retrying: Callable[[NoAnswer], None]) -> str | None:
    """Claim a lease on the prefill engine (decode side, any thread but the scheduler's);
    None when the engine confirms it holds the lease for this claimant, else why not.

    An unanswered attempt is made again, up to `CLAIM_ATTEMPTS` (`retrying` is told each
    time); a refusal or a reply naming the lease unknown is final.
    """
    for attempt in range(1, CLAIM_ATTEMPTS + 1):
        try:
            reply = client.request(claim)
        except NoAnswer as exc:
            if attempt == CLAIM_ATTEMPTS:
                return f"could not confirm the prefill engine still held the blocks: {exc}"
            retrying(exc)
            continue
        except SideChannelError as exc:
            return f"could not confirm the prefill engine still held the blocks: {exc}"
        if not isinstance(reply, Ack) or claim.lease_id in reply.unknown:
            return "the prefill engine no longer held the blocks when the read ended"
        return None
    raise AssertionError("unreachable: CLAIM_ATTEMPTS >= 1")
