"""The router's OpenTelemetry spans: a request, its route decision, and each attempt of each leg, exported over OTLP.

With `--otlp-traces-endpoint` the router opens a server span per request (a child of the
client's `traceparent`, when it sent one), records the route decision on it, and opens a
client span per attempt at a prefill or decode engine (retries are attempts of their
own). Each attempt's `traceparent` names its span, so the engine's own spans (vLLM's
`--otlp-traces-endpoint`) nest under the attempt that caused them: one trace from the
client to both engines.

Spans are OpenTelemetry's own: the SDK's sampler, span ids and finished-span type
(`ReadableSpan`), its `BatchSpanProcessor` (a thread that exports every
`OTEL_BSP_SCHEDULE_DELAY` ms and drops, logged, what a slow collector leaves behind) and
the OTLP/HTTP protobuf exporter of
`opentelemetry-exporter-otlp-proto-http` (its environment variables apply: headers,
timeout, compression, certificates). The SDK is an optional extra
(`pip install pdconnect[otel]`), imported only when an endpoint is configured. Without
it, `NO_SPANS` stands in, and the router still forwards the trace context
(`request.forward_trace_context`).

Sampling is parent-based: a client's `traceparent` decides (flag 01: recorded, 00: not);
a request without one is recorded with probability `--otlp-traces-sample-ratio` (else
`OTEL_TRACES_SAMPLER_ARG`, else 1.0: OpenTelemetry's default `parentbased_always_on`).
An unsampled request costs no span: the sampler decides on the client's context, or on
the trace id the router draws for a request without one, and its legs still carry a
`traceparent` (flag 00) of that trace, so the engines do not sample it either.
docs/router.md ("Tracing") has what each costs per request.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import SpanContext, SpanKind, Status, TraceFlags, TraceState

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
        """`headers` with this attempt's `traceparent`: a copy (the same dict when not
        tracing), which may be handed to every attempt of an unsampled request, so the
        caller copies it before adding headers of its own."""
        ...

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        """True: the engine served; False or None: the attempt failed (`detail` says how)."""
        ...


class RequestSpans(Protocol):
    """The spans of one request."""

    @property
    def trace_id(self) -> str | None:
        """The request's W3C trace id (32 hex digits), recorded or not; None when not tracing."""
        ...

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan: ...

    def route(self, route: str, reason: str) -> None: ...

    def end(self, status: int, outcome: str) -> None: ...


class _NoLeg:
    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        return headers

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        pass


class _Unrecorded:
    """A request no span is recorded for: its trace id, if any, and what every leg carries."""

    __slots__ = ("_leg", "trace_id")

    def __init__(self, trace_id: str | None, leg: LegSpan) -> None:
        self.trace_id = trace_id
        self._leg = leg

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan:
        return self._leg

    def route(self, route: str, reason: str) -> None:
        pass

    def end(self, status: int, outcome: str) -> None:
        pass


NO_SPANS: RequestSpans = _Unrecorded(None, _NoLeg())


def _with_traceparent(headers: dict[str, str], traceparent: str, tracestate: str) -> dict[str, str]:
    out = dict(headers)
    out["traceparent"] = traceparent
    out.pop("tracestate", None)
    if tracestate:
        out["tracestate"] = tracestate
    return out


class _UnsampledLeg:
    """Every attempt of an unsampled request: no span, and one `traceparent` (flag 00) for
    all of them, naming the request's unrecorded span, as a server span that makes no
    client spans passes its own id to every call it makes; an engine records none of them."""

    __slots__ = ("_given", "_made", "_traceparent", "_tracestate")

    def __init__(self, traceparent: str, tracestate: str) -> None:
        self._traceparent = traceparent
        self._tracestate = tracestate
        self._given: dict[str, str] | None = None
        self._made: dict[str, str] = {}

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        # Both legs usually send the request's own headers: one copy serves them.
        if headers is not self._given:
            self._given, self._made = headers, _with_traceparent(headers, self._traceparent, self._tracestate)
        return self._made

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        pass


def _unsampled(trace_id: str, tracestate: str = "", flags: str = "00") -> RequestSpans:
    """An unsampled request: its legs carry its trace (flag 00; the client's own flag when
    the SDK is disabled) under a fresh span id, as the SDK gives a span it does not record."""
    return _Unrecorded(trace_id, _UnsampledLeg(f"00-{trace_id}-{random.getrandbits(64) or 1:016x}-{flags}", tracestate))


class _Recorder:
    """What a recorded request's spans are made of, the SDK's parts: its resource, scope,
    span ids, and the batch processor the finished spans go to."""

    def __init__(self, service_name: str, processor: SpanProcessor) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self.resource = Resource.create({"service.name": service_name})
        self.scope = InstrumentationScope(_SCOPE)
        self.processor = processor
        self.span_id = RandomIdGenerator().generate_span_id
        self.context, self.readable = SpanContext, ReadableSpan
        self.server, self.client = SpanKind.SERVER, SpanKind.CLIENT
        self.sampled = TraceFlags(TraceFlags.SAMPLED)
        self.random_sampled = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
        self.unset = Status(StatusCode.UNSET)
        self._status, self._error = Status, StatusCode.ERROR

    def status(self, failure: str | None) -> Status:
        """A span's status: unset, or an error that says what failed."""
        return self.unset if failure is None else self._status(self._error, failure)

    def finish(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, str | int],
        failure: str | None,
        start: int,
        end: int,
    ) -> None:
        """Hand the span, ended at `end`, to the batch processor, as the SDK's `Span.end` does."""
        self.processor.on_end(
            self.readable(
                name,
                context,
                parent,
                self.resource,
                attributes,
                kind=kind,
                status=self.status(failure),
                start_time=start,
                end_time=end,
                instrumentation_scope=self.scope,
            )
        )


class _Leg:
    """An attempt of a recorded request: a client span, built when the request's own span is
    (or when the attempt ends, if that is later)."""

    __slots__ = ("_attributes", "_failure", "_name", "_request", "_span_id", "_start", "_traceparent", "ended")

    def __init__(self, request: _Recorded, name: str, span_id: int, attributes: dict[str, str | int]) -> None:
        self._request = request
        self._name = name
        self._span_id = span_id
        self._traceparent = f"00-{request.trace_id}-{span_id:016x}-01"
        self._attributes = attributes
        self._start = time.time_ns()
        self._failure: str | None = None  # what failed, for the span's error status
        self.ended: int | None = None

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        return _with_traceparent(headers, self._traceparent, self._request.tracestate)

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        if self.ended is not None:
            return
        self.ended = time.time_ns()
        if verdict is not True:
            self._failure = detail or "attempt failed"
        if self._request.context is not None:  # the request's span is out already
            self.finish(self._request.context)

    def finish(self, parent: SpanContext) -> None:
        """Hand the ended attempt's span, under the request's span `parent`, to the processor."""
        assert self.ended is not None, "an attempt's span is built once it has ended"
        recorder = self._request.recorder
        context = recorder.context(parent.trace_id, self._span_id, False, parent.trace_flags, parent.trace_state)
        recorder.finish(
            self._name, context, parent, recorder.client, self._attributes, self._failure, self._start, self.ended
        )


class _Recorded:
    """A recorded request: its server span (under the client's `parent` if it sent one) and
    a client span per attempt.

    Invariant: only ids, times and attributes are kept while the request runs; the SDK's
    span objects are built when the request's span ends, which the flow does after the
    answer's last bytes are written, so building them (most of a recorded request's
    tracing cost) is not in the request's latency. `context` is None until then.
    """

    __slots__ = (
        "_attributes",
        "_flags",
        "_legs",
        "_name",
        "_parent",
        "_span_id",
        "_start",
        "_trace_state",
        "context",
        "recorder",
        "trace_id",
        "tracestate",
    )

    def __init__(
        self,
        recorder: _Recorder,
        name: str,
        trace_id: int,
        flags: TraceFlags,
        trace_state: TraceState | None,
        parent: SpanContext | None,
    ) -> None:
        self.recorder = recorder
        self._name = name
        self._span_id = recorder.span_id()
        self._flags = flags
        self._trace_state = trace_state
        self._parent = parent
        self.tracestate = trace_state.to_header() if trace_state else ""
        self.trace_id = f"{trace_id:032x}"  # what the legs' `traceparent`s say
        self._attributes: dict[str, str | int] = {}
        self._legs: list[_Leg] = []
        self._start = time.time_ns()
        self.context: SpanContext | None = None

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan:
        attributes: dict[str, str | int] = {
            "pdconnect.role": role,
            "pdconnect.engine": engine,
            "pdconnect.attempt": attempt,
        }
        leg = _Leg(self, role, self.recorder.span_id(), attributes)
        self._legs.append(leg)
        return leg

    def route(self, route: str, reason: str) -> None:
        self._attributes["pdconnect.route"] = route
        self._attributes["pdconnect.route_reason"] = reason

    def end(self, status: int, outcome: str) -> None:
        if self.context is not None:
            return
        ended = time.time_ns()
        recorder = self.recorder
        self.context = context = recorder.context(
            int(self.trace_id, 16), self._span_id, False, self._flags, self._trace_state
        )
        legs, self._legs = self._legs, []  # a leg refers to its request: no cycle left for the collector
        for leg in legs:  # the attempts first, in order, as they ended before the request
            if leg.ended is not None:
                leg.finish(context)
        self._attributes["http.response.status_code"] = status
        self._attributes["pdconnect.outcome"] = outcome
        failure = outcome if status >= 500 else None
        recorder.finish(
            self._name, context, self._parent, recorder.server, self._attributes, failure, self._start, ended
        )


# --- OTLP's protobuf for the SDK's spans, written by hand -------------------------------
# The SDK's exporter builds each span through opentelemetry-proto's generated classes: 22
# us a span (cProfile, 3 spans a request), more than recording it. `_span_bytes` writes
# the same message (trace.proto's field numbers) in about 7 us; spans it does not cover
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
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags' masks, as the SDK's encoder sets them
# flags = 16 (fixed32), with and without a remote parent.
_FLAGS = {
    False: b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE),
    True: b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE | _IS_REMOTE),
}

_PIECES_KEPT = 4096  # encoded pieces cached (names, statuses, attributes: few distinct in the router's spans)


def _span_bytes(span: ReadableSpan, pieces: dict[tuple[object, ...], bytes]) -> bytes | None:
    """One `Span` message, or None when the span holds what this does not write; `pieces`
    caches what repeats from span to span: name and kind, attributes (by type too: True
    and 1 are equal keys), status."""
    if span.events or span.links:
        return None
    context, parent = span.context, span.parent
    assert context is not None and span.start_time is not None and span.end_time is not None
    if len(pieces) >= _PIECES_KEPT:
        pieces.clear()
    parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
    if context.trace_state:
        parts.append(_field(3, ",".join(f"{key}={value}" for key, value in context.trace_state.items()).encode()))
    if parent is not None:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    kind = span.kind.value
    head = pieces.get(("name", span.name, kind))
    if head is None:
        head = pieces[("name", span.name, kind)] = _field(5, span.name.encode()) + b"\x30" + _varint(_KINDS[kind])
    parts += (head, struct.pack("<BQBQ", 0x39, span.start_time, 0x41, span.end_time))
    for key, value in (span.attributes or {}).items():
        cache_key = (key, type(value), value)
        attribute = pieces.get(cache_key) if isinstance(value, (str, int, float)) else None
        if attribute is None:
            encoded = _any_value(value)
            if encoded is None:
                return None
            attribute = _field(9, _field(1, key.encode()) + _field(2, encoded))
            if isinstance(value, (str, int, float)):
                pieces[cache_key] = attribute
        parts.append(attribute)
    for number, count in ((10, span.dropped_attributes), (12, span.dropped_events), (14, span.dropped_links)):
        if count:
            parts += (_varint(number << 3), _varint(count))
    status = span.status
    status_key = ("status", status.status_code.value, status.description)
    encoded_status = pieces.get(status_key)
    if encoded_status is None:
        message = _field(2, status.description.encode()) if status.description else b""
        code = b"\x18" + _varint(status.status_code.value) if status.status_code.value else b""
        encoded_status = pieces[status_key] = _field(15, message + code)
    parts += (encoded_status, _FLAGS[parent is not None and parent.is_remote])
    return b"".join(parts)


class _Encoded:
    """What the exporter encoded before: resources' and scopes' fields, spans' repeated pieces."""

    def __init__(self) -> None:
        self.heads: dict[int, tuple[object, bytes]] = {}
        self.pieces: dict[tuple[object, ...], bytes] = {}


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
        encoded = _span_bytes(span, cache.pieces)
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
    """The router's tracer: the SDK's parent-based ratio sampler, span ids, batch processor and OTLP/HTTP exporter.

    `exporter` replaces the OTLP/HTTP one (tests, benchmarks: an in-memory or null exporter).

    Invariant: a request is decided once, in `start`, by one sampler
    (`ParentBased(TraceIdRatioBased(ratio))`): on the client's span context when it sent a
    valid one, else on a trace id drawn here, which the request then carries, recorded or
    not. A recorded request's spans are the SDK's finished `ReadableSpan`s, built when the
    request's span ends (`_Recorded.end`, after the answer is written) and handed to the
    batch processor as the SDK's `Span.end` does: the live `Span` (a lock, attribute
    checks and limits, processor calls at start) guards against what cannot happen here
    (spans of a fixed shape, started and ended on the event loop's thread, never seen by
    other code) and cost most of a recorded request (docs/router.md, "What tracing
    costs"). `tests/test_router_tracing.py` checks the spans equal, field for field, those
    the SDK's own tracer makes for the same request.
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
        from opentelemetry.sdk.environment_variables import OTEL_SDK_DISABLED
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import Decision, ParentBased, TraceIdRatioBased
        from opentelemetry.trace import get_current_span
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.ratio = ratio
        # As the SDK's TracerProvider: with the SDK disabled nothing is recorded (the
        # context still travels, the client's flag with it).
        self._disabled = os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true"
        # One rule: ParentBased hands a request without a parent to its root sampler, which
        # `start` asks directly for those (one call less per request).
        self._root = TraceIdRatioBased(ratio)
        self._sampler = ParentBased(self._root)
        self._bound, self._low_bits = self._root.bound, self._root.TRACE_ID_LIMIT
        self._kept = Decision.RECORD_AND_SAMPLE
        self._processor = BatchSpanProcessor(exporter or _otlp_exporter(endpoint))
        self._recorder = _Recorder(service_name, self._processor)
        self._extract = TraceContextTextMapPropagator().extract
        self._getter: Any = DefaultGetter()
        self._span_of = get_current_span

    def start(self, headers: Mapping[str, str], name: str) -> RequestSpans:
        """The request's spans: a child of the client's trace context if it sent a valid one."""
        if "traceparent" not in headers:
            trace_id = random.getrandbits(128) or 1
            if self._disabled or self.drops(trace_id):
                return _unsampled(f"{trace_id:032x}")
            return self._recorded(None, None, trace_id, name)
        # W3C's rules (version, all-zero ids, tracestate) are the propagator's; none valid: a new trace.
        parent_context = self._extract(headers, getter=self._getter)
        parent = self._span_of(parent_context).get_span_context()
        if not parent.is_valid:
            return self.start({}, name)
        if self._disabled:
            carried = "01" if parent.trace_flags.sampled else "00"
            return _unsampled(f"{parent.trace_id:032x}", parent.trace_state.to_header(), carried)
        return self._recorded(parent_context, parent, parent.trace_id, name)

    def drops(self, trace_id: int) -> bool:
        """Whether the root sampler drops a request without a parent: TraceIdRatioBased's own
        rule on its own bound, asked here without building its `SamplingResult` and looking up
        a parent context there is none of (a third of an unrecorded request's tracing cost).
        `tests/test_router_tracing.py` holds it to the sampler's answer."""
        return trace_id & self._low_bits >= self._bound

    def _recorded(
        self, parent_context: Context | None, parent: SpanContext | None, trace_id: int, name: str
    ) -> RequestSpans:
        recorder = self._recorder
        if parent is None:  # `drops` kept it: the root sampler's answer, which keeps no tracestate
            return _Recorded(recorder, name, trace_id, recorder.random_sampled, None, None)
        sampled = self._sampler.should_sample(parent_context, trace_id, name, recorder.server)
        if sampled.decision is not self._kept:
            return _unsampled(f"{trace_id:032x}", sampled.trace_state.to_header() if sampled.trace_state else "")
        # The flags the SDK's tracer gives a span: sampled, and the random-id bit of a new
        # trace (ours are random) or the parent's.
        flags = recorder.random_sampled if parent.trace_flags.random_trace_id else recorder.sampled
        return _Recorded(recorder, name, trace_id, flags, sampled.trace_state, parent)

    def close(self) -> None:
        """Export what is buffered, then stop (blocking)."""
        self._processor.shutdown()  # type: ignore[no-untyped-call]
