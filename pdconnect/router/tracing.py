"""The router's OpenTelemetry spans: a request, its route decision, and each attempt of each leg, exported over OTLP.

With `--otlp-traces-endpoint` the router opens a server span per request (a child of the
client's `traceparent`, when it sent one), records the route decision on it, and opens a
client span per attempt at a prefill or decode engine (retries are attempts of their
own). Each attempt's `traceparent` names its span, so the engine's own spans (vLLM's
`--otlp-traces-endpoint`) nest under the attempt that caused them: one trace from the
client to both engines.

The OpenTelemetry SDK is an optional extra (`pip install pdconnect[otel]`) and is
imported only when an endpoint is configured. Without it, `NO_SPANS` stands in, and the
router still forwards the trace context (`request.forward_trace_context`).

The request path does not go through the SDK's tracer: its spans cost about 60 us each to
start, end and encode (py-spy, `make bench-router --observed`), three per request, which
put the router above vllm-router's CPU per request. A span here is a slotted record filled
on the event loop (ids from `random.getrandbits`, times from `time.time_ns`), encoded
when it ends into OTLP's protobuf (written by hand, `_span_bytes`: about 2 us, where the
generated classes cost 35), and a thread (`_Exporter`) posts what ended every
`OTEL_BSP_SCHEDULE_DELAY` ms, or at once when `_BATCH` spans wait, as the SDK's batch
processor would. The sampled flag of the client's `traceparent` is honoured (flag 00: no
span is recorded, the context is still forwarded); without one, every request is sampled.
A failed export is logged and counted, never raised: spans are dropped, requests are not.
"""

from __future__ import annotations

import functools
import http.client
import logging
import os
import random
import re
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

__all__ = ["NO_SPANS", "LegSpan", "RequestSpans", "Tracing", "TracingUnavailable", "require_sdk"]

logger = logging.getLogger("pdconnect.router.tracing")

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_BATCH = 512  # spans that make the exporter post at once, before its delay is up
_QUEUE_LIMIT = 2048 * 3  # spans kept while the collector is slow; beyond: dropped, counted
_SERVER, _CLIENT = 2, 3  # OTLP's SpanKind numbers
_STATUS_ERROR = 2


class TracingUnavailable(RuntimeError):
    """An OTLP endpoint is configured but the OpenTelemetry SDK is not installed."""


def require_sdk() -> None:
    """Raise TracingUnavailable unless the OpenTelemetry SDK and its OTLP/HTTP exporter import."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'pdconnect[otel]' ({exc})"
        ) from None


class LegSpan(Protocol):
    """One attempt at one engine."""

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` with this attempt's `traceparent` (a copy; the same dict when not tracing)."""
        ...

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        """True: the engine served; False or None: the attempt failed (`detail` says how)."""
        ...


class RequestSpans(Protocol):
    """The spans of one request."""

    trace_id: str | None

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan: ...

    def route(self, route: str, reason: str) -> None: ...

    def end(self, status: int, outcome: str) -> None: ...


class _NoLeg:
    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        return headers

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        pass


class _NoSpans:
    trace_id: str | None = None
    _leg = _NoLeg()

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan:
        return self._leg

    def route(self, route: str, reason: str) -> None:
        pass

    def end(self, status: int, outcome: str) -> None:
        pass


NO_SPANS: RequestSpans = _NoSpans()


class _Span:
    """One finished or running span, as OTLP will carry it."""

    __slots__ = ("attributes", "end_ns", "error", "kind", "name", "parent_id", "span_id", "start_ns", "trace_id")

    def __init__(self, name: str, kind: int, trace_id: int, parent_id: int, attributes: dict[str, Any]) -> None:
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64) or 1
        self.parent_id = parent_id  # 0: a root span
        self.attributes = attributes
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.error: str | None = None


class _Leg:
    def __init__(
        self, span: _Span | None, traceparent: str, tracestate: str | None, done: Callable[[_Span], None]
    ) -> None:
        self._span = span
        self._traceparent = traceparent
        self._tracestate = tracestate
        self._done = done

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        out = dict(headers)
        out["traceparent"] = self._traceparent
        out.pop("tracestate", None)
        if self._tracestate:
            out["tracestate"] = self._tracestate
        return out

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if verdict is not True:
            span.error = detail or "attempt failed"
        span.end_ns = time.time_ns()
        self._done(span)


class _Spans:
    """A request's spans: `root` is recorded only when the trace is sampled."""

    def __init__(
        self,
        trace_id: int,
        root: _Span,
        sampled: bool,
        tracestate: str | None,
        done: Callable[[_Span], None],
    ) -> None:
        self._trace_hex = format(trace_id, "032x")
        self.trace_id: str | None = self._trace_hex
        self._root = root
        self._sampled = sampled
        self._flags = "01" if sampled else "00"
        self._tracestate = tracestate
        self._done = done

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan:
        attributes = {"pdconnect.role": role, "pdconnect.engine": engine, "pdconnect.attempt": attempt}
        span = _Span(role, _CLIENT, self._root.trace_id, self._root.span_id, attributes)
        traceparent = f"00-{self._trace_hex}-{span.span_id:016x}-{self._flags}"
        return _Leg(span if self._sampled else None, traceparent, self._tracestate, self._done)

    def route(self, route: str, reason: str) -> None:
        self._root.attributes["pdconnect.route"] = route
        self._root.attributes["pdconnect.route_reason"] = reason

    def end(self, status: int, outcome: str) -> None:
        root = self._root
        root.attributes["http.response.status_code"] = status
        root.attributes["pdconnect.outcome"] = outcome
        if status >= 500:
            root.error = outcome
        root.end_ns = time.time_ns()
        if self._sampled:
            self._done(root)


class Tracing:
    """The router's tracer: spans recorded on the loop, exported in batches to one OTLP/HTTP endpoint."""

    def __init__(self, endpoint: str, service_name: str = "pdconnect-router") -> None:
        require_sdk()
        delay = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")) / 1000
        self._exporter = _Exporter(endpoint, service_name, max(delay, 0.001))
        self._done = self._exporter.add

    def start(self, headers: Mapping[str, str], name: str) -> RequestSpans:
        """The request's server span, a child of the client's trace context if it sent a valid one."""
        parent = _TRACEPARENT.fullmatch(headers.get("traceparent", "").strip().lower())
        trace_id = int(parent.group(1), 16) if parent else 0
        parent_id = int(parent.group(2), 16) if parent else 0
        if not trace_id or not parent_id:  # absent, malformed, or W3C's all-zero ids: a new trace
            trace_id, parent_id, sampled, tracestate = random.getrandbits(128) or 1, 0, True, None
        else:
            sampled = bool(int(parent.group(3), 16) & 1) if parent else True
            tracestate = headers.get("tracestate") or None
        root = _Span(name, _SERVER, trace_id, parent_id, {})
        return _Spans(trace_id, root, sampled, tracestate, self._done)

    def close(self) -> None:
        """Export what is buffered, then stop (blocking)."""
        self._exporter.close()


class _Exporter:
    """A thread posting the ended spans as OTLP/HTTP protobuf, in rounds."""

    def __init__(self, endpoint: str, service_name: str, delay: float) -> None:
        self._resource = _field(1, _key_value("service.name", service_name))  # Resource.attributes
        self._scope = _field(1, b"pdconnect.router")  # InstrumentationScope.name
        parts = urlsplit(endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.netloc
        self._path = parts.path or "/v1/traces"
        self._delay = delay
        # Encoded spans (`Span` fields 2 of ScopeSpans), appended on the loop, taken here: both ends thread-safe.
        self._spans: deque[bytes] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._connection: http.client.HTTPConnection | None = None
        self.dropped = 0
        self.failed_exports = 0
        self._thread = threading.Thread(target=self._run, name="otlp-exporter", daemon=True)
        self._thread.start()

    def add(self, span: _Span) -> None:
        """On the loop: queue an ended span; a full queue (a collector far behind) drops it, counted."""
        spans = self._spans
        if len(spans) >= _QUEUE_LIMIT:
            self.dropped += 1
            return
        # Encoded here, 2 us: the thread then holds the interpreter lock only to join and
        # send, never for a whole batch while requests wait on the loop (their p99).
        spans.append(_field(2, _span_bytes(span)))
        if len(spans) == _BATCH:
            self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._delay)
            self._wake.clear()
            stopping = self._stop
            queued = self._spans
            spans = [queued.popleft() for _ in range(len(queued))]
            if spans:
                try:
                    self._post(self._request(spans))
                except Exception as exc:  # noqa: BLE001 - a helper thread: log, count, drop this round, go on
                    self.failed_exports += 1
                    logger.warning("OTLP export of %d spans to %s failed: %r", len(spans), self._host, exc)
                    self._close_connection()
            if stopping:
                self._close_connection()
                return

    def _request(self, spans: list[bytes]) -> bytes:
        """An `ExportTraceServiceRequest` of encoded `spans` (below: OTLP's protobuf by hand)."""
        scope_spans = _field(1, self._scope) + b"".join(spans)
        return _field(1, _field(1, self._resource) + _field(2, scope_spans))

    def _encode(self, spans: list[_Span]) -> bytes:
        """An `ExportTraceServiceRequest` of `spans`, as the exporter posts it."""
        return self._request([_field(2, _span_bytes(span)) for span in spans])

    def _post(self, body: bytes) -> None:
        if self._connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._connection = kind(self._host, timeout=10)
        self._connection.request("POST", self._path, body=body, headers={"Content-Type": "application/x-protobuf"})
        response = self._connection.getresponse()
        response.read()
        if response.status >= 300:
            raise RuntimeError(f"the collector answered {response.status}")

    def _close_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


# --- OTLP's protobuf, written by hand ----------------------------------------------------
# The messages of opentelemetry-proto's trace.proto, common.proto and resource.proto that
# the router fills, field numbers as declared there; building them through the generated
# classes cost 35 us a span, more than the rest of a request's tracing together.
# tests/test_router_tracing.py decodes what this writes with those generated classes.


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string, bytes or a nested message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")  # bool_value = 2
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int_value = 3 (int64: two's complement)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)  # double_value = 4
    return _field(1, str(value).encode())  # string_value = 1


def _key_value(key: str, value: Any) -> bytes:
    return _field(1, key.encode()) + _field(2, _any_value(value))


# kind (field 6, varint: every SpanKind fits one byte), start and end times (7, 8: fixed64).
_KIND_AND_TIMES = struct.Struct("<BBBQBQ")


@functools.lru_cache(maxsize=4096, typed=True)
def _attribute(key: str, value: Any) -> bytes:
    return _field(9, _key_value(key, value))  # Span.attributes = 9


@functools.lru_cache(maxsize=256)
def _name(name: str) -> bytes:
    return _field(5, name.encode())  # Span.name = 5


def _span_bytes(span: _Span) -> bytes:
    parts = [
        b"\x0a\x10",  # trace_id = 1, 16 bytes
        span.trace_id.to_bytes(16, "big"),
        b"\x12\x08",  # span_id = 2, 8 bytes
        span.span_id.to_bytes(8, "big"),
    ]
    if span.parent_id:
        parts += (b"\x22\x08", span.parent_id.to_bytes(8, "big"))  # parent_span_id = 4
    parts.append(_name(span.name))
    parts.append(_KIND_AND_TIMES.pack(0x30, span.kind, 0x39, span.start_ns, 0x41, span.end_ns))
    parts.extend(_attribute(k, v) for k, v in span.attributes.items())
    if span.error is not None:  # status = 15: message = 2, code = 3
        parts.append(_field(15, _field(2, span.error.encode()) + b"\x18" + _varint(_STATUS_ERROR)))
    return b"".join(parts)
