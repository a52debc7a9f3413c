"""Per-key request and token rates: token buckets, and what a request costs.

Each client key (`apikeys`) may carry `requests_per_minute` and `tokens_per_minute`.
Each is a token bucket holding at most one minute's worth (a key idle for a minute may
spend a minute's worth at once) and refilled continuously at the rate. A request takes
1 from the request bucket before its body is read, and its token cost from the token
bucket once the body is parsed (`request_cost`); a bucket that cannot pay refuses with
429 and `Retry-After`, the whole seconds until it could, and takes nothing.

A request's token cost is what it may make an engine do, known before it runs: its
prompt tokens (the token ids when the router computed them for the kv-aware policy, or
the client sent ids; otherwise the body's bytes / 4, rounded up, an estimate on the
high side for text) plus the output it asks for (`max_tokens`,
`max_completion_tokens` or `max_output_tokens`; without one, the key's
`default_max_tokens`). Nothing is refunded when the answer is shorter. A request
costing more than the bucket can ever hold is refused with 400, never with a 429 that
no wait would lift.

The buckets belong to the router instance (one per key, made when the keys are loaded)
and hold for the fleet the way the engines' bounds do (`replicas`): with N router
replicas counted, each bucket holds and refills at 1/N of the key's rates, so the
replicas together admit at most the key's rate, whichever of them its requests reach
(a key whose traffic lands on one replica gets less than its rate; docs/router.md,
"Several replicas").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from pdconnect.router.errors import BadRequest, RateLimited
from pdconnect.router.replicas import one_replica
from pdconnect.router.request import Call

__all__ = ["KeyLimits", "TokenBucket", "request_cost"]

# Bytes per token of the estimate used when the router has no token ids (English text
# runs ~4 bytes per token on common tokenizers; JSON syntax makes the estimate higher).
_BYTES_PER_TOKEN = 4
_MAX_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class TokenBucket:
    """This replica's share of `per_minute` tokens a minute (1/`replicas()`), at most one
    minute's worth of that share held."""

    def __init__(
        self, per_minute: float, clock: Callable[[], float] = time.monotonic, replicas: Callable[[], int] = one_replica
    ) -> None:
        self.per_minute = per_minute
        self._replicas = replicas
        self._clock = clock
        self._level = self.capacity
        self._stamp = clock()

    @property
    def capacity(self) -> float:
        """A minute of this replica's share: the count is read live, as the replicas change."""
        return self.per_minute / max(1, self._replicas())

    def take(self, amount: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds until it could."""
        now = self._clock()
        capacity = self.capacity
        rate = capacity / 60.0  # per second
        self._level = min(capacity, self._level + (now - self._stamp) * rate)
        self._stamp = now
        if self._level >= amount:
            self._level -= amount
            return 0.0
        return (amount - self._level) / rate


class KeyLimits:
    """One key's buckets (None: that rate is not limited)."""

    def __init__(
        self,
        requests_per_minute: float | None,
        tokens_per_minute: float | None,
        clock: Callable[[], float] | None = None,
        replicas: Callable[[], int] | None = None,
    ) -> None:
        """`clock`: seconds (default: monotonic); `replicas`: the router replicas counted (default: 1)."""
        now, count = clock or time.monotonic, replicas or one_replica
        self._requests = TokenBucket(requests_per_minute, now, count) if requests_per_minute else None
        self._tokens = TokenBucket(tokens_per_minute, now, count) if tokens_per_minute else None

    def admit_request(self) -> None:
        """Take one request; RateLimited (429) when the key is over its request rate."""
        if self._requests is None:
            return
        wait = self._requests.take(1)
        if wait:
            raise RateLimited(
                f"rate limit reached: {self._requests.per_minute:g} requests per minute", "requests", _seconds(wait)
            )

    def admit_tokens(self, cost: int) -> None:
        """Take `cost` tokens; RateLimited (429) when over the token rate, BadRequest when
        the cost is over what the key may ever spend at once."""
        bucket = self._tokens
        if bucket is None:
            return
        if cost > bucket.capacity:
            raise BadRequest(
                f"this request may use {cost} tokens (prompt and requested output), over what this key may "
                f"spend at once on one router ({bucket.capacity:g} of its {bucket.per_minute:g} tokens per "
                f"minute): lower max_tokens or the prompt"
            )
        wait = bucket.take(cost)
        if wait:
            raise RateLimited(
                f"rate limit reached: {bucket.per_minute:g} tokens per minute (this request counts {cost})",
                "tokens",
                _seconds(wait),
            )


def request_cost(call: Call, default_max_tokens: int) -> int:
    """The tokens a request is charged (module doc): prompt plus requested output."""
    prompt = len(call.prompt.tokens) if call.prompt is not None else _prompt_estimate(call)
    return prompt + _requested_output(call.body, default_max_tokens)


def _prompt_estimate(call: Call) -> int:
    ids = call.body.get("prompt")
    if isinstance(ids, list) and ids and all(type(token) is int for token in ids):
        return len(ids)
    return math.ceil(len(call.raw) / _BYTES_PER_TOKEN)


def _requested_output(body: dict[str, Any], default: int) -> int:
    # The largest asked for: chat may carry both of its fields, and the engine reads either.
    asked = [
        value
        for value in (body.get(field) for field in _MAX_OUTPUT_FIELDS)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0
    ]
    return max(asked) if asked else default


def _seconds(wait: float) -> int:
    """Retry-After is whole seconds: rounded up, so a retry at that time is admitted."""
    return max(1, math.ceil(wait))
