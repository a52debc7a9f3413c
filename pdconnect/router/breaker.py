"""A per-engine circuit breaker: consecutive failed requests take an engine out of rotation for a while.

`CircuitBreaker` counts consecutive failed requests; at the threshold it opens for
`cooldown` seconds, then lets exactly one trial request through (half-open): success
closes it, failure reopens it. A peer router replica whose own breaker opened may open
this one too (`trip`: `replicas.py`). It catches engines whose `/health` says fine while their
completions fail (`health` polls the other signal).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

__all__ = ["BreakerState", "CircuitBreaker", "Clock"]

Clock = Callable[[], float]


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Per-engine breaker. Invariant: at most one trial request is out while half-open,
    and a trial that never reports back (its client vanished) stops blocking after one
    cooldown, so an engine can never stay excluded for good by accident."""

    def __init__(self, failure_threshold: int, cooldown: float, clock: Clock = time.monotonic) -> None:
        self._threshold = failure_threshold
        self._cooldown = cooldown
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opens = 0
        self._since = 0.0  # when it opened, or when the trial went out

    def allows(self) -> bool:
        """May a request be sent now? Read-only: `on_attempt` takes the trial slot."""
        if self.state is BreakerState.CLOSED:
            return True
        return self._clock() - self._since >= self._cooldown

    def on_attempt(self) -> None:
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.HALF_OPEN
            self._since = self._clock()

    def trip(self) -> bool:
        """Open now, as if this replica had seen the failures (a peer replica did); True
        when it was closed. An open or half-open breaker is left as it is: its cooldown or
        its trial is already under way."""
        if self.state is not BreakerState.CLOSED:
            return False
        self.state = BreakerState.OPEN
        self._since = self._clock()
        self.opens += 1
        return True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.state = BreakerState.CLOSED

    def record_failure(self) -> bool:
        """Count one failed request; True when this failure opened the breaker."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self.consecutive_failures >= self._threshold
        ):
            self.state = BreakerState.OPEN
            self._since = self._clock()
            self.opens += 1
            return True
        return False
