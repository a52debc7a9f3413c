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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["NO_SPANS", "LegSpan", "RequestSpans", "Tracing", "TracingUnavailable", "require_sdk"]


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


class _Leg:
    def __init__(self, span: Any, propagator: Any) -> None:
        self._span = span
        self._propagator = propagator

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        from opentelemetry.trace import set_span_in_context

        out = dict(headers)
        out.pop("tracestate", None)  # the propagator writes the span's own
        self._propagator.inject(out, context=set_span_in_context(self._span))
        return out

    def end(self, verdict: bool | None, detail: str | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if verdict is not True:
            self._span.set_status(Status(StatusCode.ERROR, detail or "attempt failed"))
        self._span.end()


class _Spans:
    def __init__(self, tracer: Any, propagator: Any, root: Any) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self._root = root
        self.trace_id: str | None = format(root.get_span_context().trace_id, "032x")

    def leg(self, role: str, engine: str, attempt: int) -> LegSpan:
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self._tracer.start_span(
            role,
            context=set_span_in_context(self._root),
            kind=SpanKind.CLIENT,
            attributes={"pdconnect.role": role, "pdconnect.engine": engine, "pdconnect.attempt": attempt},
        )
        return _Leg(span, self._propagator)

    def route(self, route: str, reason: str) -> None:
        self._root.set_attributes({"pdconnect.route": route, "pdconnect.route_reason": reason})

    def end(self, status: int, outcome: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._root.set_attributes({"http.response.status_code": status, "pdconnect.outcome": outcome})
        if status >= 500:
            self._root.set_status(Status(StatusCode.ERROR, outcome))
        self._root.end()


class Tracing:
    """The router's tracer: an SDK provider exporting in batches to one OTLP/HTTP endpoint."""

    def __init__(self, endpoint: str, service_name: str = "pdconnect-router") -> None:
        require_sdk()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # Our own provider, not the global one: nothing else in the process is affected.
        self._provider: TracerProvider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("pdconnect.router")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, headers: Mapping[str, str], name: str) -> RequestSpans:
        """The request's server span, a child of the client's trace context if it sent one."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract({k.lower(): v for k, v in headers.items() if k.lower().startswith("trace")})
        root = self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
        return _Spans(self._tracer, self._propagator, root)

    def close(self) -> None:
        """Export what is buffered, then stop."""
        self._provider.shutdown()
