"""A local OTLP/HTTP trace receiver for tests: collects the spans that routers and vLLM engines export.

It answers `POST /v1/traces` (protobuf `ExportTraceServiceRequest`, as the OpenTelemetry
SDK's OTLP/HTTP exporter sends it) on 127.0.0.1 and keeps every span with its service
name, ids, attributes and status, decoded by OpenTelemetry's own protobuf types.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

__all__ = ["OtlpReceiver", "ReceivedSpan", "otlp_receiver"]


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any]
    error: bool


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _spans_of(body: bytes) -> list[ReceivedSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        spans.extend(
            ReceivedSpan(
                service=str(resource.get("service.name", "")),
                name=span.name,
                trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(),
                parent_span_id=span.parent_span_id.hex(),
                attributes={a.key: _value(a.value) for a in span.attributes},
                error=span.status.code == Status.STATUS_CODE_ERROR,
            )
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        )
    return spans


class OtlpReceiver:
    """The spans received so far; `url` is the endpoint to configure."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]


def otlp_server(take: Callable[[bytes], None]) -> ThreadingHTTPServer:
    """An OTLP/HTTP server on a free port of 127.0.0.1 (not yet serving) that hands each
    export's body to `take`: answered 200, or 400 when `take` raises DecodeError."""

    class Handler(BaseHTTPRequestHandler):
        # Keep-alive, as a collector's HTTP server: an exporter reuses its connection (with
        # HTTP/1.0 each export opened one, a cost no deployment pays).
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                take(body)
                self.send_response(200)
            except DecodeError:  # a body we cannot read: the exporter is told, the test sees no spans
                self.send_response(400)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """Serve a receiver on a free port of 127.0.0.1 until the block ends."""
    receiver: OtlpReceiver | None = None

    def take(body: bytes) -> None:
        assert receiver is not None
        receiver.add(_spans_of(body))

    server = otlp_server(take)
    receiver = OtlpReceiver(f"http://127.0.0.1:{server.server_address[1]}/v1/traces")
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
