"""The router's request flow against FAKE engines (`pdconnect.testbed.fake_engine`): the P/D
happy paths, and every fault the issue names — engine down, slow, answering 500, dropping
the connection before or during the stream, the client leaving — each ending with its
documented outcome, no request hanging, and aborts reaching the engines.

No timing is asserted: timeouts are set short so faults resolve quickly, and every
client call runs under a generous deadline that only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from pdconnect.router import load_config, start_router
from pdconnect.router.engines import Role
from pdconnect.testbed.fake_engine import VLLM_STREAM_ERROR, FakeCluster, FakeEngine
from tests.router_support import CHAT, COMPLETION, HANG, sse_events
from tests.waiting import wait_until_async

pytestmark = pytest.mark.asyncio

# --- the P/D flow --------------------------------------------------------------------------


async def test_completion_goes_prefill_then_decode_with_the_prefill_params(make) -> None:
    s = await make()
    status, headers, body = await s.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "req-1"})
    assert status == 200
    answer = json.loads(body)
    assert answer["choices"][0]["text"] == " t0 t1 t2 t3"
    [prefill_leg] = s.p[0].seen
    assert prefill_leg.request_id == "req-1"
    assert prefill_leg.body["max_tokens"] == 1 and prefill_leg.body["stream"] is False
    assert prefill_leg.body["kv_transfer_params"] == {"do_remote_decode": True}
    [decode_leg] = s.d[0].seen
    # P's params go to D unchanged, and the client's own fields are untouched.
    assert decode_leg.body["kv_transfer_params"]["remote_engine_id"] == "fake-p0"
    assert decode_leg.body["kv_transfer_params"]["remote_request_id"] == "req-1"
    assert decode_leg.body["max_tokens"] == 4
    assert headers["X-PDConnect-Prefill"] == s.p[0].url and headers["X-PDConnect-Decode"] == s.d[0].url
    assert "X-PDConnect-Fallback" not in headers
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="ok") == 1


async def test_client_params_never_reach_decode_and_prefill_params_are_spliced_in_whole(make) -> None:
    s = await make()
    forged = {**COMPLETION, "kv_transfer_params": {"remote_engine_id": "forged", "do_remote_prefill": True}}
    for body in (COMPLETION, forged):
        async with asyncio.timeout(HANG):
            raw = json.dumps(body, indent=1).encode() + b"\n"  # odd spacing: must survive the splice
            async with s.http.post(
                s.router.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
            ) as resp:
                assert resp.status == 200
    for decode_leg, plan in zip(s.d[0].seen, s.p[0].plans):
        assert decode_leg.body["kv_transfer_params"] == plan  # P's, never the client's
        assert {k: v for k, v in decode_leg.body.items() if k != "kv_transfer_params"} == COMPLETION


async def test_prefill_leg_strips_streaming_and_min_tokens_and_caps_chat_tokens(make) -> None:
    s = await make()
    body = {
        **CHAT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "max_completion_tokens": 4,
    }
    status, _, _ = await s.post("/v1/chat/completions", body)
    assert status == 200
    sent = s.p[0].seen[0].body
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    assert sent["stream"] is False and "stream_options" not in sent and "min_tokens" not in sent
    assert s.d[0].seen[0].body["stream_options"] == {"include_usage": True}
    assert s.d[0].seen[0].body["min_tokens"] == 3


async def test_usage_counts_prompt_caching_from_prefill_not_the_transfer(make) -> None:
    # The fake decode engine, like vLLM's, reports the transferred KV as cached tokens.
    s = await make()
    s.p[0].prefill_cached_tokens = 2
    _, _, body = await s.post("/v1/completions", COMPLETION)
    usage = json.loads(body)["usage"]
    assert usage == {
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


@pytest.mark.parametrize("path,request_body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_streaming_relays_every_event_and_true_usage(make, path: str, request_body: dict[str, Any]) -> None:
    s = await make()
    body = {**request_body, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = await s.post(path, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert len(events) == 4 + 2  # four tokens, the usage chunk, [DONE]
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (
        s.count(
            "pdconnect_router_time_to_first_token_seconds_count", endpoint="chat" if "chat" in path else "completions"
        )
        == 1
    )


async def test_a_stream_sends_its_status_line_and_headers_with_its_first_bytes(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each write to the client is a syscall and a wake-up of the client: the head goes
    out with the first events, never alone (aiohttp's StreamResponse writes it alone)."""
    from aiohttp import http_writer

    s = await make()
    port = int(s.router.url.rsplit(":", 1)[1])
    writes: list[bytes] = []
    write, writelines = http_writer.StreamWriter._write, http_writer.StreamWriter._writelines

    def to_client(writer: Any) -> bool:  # the fakes run in this process too
        transport = writer.transport
        return transport is not None and transport.get_extra_info("sockname")[1] == port

    def counted_write(self: Any, chunk: bytes) -> None:
        if to_client(self):
            writes.append(bytes(chunk))
        write(self, chunk)

    def counted_writelines(self: Any, chunks: Any) -> None:
        chunks = list(chunks)
        if to_client(self):
            writes.append(b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(http_writer.StreamWriter, "_write", counted_write)
    monkeypatch.setattr(http_writer.StreamWriter, "_writelines", counted_writelines)
    status, _, raw = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
    assert writes[0].startswith(b"HTTP/1.1 200") and b"data: " in writes[0]


async def test_models_and_health_and_metrics_endpoints(make) -> None:
    s = await make()
    async with s.http.get(s.router.url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "fake-model"
    async with s.http.get(s.router.url + "/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["decode"] == {"routable": 1, "registered": 1}
    await s.post("/v1/completions", COMPLETION)
    async with s.http.get(s.router.url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        "pdconnect_router_requests_total",
        "pdconnect_router_prefill_seconds_bucket",
        "pdconnect_router_decode_seconds_bucket",
        "pdconnect_router_request_seconds_bucket",
        "pdconnect_router_affinity_total",
        "pdconnect_router_engine_healthy",
        "pdconnect_router_engine_in_flight",
    ):
        assert name in text, name


async def test_invalid_json_is_a_400_and_engine_4xx_passes_through(make) -> None:
    s = await make()
    async with s.http.post(s.router.url + "/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400
    s.p[0].faults.status = 400
    status, _, body = await s.post("/v1/completions", COMPLETION)
    assert status == 400 and json.loads(body)["error"]["message"] == "fake 400"
    # A refusal of the request itself is not retried, and no decode engine sees it.
    assert len(s.p[0].seen) == 1 and s.d[0].seen == []
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="rejected") == 1


# --- prefill faults ------------------------------------------------------------------------


async def test_prefill_500_retries_on_another_prefill_engine(make) -> None:
    s = await make(prefill=2, policy="round-robin")
    broken, working = s.p
    broken.faults.status = 500
    # Round-robin starts the two requests at different engines: one of them meets the
    # broken engine first and must be retried on the working one.
    for _ in range(2):
        status, headers, _ = await s.post("/v1/completions", COMPLETION)
        assert status == 200
        assert "X-PDConnect-Fallback" not in headers
        assert headers["X-PDConnect-Prefill"] == working.url
    assert len(broken.seen) == 1 and len(working.seen) == 2
    assert s.count("pdconnect_router_retries_total", role="prefill", reason="http_5xx") == 1


async def test_prefill_down_everywhere_falls_back_to_decode_only(make) -> None:
    s = await make(prefill=2, health_interval=0)
    for engine in s.p:
        await engine.close()  # connection refused
    status, headers, body = await s.post("/v1/completions", COMPLETION)
    assert status == 200 and json.loads(body)["choices"][0]["text"]
    assert headers["X-PDConnect-Fallback"] == "prefill_failed"
    assert headers["X-PDConnect-Prefill"] == "none"
    assert "kv_transfer_params" not in s.d[0].seen[0].body
    assert s.count("pdconnect_router_fallbacks_total", reason="prefill_failed") == 1
    assert s.count("pdconnect_router_retries_total", role="prefill", reason="connect") == 1
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="ok_fallback") == 1


async def test_slow_prefill_times_out_then_falls_back(make) -> None:
    s = await make(prefill_timeout=0.2, prefill_attempts=1)
    s.p[0].faults.delay = 30.0
    status, headers, _ = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    assert headers["X-PDConnect-Fallback"] == "prefill_failed"
    # The timed-out prefill request was abandoned, not left running.
    await wait_until_async(lambda: len(s.p[0].aborted) == 1, "prefill engine saw the abort")


async def test_fallback_off_turns_prefill_failure_into_502(make) -> None:
    s = await make(fallback=False, prefill_attempts=1)
    s.p[0].faults.status = 503
    status, _, body = await s.post("/v1/completions", COMPLETION)
    assert status == 502 and json.loads(body)["error"]["type"] == "PrefillFailed"
    assert s.d[0].seen == []
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="prefill_failed") == 1


async def test_without_any_prefill_engine_requests_are_served_decode_only_unless_fallback_is_off(make) -> None:
    s = await make(health_interval=0.05)
    s.p[0].faults.health_status = 500
    await wait_until_async(lambda: not s.router.router.registry.get(Role.PREFILL, s.p[0].url).routable, "marked down")
    _, headers, _ = await s.post("/v1/completions", COMPLETION)
    assert headers["X-PDConnect-Fallback"] == "no_prefill_engine"
    strict = await make(fallback=False, health_interval=0.05)
    strict.p[0].faults.health_status = 500
    await wait_until_async(
        lambda: not strict.router.router.registry.get(Role.PREFILL, strict.p[0].url).routable, "marked down"
    )
    status, _, body = await strict.post("/v1/completions", COMPLETION)
    assert status == 503 and "prefill" in json.loads(body)["error"]["message"]


# --- decode faults -------------------------------------------------------------------------


async def test_decode_retry_gets_a_fresh_plan_never_the_one_whose_claim_ended(make) -> None:
    # Integrity: the failed decode engine may have claimed or half-pulled the plan, so
    # the retry on another engine must carry a new plan from a new prefill, and the old
    # plan is released.
    s = await make(decode=2, policy="round-robin")
    broken, working = s.d
    broken.faults.status = 500
    for _ in range(2):  # one of the two starts at the broken engine
        status, headers, _ = await s.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200 and headers["X-PDConnect-Decode"] == working.url
    [failed] = broken.seen
    [retried] = [seen for seen in working.seen if seen.request_id == failed.request_id]
    prefill = s.p[0]
    assert len(prefill.plans) == 3  # one per request, one more for the retry
    assert failed.body["kv_transfer_params"] in prefill.plans
    assert retried.body["kv_transfer_params"] in prefill.plans
    assert (
        retried.body["kv_transfer_params"]["remote_request_id"]
        != failed.body["kv_transfer_params"]["remote_request_id"]
    )
    await wait_until_async(
        lambda: failed.body["kv_transfer_params"]["remote_request_id"] in prefill.released_ids(),
        "the abandoned plan was released",
    )
    assert s.count("pdconnect_router_retries_total", role="decode", reason="http_5xx") == 1


async def test_decode_retry_falls_back_to_decode_only_when_the_fresh_prefill_fails(make) -> None:
    s = await make(decode=2, policy="round-robin", prefill_attempts=1)
    broken, working = s.d  # round-robin's first request starts at the first engine
    broken.faults.status = 500
    s.p[0].faults.answer_only = 1  # the first plan, then 500 for the fresh prefill
    status, headers, _ = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200 and headers["X-PDConnect-Decode"] == working.url
    assert headers["X-PDConnect-Fallback"] == "prefill_failed"
    [failed] = broken.seen
    [retried] = working.seen
    assert failed.body["kv_transfer_params"] == s.p[0].plans[0]
    assert "kv_transfer_params" not in retried.body  # decode-only: no plan at all
    assert len(s.p[0].seen) == 2 and len(s.p[0].plans) == 1


async def test_decode_dropping_before_the_first_byte_is_retried(make) -> None:
    s = await make(decode=2, policy="round-robin")
    for engine in s.d:
        engine.faults.drop_after_chunks = 0  # headers, then hang up
    status, _, raw = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    # Both engines dropped: nothing reached the client, so it gets a clean 502.
    assert status == 502 and json.loads(raw)["error"]["type"] == "DecodeFailed"
    assert s.count("pdconnect_router_retries_total", role="decode", reason="dropped") == 1
    # The prefill side still held the blocks of both plans (the retry got a fresh one):
    # it is told to free them all.
    plans = [plan["remote_request_id"] for plan in s.p[0].plans]
    assert len(plans) == 2
    await wait_until_async(lambda: sorted(s.p[0].released_ids()) == sorted(plans), "releases reached prefill")
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="decode_failed") == 1


async def test_an_engines_own_error_event_is_relayed_whole_and_its_plan_released(make) -> None:
    """vLLM ends a stream whose request failed after its 200 (a refused plan) with an error
    event and [DONE]; `connectors.api_guard` names a refusal there. Before, the router
    relayed it but counted the request served ("ok") and never released its plan."""
    s = await make()
    s.d[0].faults.error_event_after_chunks = 1
    status, _, raw = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    assert raw.endswith(VLLM_STREAM_ERROR + b"data: [DONE]\n\n"), raw  # the engine's words, untouched
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="decode_dropped") == 1
    [plan] = s.p[0].plans
    await wait_until_async(
        lambda: s.p[0].released_ids() == [plan["remote_request_id"]], "the plan's release to reach prefill"
    )


async def test_decode_dropping_mid_stream_ends_the_stream_with_an_error_event(make) -> None:
    s = await make()
    s.d[0].faults.drop_after_chunks = 2
    status, _, raw = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert [e["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    assert "error" in events[2] and events[3] == "[DONE]"
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="decode_dropped") == 1
    assert s.count("pdconnect_router_engine_failures_total", role="decode", engine=s.d[0].url) == 1


async def test_decode_stalling_mid_stream_is_cut_by_the_idle_timeout(make) -> None:
    s = await make(stream_idle_timeout=0.2)
    s.d[0].faults.stall_after_chunks = 1
    status, _, raw = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert "error" in events[1]
    # Cutting the stream closed the connection: the decode engine saw its request aborted.
    await wait_until_async(lambda: len(s.d[0].aborted) == 1, "decode engine saw the abort")


async def test_slow_non_streaming_decode_is_a_504_not_a_retry(make) -> None:
    s = await make(decode=2, decode_timeout=0.2)
    for engine in s.d:
        engine.faults.delay = 30.0
    status, _, body = await s.post("/v1/completions", COMPLETION)
    assert status == 504 and json.loads(body)["error"]["type"] == "DecodeTimeout"
    assert sum(len(e.seen) for e in s.d) == 1
    await wait_until_async(lambda: len(s.p[0].released_ids()) == 1, "release reached prefill")


async def test_no_healthy_decode_engine_is_a_503(make) -> None:
    s = await make(health_interval=0.05)
    s.d[0].faults.health_status = 503
    await wait_until_async(lambda: not s.router.router.registry.get(Role.DECODE, s.d[0].url).routable, "marked down")
    status, _, body = await s.post("/v1/completions", COMPLETION)
    assert status == 503 and json.loads(body)["error"]["type"] == "NoEngineAvailable"
    assert s.d[0].seen == [] and s.p[0].seen == []  # no prefill work for nobody
    async with s.http.get(s.router.url + "/health") as resp:
        assert resp.status == 503


# --- client disconnects --------------------------------------------------------------------


async def test_client_leaving_mid_stream_aborts_decode_and_releases_prefill(make) -> None:
    s = await make(stream_idle_timeout=30.0)
    s.d[0].faults.stall_after_chunks = 1
    async with asyncio.timeout(HANG):
        async with s.http.post(
            s.router.url + "/v1/completions", json={**COMPLETION, "stream": True}, headers={"X-Request-Id": "gone-1"}
        ) as resp:
            assert await resp.content.readany()
            resp.close()  # the client hangs up
    await wait_until_async(lambda: s.d[0].aborted == ["gone-1"], "decode engine saw the abort")
    await wait_until_async(lambda: s.p[0].released_ids() == ["gone-1"], "prefill engine got the release")
    await wait_until_async(
        lambda: s.count("pdconnect_router_requests_total", endpoint="completions", outcome="client_disconnect") == 1,
        "outcome counted",
    )
    assert s.count("pdconnect_router_prefill_releases_total", result="ok") == 1


async def test_client_leaving_while_decode_computes_aborts_it(make) -> None:
    s = await make(decode_timeout=30.0)
    s.d[0].faults.delay = 30.0
    task = asyncio.create_task(s.post("/v1/chat/completions", {**CHAT}, headers={"X-Request-Id": "gone-2"}))
    await wait_until_async(lambda: len(s.d[0].seen) == 1, "decode engine got the request")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_until_async(lambda: s.d[0].aborted == ["gone-2"], "decode engine saw the abort")
    await wait_until_async(lambda: s.p[0].released_ids() == ["gone-2"], "prefill engine got the release")


async def test_client_leaving_during_prefill_aborts_prefill(make) -> None:
    s = await make(prefill_timeout=30.0)
    s.p[0].faults.delay = 30.0
    task = asyncio.create_task(s.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "gone-3"}))
    await wait_until_async(lambda: len(s.p[0].seen) == 1, "prefill engine got the request")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_until_async(lambda: s.p[0].aborted == ["gone-3"], "prefill engine saw the abort")
    assert s.d[0].seen == []


# --- health and circuit breaking -------------------------------------------------------------


async def test_failing_engine_opens_its_breaker_and_gets_no_traffic_until_it_recovers(make) -> None:
    s = await make(decode=2, policy="round-robin", breaker_failures=2, breaker_cooldown=0.3, decode_attempts=2)
    bad, good = s.d
    bad.faults.status = 500
    for _ in range(6):
        status, headers, _ = await s.post("/v1/completions", COMPLETION)
        assert status == 200 and headers["X-PDConnect-Decode"] == good.url
    # Two failures opened the breaker; after that the bad engine saw nothing more.
    assert len(bad.seen) == 2
    assert s.count("pdconnect_router_engine_breaker_opens_total", role="decode", engine=bad.url) == 1
    assert s.count("pdconnect_router_engine_healthy", role="decode", engine=bad.url) == 0
    bad.faults.status = 200
    # After the cooldown one trial request goes through, succeeds, and closes the breaker.
    await wait_until_async(lambda: s.router.router.registry.get(Role.DECODE, bad.url).routable, "cooldown over")
    served = set()
    for _ in range(4):
        _, headers, _ = await s.post("/v1/completions", COMPLETION)
        served.add(headers["X-PDConnect-Decode"])
    assert served == {bad.url, good.url}


async def test_engine_failing_health_polls_is_skipped_then_readmitted(make) -> None:
    s = await make(prefill=2, policy="round-robin", health_interval=0.05)
    down, up = s.p
    down.faults.health_status = 500
    await wait_until_async(lambda: not s.router.router.registry.get(Role.PREFILL, down.url).routable, "marked down")
    for _ in range(4):
        _, headers, _ = await s.post("/v1/completions", COMPLETION)
        assert headers["X-PDConnect-Prefill"] == up.url
    down.faults.health_status = 200
    await wait_until_async(lambda: s.router.router.registry.get(Role.PREFILL, down.url).routable, "back up")


# --- runtime membership -----------------------------------------------------------------------


async def test_admin_api_adds_and_removes_engines_at_runtime(make) -> None:
    s = await make(admin_open=True)
    extra = FakeEngine(name="fake-d-extra")
    await extra.start()
    try:
        async with s.http.post(s.router.url + "/admin/engines", json={"role": "decode", "url": extra.url}) as resp:
            assert resp.status == 201
        await wait_until_async(lambda: s.router.router.registry.get(Role.DECODE, extra.url).routable, "polled up")
        async with s.http.delete(s.router.url + "/admin/engines", json={"role": "decode", "url": s.d[0].url}) as resp:
            assert resp.status == 200
        _, headers, _ = await s.post("/v1/completions", COMPLETION)
        assert headers["X-PDConnect-Decode"] == extra.url
        async with s.http.delete(s.router.url + "/admin/engines", json={"role": "decode", "url": s.d[0].url}) as resp:
            assert resp.status == 404
    finally:
        await extra.close()


async def test_admin_api_needs_its_token_and_is_absent_by_default(make, monkeypatch: pytest.MonkeyPatch) -> None:
    closed = await make()
    async with closed.http.get(closed.router.url + "/admin/engines") as resp:
        assert resp.status == 404
    monkeypatch.setenv("PDC_TEST_ADMIN", "s3cret")
    guarded = await make(admin_token_env="PDC_TEST_ADMIN")
    async with guarded.http.get(guarded.router.url + "/admin/engines") as resp:
        assert resp.status == 401
    async with guarded.http.get(
        guarded.router.url + "/admin/engines", headers={"Authorization": "Bearer s3cret"}
    ) as resp:
        assert resp.status == 200 and len(await resp.json()) == 2


async def test_dns_names_are_re_resolved_and_engines_follow(make) -> None:
    fakes = await FakeCluster.start(prefill=1, decode=2)
    records: dict[str, list[str]] = {"decode.svc": ["127.0.0.1"]}
    port = int(fakes.decode[0].url.rsplit(":", 1)[1])

    async def resolver(host: str, _port: int) -> list[str]:
        if host not in records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return records[host]

    config = load_config(
        {
            "host": "127.0.0.1",
            "port": 0,
            "prefill": fakes.prefill_urls,
            "decode_dns": [f"decode.svc:{port}"],
            "dns_interval": 0.05,
        }
    )
    router = await start_router(config, resolver=resolver)
    try:
        registry = router.router.registry
        assert [e.url for e in registry.engines(Role.DECODE)] == [fakes.decode[0].url]
        records["decode.svc"] = []
        await wait_until_async(lambda: registry.engines(Role.DECODE) == (), "record gone, engine gone")
        records["decode.svc"] = ["127.0.0.1"]
        await wait_until_async(lambda: len(registry.engines(Role.DECODE)) == 1, "engine back")
        del records["decode.svc"]  # a failing lookup keeps what we had
        await wait_until_async(
            lambda: (router.router.metrics.registry.get_sample_value("pdconnect_router_dns_failures_total") or 0) > 0,
            "lookup failed",
        )
        assert len(registry.engines(Role.DECODE)) == 1
    finally:
        await router.close()
        await fakes.close()


# --- clients that stop reading -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_client_that_stops_reading_is_dropped_its_engine_released_and_others_served(make, stream: bool) -> None:
    """A real socket that asks for a 16 MiB answer and never reads it: the router's
    writes stop draining, and the router drops the client after client_write_timeout
    (counted), aborts the decode request, tells prefill to free the plan, and meanwhile
    serves everyone else."""
    s = await make(client_write_timeout=0.5, stream_idle_timeout=30.0, decode_timeout=30.0)
    decode = s.d[0]
    if stream:
        decode.chunks = 64
        decode.faults.event_padding = 256 << 10
    else:
        decode.faults.answer_padding = 16 << 20
    host, port = s.router.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    body = json.dumps({**COMPLETION, "max_tokens": 64, "stream": stream}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: stalled-1\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        await asyncio.get_running_loop().sock_sendall(sock, head + body)  # ... and never read
        await wait_until_async(lambda: len(decode.seen) == 1, "decode engine got the request")
        status, _, _ = await s.post("/v1/chat/completions", CHAT)  # another client, meanwhile
        assert status == 200
        await wait_until_async(
            lambda: s.count("pdconnect_router_client_write_timeouts_total") == 1, "the stalled client was dropped"
        )
        await wait_until_async(
            lambda: s.count("pdconnect_router_requests_total", endpoint="completions", outcome="client_stalled") == 1,
            "outcome counted",
        )
        await wait_until_async(lambda: "stalled-1" in s.p[0].released_ids(), "prefill engine got the release")
        if stream:  # a whole answer was complete at the engine before the client stalled
            await wait_until_async(lambda: decode.aborted == ["stalled-1"], "decode engine saw the abort")
    finally:
        sock.close()
    status, _, _ = await s.post("/v1/completions", COMPLETION)
    assert status == 200
