"""The router's OpenTelemetry spans: a request, its route decision, and each attempt of each leg, exported over OTLP.

With `--otlp-traces-endpoint` the router opens a server span per request (a child of the
client's `traceparent`, when it sent one), records the route decision on it, and opens a
client span per attempt at a prefill or decode engine (retries are attempts of their
own). Each attempt's `traceparent` names its span, so the engine's own spans (vLLM's
`--otlp-traces-endpoint`) nest under the attempt that caused them: one trace from the
client to both engines.

Spans are OpenTelemetry's own: the SDK's `TracerProvider`, its `BatchSpanProcessor` (a
thread that exports every `OTEL_BSP_SCHEDULE_DELAY` ms and drops, logged, what a slow
collector leaves behind) and the OTLP/HTTP protobuf exporter of
`opentelemetry-exporter-otlp-proto-http` (its environment variables apply: headers,
timeout, compression, certificates). The SDK is an optional extra
(`pip install pdconnect[otel]`), imported only when an endpoint is configured. Without
it, `NO_SPANS` stands in, and the router still forwards the trace context
(`request.forward_trace_context`).

Sampling is parent-based: a client's `traceparent` decides (flag 01: recorded, 00: not);
a request without one is recorded with probability `--otlp-traces-sample-ratio` (else
`OTEL_TRACES_SAMPLER_ARG`, else 1.0: OpenTelemetry's default `parentbased_always_on`).
An unsampled request costs no SDK span below its root, and one without a client trace
none at all (the router draws its trace id and asks the ratio sampler itself):
its legs still carry a `traceparent` (flag 00) of the same trace, so the engines do not
sample it either.
docs/router.md ("Tracing") has what each costs per request.
"""

from __future__ import annotations

import logging
import os
import random
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Status, Tracer

__all__ = [
    "NO_SPANS",
    "LegSpan",
    "RequestSpans",
    "Tracing",
    "TracingUnavailable",
    "require_sdk",
    "sample_ratio",
]

logger = logging.getLogger("pdconnect.router.tracing")

_SCOPE = "pdconnect.router"


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


def sample_ratio(configured: float | None, environ: Mapping[str, str] = os.environ) -> float:
    """The share of client-less requests to record: the flag, else OTEL_TRACES_SAMPLER_ARG, else 1.0."""
    if configured is not None:
        return configured
    raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not raw:
        return 1.0
    try:
        ratio = float(raw)
    except ValueError:
        raise TracingUnavailable(f"OTEL_TRACES_SAMPLER_ARG={raw!r} is not a ratio in [0, 1]") from None
    if not 0.0 <= ratio <= 1.0:
        raise TracingUnavailable(f"OTEL_TRACES_SAMPLER_ARG={raw!r} is not a ratio in [0, 1]")
    return ratio


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


def _with_traceparent(headers: dict[str, str], traceparent: str, tracestate: str) -> dict[str, str]:
    out = dict(headers)
    out["traceparent"] = traceparent
    out.pop("tracestate", None)
    if tracestate:
        out["tracestate"] = tracestate
    return out


class _UnsampledLeg:
    """An attempt of an unsampled request: no span, a `traceparent` (flag 00) of its own."""

    __slots__ = ("_traceparent", "_tracestate")

    def __init__(self, traceparent: str, tracestate: str) -> None:
        self._traceparent = traceparent
        self._tracestate = tracestate

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        return _with_traceparent(headers, self._traceparent, self._tracestate)

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        pass


class _Leg:
    """An attempt of a sampled request: an SDK client span."""

    __slots__ = ("_sdk", "_span", "_traceparent", "_tracestate")

    def __init__(self, sdk: _Sdk, span: Span, traceparent: str, tracestate: str) -> None:
        self._sdk = sdk
        self._span: Span | None = span
        self._traceparent = traceparent
        self._tracestate = tracestate

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        return _with_traceparent(headers, self._traceparent, self._tracestate)

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if verdict is not True:
            span.set_status(self._sdk.error(detail or "attempt failed"))
        span.end()


class _UnsampledSpans:
    """A request without a client trace that the ratio did not pick: its trace id, no SDK span."""

    __slots__ = ("trace_id",)

    def __init__(self, trace_id: str) -> None:
        self.trace_id: str | None = trace_id

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan:
        return _UnsampledLeg(f"00-{self.trace_id}-{random.getrandbits(64) or 1:016x}-00", "")

    def route(self, route: str, reason: str) -> None:
        pass

    def end(self, status: int, outcome: str) -> None:
        pass


def _drawn_ids() -> Any:
    """The SDK's random ids, except a new trace's id: the one `Tracing.start` drew and had
    the ratio sampler decide on (`drawn`, taken by the next root span).

    `start` sets it and starts the span in one synchronous step on the event loop's
    thread, so no other span can take it in between."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class _Drawn(RandomIdGenerator):
        def __init__(self) -> None:
            self.drawn = 0

        def generate_trace_id(self) -> int:
            trace_id, self.drawn = self.drawn, 0
            return trace_id or super().generate_trace_id()

    return _Drawn()


class _Sdk:
    """The SDK's names the request path uses, imported once (the SDK is optional)."""

    def __init__(self, tracer: Tracer) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        self.tracer = tracer
        self.server, self.client = SpanKind.SERVER, SpanKind.CLIENT
        self.in_context = set_span_in_context
        self._status, self._error = Status, StatusCode.ERROR

    def error(self, description: str) -> Status:
        return self._status(self._error, description)


class _Spans:
    """A request's spans under its SDK server span (`root`)."""

    __slots__ = ("_context", "_flags", "_root", "_sampled", "_sdk", "_trace_hex", "_tracestate", "trace_id")

    def __init__(self, sdk: _Sdk, root: Span) -> None:
        self._sdk = sdk
        self._root = root
        context = root.get_span_context()
        self._sampled = root.is_recording()
        self._trace_hex = format(context.trace_id, "032x")
        self.trace_id: str | None = self._trace_hex
        self._flags = "01" if context.trace_flags.sampled else "00"
        self._tracestate = context.trace_state.to_header()
        self._context = sdk.in_context(root) if self._sampled else None

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan:
        if not self._sampled:
            # What the SDK would do (a non-recording span, a fresh id), without its 6 us.
            traceparent = f"00-{self._trace_hex}-{random.getrandbits(64) or 1:016x}-{self._flags}"
            return _UnsampledLeg(traceparent, self._tracestate)
        sdk = self._sdk
        span = sdk.tracer.start_span(
            role,
            context=self._context,
            kind=sdk.client,
            attributes={"pdconnect.role": role, "pdconnect.engine": engine, "pdconnect.attempt": attempt},
        )
        traceparent = f"00-{self._trace_hex}-{span.get_span_context().span_id:016x}-{self._flags}"
        return _Leg(sdk, span, traceparent, self._tracestate)

    def route(self, route: str, reason: str) -> None:
        if self._sampled:
            self._root.set_attributes({"pdconnect.route": route, "pdconnect.route_reason": reason})

    def end(self, status: int, outcome: str) -> None:
        if not self._sampled:
            return
        root = self._root
        root.set_attributes({"http.response.status_code": status, "pdconnect.outcome": outcome})
        if status >= 500:
            root.set_status(self._sdk.error(outcome))
        root.end()


# --- OTLP's protobuf for the SDK's spans, written by hand -------------------------------
# The SDK's exporter builds each span through opentelemetry-proto's generated classes: 22
# us a span (cProfile, 3 spans a request), more than recording it. `_span_bytes` writes
# the same message (trace.proto's field numbers) in about 2 us; spans it does not cover
# (events, links, array or map attributes: the router makes none) go through the SDK's
# own encoder. tests/test_router_tracing.py checks both encodings parse to equal messages.


_SMALL = tuple(bytes((n,)) for n in range(0x80))  # one-byte varints: every tag and most lengths here


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string, bytes or a nested message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _any_value(value: object) -> bytes | None:
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")  # bool_value = 2
    if isinstance(value, str):
        return _field(1, value.encode())  # string_value = 1
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int_value = 3 (int64: two's complement)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)  # double_value = 4
    return None  # arrays, maps, bytes: the SDK's encoder


_KINDS = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}  # SDK SpanKind value -> OTLP's (0 is UNSPECIFIED there)
_FLAGS = b"\x85\x01"  # flags = 16, fixed32
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags' masks, as the SDK's encoder sets them


_ATTRIBUTES_KEPT = 4096  # encoded attributes cached (role, engine, route, outcome: few distinct)


def _span_bytes(span: ReadableSpan, attributes: dict[tuple[str, type, object], bytes]) -> bytes | None:
    """One `Span` message, or None when the span holds what this does not write;
    `attributes` caches encoded attributes (by type too: True and 1 are equal keys)."""
    if span.events or span.links:
        return None
    context, parent = span.context, span.parent
    assert context is not None and span.start_time is not None and span.end_time is not None
    parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
    state = ",".join(f"{key}={value}" for key, value in context.trace_state.items())
    if state:
        parts.append(_field(3, state.encode()))
    if parent is not None:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    parts.append(_field(5, span.name.encode()))
    parts += (b"\x30", _varint(_KINDS[span.kind.value]))
    parts.append(struct.pack("<BQBQ", 0x39, span.start_time, 0x41, span.end_time))
    for key, value in (span.attributes or {}).items():
        cache_key = (key, type(value), value)
        attribute = attributes.get(cache_key) if isinstance(value, (str, int, float)) else None
        if attribute is None:
            encoded = _any_value(value)
            if encoded is None:
                return None
            attribute = _field(9, _field(1, key.encode()) + _field(2, encoded))
            if len(attributes) >= _ATTRIBUTES_KEPT:
                attributes.clear()
            if isinstance(value, (str, int, float)):
                attributes[cache_key] = attribute
        parts.append(attribute)
    for number, count in ((10, span.dropped_attributes), (12, span.dropped_events), (14, span.dropped_links)):
        if count:
            parts += (_varint(number << 3), _varint(count))
    status = span.status
    message = _field(2, status.description.encode()) if status.description else b""
    code = b"\x18" + _varint(status.status_code.value) if status.status_code.value else b""
    parts.append(_field(15, message + code))
    remote = _IS_REMOTE if parent is not None and parent.is_remote else 0
    parts += (_FLAGS, struct.pack("<I", _HAS_IS_REMOTE | remote))
    return b"".join(parts)


class _Encoded:
    """What the exporter encoded before: resources' and scopes' fields, attributes."""

    def __init__(self) -> None:
        self.heads: dict[int, tuple[object, bytes]] = {}
        self.attributes: dict[tuple[str, type, object], bytes] = {}


def _export_request(spans: Sequence[ReadableSpan], cache: _Encoded) -> bytes:
    """An `ExportTraceServiceRequest` of `spans`, grouped by resource, then scope, as the
    SDK's; `cache` keeps each resource's and scope's fields (the SDK's encoder, once)."""
    from opentelemetry.exporter.otlp.proto.common._internal import (
        _encode_instrumentation_scope,
        _encode_resource,
    )
    from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import _encode_span
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    heads = cache.heads

    def head(of: Resource | InstrumentationScope | None) -> bytes:
        cached = heads.get(id(of))
        if cached is not None and cached[0] is of:
            return cached[1]
        if of is None:
            encoded = _field(1, b"")
        elif isinstance(of, InstrumentationScope):
            encoded = _field(1, _encode_instrumentation_scope(of).SerializeToString())
        else:
            encoded = _field(1, _encode_resource(of).SerializeToString())
        if of is not None and of.schema_url:
            encoded += _field(3, of.schema_url.encode())  # a parser takes fields in any order
        heads[id(of)] = (of, encoded)
        return encoded

    # By identity: a Resource hashes through json.dumps of its attributes (the SDK groups by
    # equality; the router's spans share one provider's resource and scope anyway).
    groups: dict[int, tuple[Resource, dict[int, tuple[InstrumentationScope | None, list[bytes]]]]] = {}
    for span in spans:
        encoded = _span_bytes(span, cache.attributes)
        if encoded is None:
            encoded = _encode_span(span).SerializeToString()
        resource, scope = span.resource, span.instrumentation_scope
        scopes = groups.setdefault(id(resource), (resource, {}))[1]
        scopes.setdefault(id(scope), (scope, []))[1].append(_field(2, encoded))
    out = []
    for resource, scopes in groups.values():
        # ResourceSpans: resource = 1, scope_spans = 2; ScopeSpans: scope = 1, spans = 2.
        body = b"".join(_field(2, head(scope) + b"".join(encoded)) for scope, encoded in scopes.values())
        out.append(_field(1, head(resource) + body))
    return b"".join(out)


def _otlp_exporter(endpoint: str) -> SpanExporter:
    """The SDK's OTLP/HTTP exporter (transport, retries, headers, TLS, compression), encoding by hand."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class _Exporter(OTLPSpanExporter):
        def __init__(self) -> None:
            super().__init__(endpoint=endpoint)
            self._cache = _Encoded()

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            if self._shutdown:
                return SpanExportResult.FAILURE
            try:
                body = _export_request(spans, self._cache)
            except Exception:  # the batch thread: logged and dropped, as the SDK's encoder does
                logger.exception("OTLP encoding of %d spans failed; dropped", len(spans))
                return SpanExportResult.FAILURE
            result = self._client.export(body)
            return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE

    exporter: SpanExporter = _Exporter()
    return exporter


class Tracing:
    """The router's tracer: the SDK's provider, a parent-based ratio sampler, batches over OTLP/HTTP.

    `exporter` replaces the OTLP/HTTP one (tests, benchmarks: an in-memory or null exporter).
    """

    def __init__(
        self,
        endpoint: str,
        service_name: str = "pdconnect-router",
        ratio: float = 1.0,
        exporter: SpanExporter | None = None,
    ) -> None:
        require_sdk()
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.ratio = ratio
        # A request without a client trace is decided once, here, by the SDK's ratio sampler
        # on a trace id drawn here: an unpicked one skips the SDK's span (start_span,
        # context: most of what tracing at a ratio of 0.1 costs, `bench-router --observed`)
        # and carries that id; a picked one gets its SDK span with that id (`_drawn_ids`),
        # which the provider's root sampler records as decided. A client's flag decides for
        # a request that sent one (parent-based).
        self._root, self._kept = TraceIdRatioBased(ratio), Decision.RECORD_AND_SAMPLE
        self._ids = _drawn_ids()
        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(ALWAYS_ON),
            id_generator=self._ids,
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter or _otlp_exporter(endpoint)))
        self._sdk = _Sdk(self._provider.get_tracer(_SCOPE))
        self._extract = TraceContextTextMapPropagator().extract
        self._getter: Any = DefaultGetter()

    def start(self, headers: Mapping[str, str], name: str) -> RequestSpans:
        """The request's server span, a child of the client's trace context if it sent a valid one."""
        # W3C's rules (version, all-zero ids, tracestate) are the propagator's; no header: a new trace.
        sdk = self._sdk
        if "traceparent" in headers:
            parent = self._extract(headers, getter=self._getter)
            return _Spans(sdk, sdk.tracer.start_span(name, context=parent, kind=sdk.server))
        trace_id = random.getrandbits(128) or 1
        if self._root.should_sample(None, trace_id, name).decision is not self._kept:
            return _UnsampledSpans(format(trace_id, "032x"))
        self._ids.drawn = trace_id
        return _Spans(sdk, sdk.tracer.start_span(name, context=None, kind=sdk.server))

    def close(self) -> None:
        """Export what is buffered, then stop (blocking)."""
        self._provider.shutdown()
