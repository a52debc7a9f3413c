"""What happened to one routed request: its outcome, status, route, engines and spans, and its access-log entry.

`flow.PDFlow` fills one `RequestRecord` per request as it goes; its end feeds the
metrics (`outcome`), the response headers, the access log (`logs.AccessEntry`) and the
request's span (`tracing`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdconnect.router.decider import Route
from pdconnect.router.engines import Engine
from pdconnect.router.logs import AccessEntry
from pdconnect.router.tracing import RequestSpans

__all__ = ["SERVED", "Prefilled", "RequestRecord"]

# The outcomes of a request served (P/D, or decode-only after prefill failed).
SERVED = frozenset({"ok", "ok_fallback"})


class Prefilled(msgspec.Struct, frozen=True):
    """The prefill leg's result: the engine, its plan (kv_transfer_params) and usage."""

    engine: Engine
    params: dict[str, Any] | None
    usage: Any


class RequestRecord:
    """What happened to one request, for its metrics, response headers, access log and spans."""

    __slots__ = (
        "decode",
        "decode_engines",
        "fallback",
        "outcome",
        "prefilled",
        "route",
        "spans",
        "stalled",
        "status",
        "ttft",
    )

    def __init__(self, spans: RequestSpans) -> None:
        self.spans = spans  # the request's OpenTelemetry spans (NO_SPANS: not tracing)
        self.outcome = "bad_request"
        self.status = 500  # the HTTP status the client got (499: it left first)
        self.decode: str | None = None  # the decode engine that answered
        self.ttft: float | None = None  # seconds from arrival to the first byte relayed
        self.fallback: str | None = None
        self.prefilled: Prefilled | None = None
        self.stalled = False  # the client stopped reading and was dropped
        self.route: Route | None = None  # the decode-first decider's, when there is one
        self.decode_engines: list[Engine] | None = None  # pinned by a local route

    def route_name(self) -> str:
        """How the request was served: pd, decode-first, fallback, decode-only, or "-"."""
        if self.fallback:
            return "fallback"
        if self.route is not None and self.route.local:
            return "decode-first"
        if self.prefilled is not None:
            return "pd"
        return "decode-only" if self.decode else "-"

    def access_entry(self, method: str, path: str, elapsed: float) -> AccessEntry:
        return AccessEntry(
            method=method,
            path=path,
            status=self.status,
            outcome=self.outcome,
            route=self.route_name(),
            prefill=self.prefilled.engine.name if self.prefilled else None,
            decode=self.decode,
            ttft_seconds=self.ttft,
            duration_seconds=elapsed,
        )
