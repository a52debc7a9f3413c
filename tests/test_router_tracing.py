"""The router's OpenTelemetry spans: request, route, one span per attempt, and engines parented under the attempt.

FAKE engines record the `traceparent` each attempt carried; spans go to a local OTLP
receiver (`tests/otlp_receiver.py`). The same check against real vLLM engines exporting
their own spans is in tests/test_router_engines.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdconnect.router import ConfigError, load_config
from pdconnect.router.app import Router
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.router_support import COMPLETION
from tests.waiting import wait_until_async

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
    with otlp_receiver() as running:
        yield running


def _at_least(receiver: OtlpReceiver, count: int) -> list[ReceivedSpan]:
    """The client's trace once it has `count` spans, else nothing."""
    spans = receiver.spans(CLIENT_TRACE)
    return spans if len(spans) >= count else []


def _by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


@pytest.mark.asyncio
async def test_a_request_is_one_trace_from_the_client_through_both_legs(make, receiver: OtlpReceiver) -> None:
    s = await make(otlp_traces_endpoint=receiver.url)
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"traceparent": TRACEPARENT})
    assert status == 200
    spans = await wait_until_async(lambda: _at_least(receiver, 3), "the router's request and leg spans")
    names = _by_name(spans)
    [root], [prefill], [decode] = names["POST /v1/completions"], names["prefill"], names["decode"]
    assert {span.service for span in spans} == {"pdconnect-router"}
    assert root.parent_span_id == CLIENT_PARENT
    assert prefill.parent_span_id == root.span_id == decode.parent_span_id
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["pdconnect.outcome"] == "ok"
    assert (prefill.attributes["pdconnect.engine"], decode.attributes["pdconnect.engine"]) == (s.p[0].url, s.d[0].url)
    # Each engine got its own attempt's span as parent: its spans nest under it.
    assert s.p[0].seen[-1].traceparent == f"00-{CLIENT_TRACE}-{prefill.span_id}-01"
    assert s.d[0].seen[-1].traceparent == f"00-{CLIENT_TRACE}-{decode.span_id}-01"


@pytest.mark.asyncio
async def test_each_prefill_attempt_is_a_span_of_its_own(make, receiver: OtlpReceiver) -> None:
    """Both prefill engines fail once: two failed attempt spans, one per engine, then the
    decode leg (decode-only fallback) succeeds."""
    s = await make(prefill=2, otlp_traces_endpoint=receiver.url)
    for fake in s.p:
        fake.faults.fail_next = 1
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"traceparent": TRACEPARENT})
    assert status == 200
    spans = await wait_until_async(lambda: _at_least(receiver, 4), "four spans")
    names = _by_name(spans)
    attempts = sorted(names["prefill"], key=lambda span: span.attributes["pdconnect.attempt"])
    assert [(a.attributes["pdconnect.attempt"], a.error) for a in attempts] == [(0, True), (1, True)]
    assert {a.attributes["pdconnect.engine"] for a in attempts} == {fake.url for fake in s.p}
    [decode] = names["decode"]
    assert not decode.error


@pytest.mark.asyncio
async def test_a_fallback_is_recorded_as_the_route(make, receiver: OtlpReceiver) -> None:
    s = await make(otlp_traces_endpoint=receiver.url, prefill_attempts=1)
    s.p[0].faults.status = 503
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"traceparent": TRACEPARENT})
    assert status == 200
    [root] = await wait_until_async(
        lambda: [span for span in receiver.spans(CLIENT_TRACE) if span.name.startswith("POST")], "the request span"
    )
    assert (root.attributes["pdconnect.route"], root.attributes["pdconnect.route_reason"]) == (
        "fallback",
        "prefill_failed",
    )


def test_an_endpoint_without_the_sdk_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    config = load_config({"decode": ["http://127.0.0.1:1"], "otlp_traces_endpoint": "http://127.0.0.1:1/v1/traces"})
    with pytest.raises(ConfigError, match=r"pdconnect\[otel\]"):
        Router(config)


@pytest.mark.parametrize(("tracing", "forwarded"), [(False, True), (True, False)])
def test_the_router_starts_a_trace_context_only_when_its_own_spans_do_not(tracing: bool, forwarded: bool) -> None:
    """Without a client `traceparent`, the router without tracing starts one both legs share;
    with tracing each attempt's span sets the leg's own, so none is made here for nothing."""
    from pdconnect.router.breaker import CircuitBreaker
    from pdconnect.router.engines import EngineRegistry, Role
    from pdconnect.router.pools import Pool, Pools
    from pdconnect.router.request import Endpoint, parse_call

    registry = EngineRegistry(lambda: CircuitBreaker(3, 10.0), probed=False)
    registry.add(Role.PREFILL, "http://127.0.0.1:1", "test")
    registry.add(Role.DECODE, "http://127.0.0.1:2", "test")
    pools = Pools([Pool("default", (), registry, None, {})])
    call = parse_call(
        b'{"prompt": "a", "max_tokens": 1}', Endpoint.COMPLETIONS, {}, 0.0, pools=pools, key_of=None, tracing=tracing
    )
    assert ("traceparent" in call.headers) == forwarded
    assert (len(call.trace_id) == 32) == forwarded
    # A client's own context is forwarded either way: its tracestate rides along.
    client = parse_call(
        b'{"prompt": "a"}',
        Endpoint.COMPLETIONS,
        {"traceparent": TRACEPARENT, "tracestate": "k=v"},
        0.0,
        pools=pools,
        key_of=None,
        tracing=tracing,
    )
    assert (client.headers["traceparent"], client.headers["tracestate"], client.trace_id) == (
        TRACEPARENT,
        "k=v",
        CLIENT_TRACE,
    )


@pytest.mark.asyncio
async def test_without_a_client_trace_each_leg_carries_its_attempt_span(make, receiver: OtlpReceiver) -> None:
    s = await make(otlp_traces_endpoint=receiver.url)
    status, _, _ = await s.post("/v1/completions", COMPLETION)
    assert status == 200
    legs = [s.p[0].seen[-1].traceparent, s.d[0].seen[-1].traceparent]
    assert all(leg is not None for leg in legs)
    trace_id = str(legs[0]).split("-")[1]

    def spans() -> list[ReceivedSpan]:
        found = receiver.spans(trace_id)
        return found if len(found) >= 3 else []

    names = _by_name(await wait_until_async(spans, "the request's three spans"))
    [root], [prefill], [decode] = names["POST /v1/completions"], names["prefill"], names["decode"]
    assert not root.parent_span_id  # the router's span began the trace
    # Version, trace and parent (the flags are the SDK's: sampled, maybe random-id).
    assert [str(leg).rsplit("-", 1)[0] for leg in legs] == [
        f"00-{trace_id}-{span.span_id}" for span in (prefill, decode)
    ]


@pytest.mark.asyncio
async def test_unsampled_requests_record_no_span_but_carry_the_trace_to_both_legs(make, receiver: OtlpReceiver) -> None:
    """Ratio 0: a request without a client context is not recorded, and its legs tell the
    engines so (flag 00, one trace id); a client's sampled flag still decides for its own."""
    s = await make(otlp_traces_endpoint=receiver.url, otlp_traces_sample_ratio=0.0)
    status, _, _ = await s.post("/v1/completions", COMPLETION)
    assert status == 200
    legs = [str(s.p[0].seen[-1].traceparent), str(s.d[0].seen[-1].traceparent)]
    version, unsampled, _, flags = legs[0].split("-")
    assert (version, flags) == ("00", "00")
    # One trace, one parent id: the request's unrecorded span, which makes no client spans.
    assert legs[1] == legs[0]
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"traceparent": TRACEPARENT})
    assert status == 200
    await wait_until_async(lambda: _at_least(receiver, 3), "the sampled client's three spans")
    # Exported in order, the first request's spans would have come with or before these.
    assert receiver.spans(unsampled) == []


@pytest.mark.asyncio
async def test_a_client_that_did_not_sample_is_not_recorded(make, receiver: OtlpReceiver) -> None:
    s = await make(otlp_traces_endpoint=receiver.url)  # ratio 1.0: the client's flag still wins
    unsampled = f"00-{CLIENT_TRACE[::-1]}-{CLIENT_PARENT}-00"
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"traceparent": unsampled})
    assert status == 200
    assert str(s.d[0].seen[-1].traceparent).startswith(f"00-{CLIENT_TRACE[::-1]}-")
    assert str(s.d[0].seen[-1].traceparent).endswith("-00")
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"traceparent": TRACEPARENT})
    assert status == 200
    await wait_until_async(lambda: _at_least(receiver, 3), "the sampled client's three spans")
    assert receiver.spans(CLIENT_TRACE[::-1]) == []


def test_the_sample_ratio_comes_from_the_flag_then_the_environment() -> None:
    from pdconnect.router.tracing import TracingUnavailable, sample_ratio

    assert sample_ratio(0.25, {"OTEL_TRACES_SAMPLER_ARG": "0.5"}) == 0.25
    assert sample_ratio(None, {"OTEL_TRACES_SAMPLER_ARG": "0.5"}) == 0.5
    assert sample_ratio(None, {}) == 1.0
    for bad in ("2", "half"):
        with pytest.raises(TracingUnavailable, match="OTEL_TRACES_SAMPLER_ARG"):
            sample_ratio(None, {"OTEL_TRACES_SAMPLER_ARG": bad})
    with pytest.raises(ConfigError, match="otlp_traces_sample_ratio"):
        load_config({"decode": ["http://127.0.0.1:1"], "otlp_traces_sample_ratio": 1.5})


def test_the_hand_written_otlp_encoding_equals_the_sdks_own() -> None:
    """The exporter writes OTLP's protobuf by hand; parsed, it must be the very message the
    SDK's encoder builds from the same spans: the router's (server, client, remote parent,
    tracestate, error status, each attribute type) and spans it hands to the SDK's encoder
    (events, array attributes)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdconnect.router.tracing import Tracing, _Encoded, _export_request

    memory = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9/v1/traces", exporter=memory)
    spans = tracing.start({"traceparent": TRACEPARENT, "tracestate": "k=v,o=2"}, "POST /v1/completions")
    spans.route("pd", "affinity")
    spans.leg("prefill", "http://p:1", 0).end(False, "refused")
    spans.leg("decode", "http://d:1", 1).end(True)
    spans.end(503, "no_engine")
    tracing.start({}, "GET /v1/models").end(200, "ok")  # a root of its own: no parent, no tracestate
    tracing.close()
    elsewhere = InMemorySpanExporter()  # `memory` stopped with the router's provider
    other = TracerProvider()
    other.add_span_processor(SimpleSpanProcessor(elsewhere))
    with other.get_tracer(
        "elsewhere", "1.0", schema_url="https://opentelemetry.io/schemas/1.21.0"
    ).start_as_current_span("odd", attributes={"list": [1, 2], "f": 0.5, "neg": -7, "b": False, "empty": ""}) as odd:
        odd.add_event("an event", {"x": 1})
    with other.get_tracer("elsewhere").start_as_current_span("plain", attributes={"f": 0.5, "neg": -7, "b": False}):
        pass
    finished = [*memory.get_finished_spans(), *elsewhere.get_finished_spans()]
    assert [span.name for span in finished] == [
        "prefill",
        "decode",
        "POST /v1/completions",
        "GET /v1/models",
        "odd",
        "plain",
    ]
    cache = _Encoded()
    for _ in range(2):  # the second time from the cached resource and scope heads, and attributes
        ours = ExportTraceServiceRequest.FromString(_export_request(finished, cache))
        assert ours == encode_spans(finished)
    assert len(cache.heads) == 5  # two resources, three scopes


def test_a_request_without_a_client_trace_is_sampled_by_its_trace_id() -> None:
    """Ratio 0.5: which requests are recorded follows OpenTelemetry's TraceIdRatioBased rule
    on the very trace id the request carries (its low 64 bits below 0.5 * 2**64), the one
    both legs and, for a recorded request, its spans carry; unrecorded legs say flag 00.
    Half of them are recorded: a decision drawn apart from the recorded span's trace id
    would record a quarter (2000 requests: 0.5 +- 0.011, the bounds are 9 deviations off)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdconnect.router.tracing import Tracing

    memory = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9/v1/traces", ratio=0.5, exporter=memory)
    carried: dict[str, str] = {}
    for _ in range(2000):
        spans = tracing.start({}, "POST /v1/completions")
        leg = spans.leg("decode", "http://d:1", 0)
        traceparent = leg.inject({})["traceparent"]
        leg.end(True)
        spans.end(200, "ok")
        assert spans.trace_id is not None and traceparent.split("-")[1] == spans.trace_id
        carried[spans.trace_id] = traceparent.split("-")[3]
    tracing.close()
    expected = {trace for trace in carried if int(trace, 16) % 2**64 < 2**63}
    recorded = {format(span.context.trace_id, "032x") for span in memory.get_finished_spans()}
    assert 0.4 < len(expected) / len(carried) < 0.6
    assert recorded == expected
    assert {trace for trace, flags in carried.items() if flags == "01"} == expected


@pytest.mark.parametrize("ratio", [0.0, 1e-12, 0.1, 0.5, 0.999, 1.0])
def test_the_quick_drop_is_the_ratio_samplers_own_decision(ratio: float) -> None:
    """`Tracing.drops` (asked for every request without a client trace) answers what the
    SDK's TraceIdRatioBased decides for it, on random trace ids and at the edges of its
    bound, with the high 64 bits set or not (the sampler reads only the low ones)."""
    import random

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

    from pdconnect.router.tracing import Tracing

    tracing = Tracing("http://127.0.0.1:9/v1/traces", ratio=ratio, exporter=InMemorySpanExporter())
    sampler = TraceIdRatioBased(ratio)
    low = [random.getrandbits(64) for _ in range(3000)]
    low += [v for b in (sampler.bound - 1, sampler.bound, sampler.bound + 1) for v in (b,) if 0 <= v < 2**64]
    low += [0, 1, 2**64 - 1]
    ids = [high << 64 | v for v in low for high in (0, random.getrandbits(64), 2**64 - 1)]
    try:
        decided = [sampler.should_sample(None, trace_id, "POST /v1/completions").decision for trace_id in ids]
        assert [tracing.drops(trace_id) for trace_id in ids] == [d is Decision.DROP for d in decided]
    finally:
        tracing.close()


def _normalized(spans: list[Any]) -> Any:
    """`spans` as the SDK's encoder writes them, ids renamed in order of appearance, times zeroed."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    message = encode_spans(spans)
    names: dict[bytes, bytes] = {}

    def rename(raw: bytes) -> bytes:
        return names.setdefault(raw, len(names).to_bytes(len(raw), "big")) if raw else raw

    for resource in message.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                span.trace_id, span.span_id = rename(span.trace_id), rename(span.span_id)
                span.parent_span_id = rename(span.parent_span_id)
                span.start_time_unix_nano = span.end_time_unix_nano = 0
    return message


def test_recorded_spans_are_the_ones_the_sdks_own_tracer_makes() -> None:
    """The router builds a recorded request's spans as finished SDK spans; the SDK's own
    tracer, given the same request (client parent with a tracestate, a failed and a served
    attempt, a 5xx end, then a request without a client trace), must make the same spans:
    same message once encoded (ids and times aside), same trace flags, and each leg's
    `traceparent` naming its span."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from pdconnect.router.tracing import Tracing

    client = {"traceparent": TRACEPARENT, "tracestate": "k=v,o=2"}
    memory = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9/v1/traces", exporter=memory)
    spans = tracing.start(client, "POST /v1/completions")
    spans.route("pd", "affinity")
    refused = spans.leg("prefill", "http://p:1", 0)
    refused_parent = refused.inject({})["traceparent"]
    refused.end(False, "refused")
    served = spans.leg("decode", "http://d:1", 1)
    served_parent = served.inject({})["traceparent"]
    served.end(True)
    spans.route("fallback", "prefill_failed")
    spans.end(503, "no_engine")
    tracing.start({}, "GET /v1/models").end(200, "ok")
    tracing.close()
    ours = list(memory.get_finished_spans())

    sdk_memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "pdconnect-router"}))
    provider.add_span_processor(SimpleSpanProcessor(sdk_memory))
    tracer = provider.get_tracer("pdconnect.router")
    root = tracer.start_span(
        "POST /v1/completions", context=TraceContextTextMapPropagator().extract(client), kind=SpanKind.SERVER
    )
    root.set_attributes({"pdconnect.route": "pd", "pdconnect.route_reason": "affinity"})
    for role, engine, attempt, status in (
        ("prefill", "http://p:1", 0, Status(StatusCode.ERROR, "refused")),
        ("decode", "http://d:1", 1, None),
    ):
        leg = tracer.start_span(
            role,
            context=set_span_in_context(root),
            kind=SpanKind.CLIENT,
            attributes={"pdconnect.role": role, "pdconnect.engine": engine, "pdconnect.attempt": attempt},
        )
        if status is not None:
            leg.set_status(status)
        leg.end()
    root.set_attributes({"pdconnect.route": "fallback", "pdconnect.route_reason": "prefill_failed"})
    root.set_attributes({"http.response.status_code": 503, "pdconnect.outcome": "no_engine"})
    root.set_status(Status(StatusCode.ERROR, "no_engine"))
    root.end()
    other = tracer.start_span("GET /v1/models", kind=SpanKind.SERVER)
    other.set_attributes({"http.response.status_code": 200, "pdconnect.outcome": "ok"})
    other.end()
    provider.shutdown()
    theirs = list(sdk_memory.get_finished_spans())

    assert _normalized(ours) == _normalized(theirs)
    assert [span.context.trace_flags for span in ours] == [span.context.trace_flags for span in theirs]
    prefill, decode = ours[0], ours[1]
    assert refused_parent == f"00-{CLIENT_TRACE}-{prefill.context.span_id:016x}-01"
    assert served_parent == f"00-{CLIENT_TRACE}-{decode.context.span_id:016x}-01"


def test_a_recorded_requests_spans_are_built_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SDK span is built or handed to the batch processor while a recorded request runs
    (that work would sit in the request's latency): its attempts' spans and its own go
    over when the request's span ends, attempts first, each attempt's span covering its
    own start and end; an attempt that ends after its request is handed over when it
    does, still under the request's span."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdconnect.router.tracing import Tracing

    handed: list[ReadableSpan] = []
    monkeypatch.setattr(BatchSpanProcessor, "on_end", lambda self, span: handed.append(span))
    tracing = Tracing("http://127.0.0.1:9/v1/traces", exporter=InMemorySpanExporter())
    try:
        spans = tracing.start({"traceparent": TRACEPARENT}, "POST /v1/completions")
        prefill = spans.leg("prefill", "http://p:1", 0)
        prefill.end(True)
        decode = spans.leg("decode", "http://d:1", 0)
        decode.end(False, "stream broke")
        late = spans.leg("decode", "http://d:2", 1)  # still running when the request ends
        assert handed == []
        spans.end(200, "ok")
        assert [span.name for span in handed] == ["prefill", "decode", "POST /v1/completions"]
        request = handed[2]
        assert all(span.parent == request.context for span in handed[:2])
        first_end, second_start = handed[0].end_time, handed[1].start_time
        assert first_end is not None and second_start is not None
        assert first_end <= second_start  # each attempt's own times
        assert handed[1].status.description == "stream broke"
        late.end(True)
        assert [span.name for span in handed] == ["prefill", "decode", "POST /v1/completions", "decode"]
        assert handed[3].parent == request.context
        assert dict(handed[3].attributes or {}) == {
            "pdconnect.role": "decode",
            "pdconnect.engine": "http://d:2",
            "pdconnect.attempt": 1,
        }
        late.end(False)  # a second end hands nothing more over
        assert len(handed) == 4
    finally:
        tracing.close()


def test_an_ended_recorded_request_leaves_no_cycle_for_the_collector() -> None:
    """A recorded request and its attempts refer to each other while it runs; once it has
    ended they are freed by reference counting alone, not left for the garbage collector
    (the router keeps the collector's young generation large and rare)."""
    import gc

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdconnect.router.tracing import Tracing

    tracing = Tracing("http://127.0.0.1:9/v1/traces", exporter=InMemorySpanExporter())
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            spans = tracing.start({}, "POST /v1/completions")
            for role in ("prefill", "decode"):
                leg = spans.leg(role, "http://e:1", 0)
                leg.inject({})
                leg.end(True)
            spans.end(200, "ok")
        del spans, leg
        left = [o for o in gc.get_objects() if type(o).__name__ in ("_Recorded", "_Leg")]
        assert left == []
    finally:
        gc.enable()
        tracing.close()


def test_with_the_sdk_disabled_nothing_is_recorded_and_the_clients_context_still_travels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_SDK_DISABLED=true, as the SDK's own provider honours it: no span, and each leg
    carries the client's trace, its sampled flag and its tracestate."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdconnect.router.tracing import Tracing

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    memory = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9/v1/traces", exporter=memory)
    spans = tracing.start({"traceparent": TRACEPARENT, "tracestate": "k=v"}, "POST /v1/completions")
    leg = spans.leg("decode", "http://d:1", 0)
    headers = leg.inject({})
    leg.end(True)
    spans.end(200, "ok")
    tracing.close()
    assert memory.get_finished_spans() == ()
    assert spans.trace_id == CLIENT_TRACE
    version, trace, span, flags = headers["traceparent"].split("-")
    assert (version, trace, flags) == ("00", CLIENT_TRACE, "01") and span != CLIENT_PARENT
    assert headers["tracestate"] == "k=v"
