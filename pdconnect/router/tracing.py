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
An unsampled request costs no SDK span below its root: its legs still carry a
`traceparent` (flag 00) of the same trace, so the engines do not sample it either.
docs/router.md ("Tracing") has what each costs per request.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
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
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.ratio = ratio
        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(ratio)),
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint)))
        self._sdk = _Sdk(self._provider.get_tracer(_SCOPE))
        self._extract = TraceContextTextMapPropagator().extract
        self._getter: Any = DefaultGetter()

    def start(self, headers: Mapping[str, str], name: str) -> RequestSpans:
        """The request's server span, a child of the client's trace context if it sent a valid one."""
        # W3C's rules (version, all-zero ids, tracestate) are the propagator's; no header: a new trace.
        parent = self._extract(headers, getter=self._getter) if "traceparent" in headers else None
        sdk = self._sdk
        return _Spans(sdk, sdk.tracer.start_span(name, context=parent, kind=sdk.server))

    def close(self) -> None:
        """Export what is buffered, then stop (blocking)."""
        self._provider.shutdown()
