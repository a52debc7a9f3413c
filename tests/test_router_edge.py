"""The router's edge against hostile or careless clients and engines, on FAKE engines
(`pdconnect.testbed.fake_engine`): body limits (plain, chunked, gzip bombs), slow bodies,
the admin API's URL and token rules, OpenAI error JSON for everything the router itself
refuses, well-formed streams whatever the engine left half-written, compressing
engines, `Authorization` on every engine call, request validation before any engine
sees the request, and breakers that count engine faults rather than bad requests.

No timing is asserted; a generous deadline only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hmac
import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from pdconnect.router.engines import Role
from tests.router_support import CHAT, COMPLETION, HANG, Setup, sse_events
from tests.waiting import wait_until_async

pytestmark = pytest.mark.asyncio


async def raw_exchange(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request written by hand (so a body can lie about its length or never end)."""
    parts = urlsplit(url)
    async with asyncio.timeout(HANG):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(head + body)
            await writer.drain()
            status_line = await reader.readline()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            data = await reader.readexactly(int(headers.get("content-length", "0")))
            return int(status_line.split()[1]), headers, data
        finally:
            writer.close()


def post_head(url: str, path: str, extra: str) -> bytes:
    host = urlsplit(url).netloc
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}\r\n").encode()


def assert_openai_error(body: bytes, status: int) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status and isinstance(error["type"], str)
    return error


# --- body size and read deadline --------------------------------------------------------------


async def test_body_declared_over_the_limit_is_refused_before_it_is_read(make) -> None:
    s: Setup = await make(max_body_bytes=1 << 20)
    # 100 MiB announced, nothing sent: the answer cannot wait for the body.
    status, _, body = await raw_exchange(
        s.router.url, post_head(s.router.url, "/v1/completions", "Content-Length: 104857600\r\n")
    )
    assert status == 413
    assert_openai_error(body, 413)
    assert s.p[0].seen == [] and s.d[0].seen == []


async def test_chunked_body_over_the_limit_is_refused(make) -> None:
    s: Setup = await make(max_body_bytes=1 << 16)
    big = json.dumps({**COMPLETION, "prompt": "x " * 50_000}).encode()
    async with asyncio.timeout(HANG):

        async def chunks() -> Any:
            for i in range(0, len(big), 8192):
                yield big[i : i + 8192]

        async with s.http.post(
            s.router.url + "/v1/completions", data=chunks(), headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 413
            assert_openai_error(await resp.read(), 413)


async def test_gzip_bomb_is_refused_on_its_inflated_size_and_small_gzip_bodies_work(make) -> None:
    s: Setup = await make(max_body_bytes=1 << 20)
    bomb = gzip.compress(b'{"prompt": "' + b" " * (64 << 20) + b'"}')
    assert len(bomb) < (1 << 20)  # the compressed upload itself is within the limit
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with asyncio.timeout(HANG):
        async with s.http.post(s.router.url + "/v1/completions", data=bomb, headers=headers) as resp:
            assert resp.status == 413
            assert_openai_error(await resp.read(), 413)
        async with s.http.post(
            s.router.url + "/v1/completions", data=gzip.compress(json.dumps(COMPLETION).encode()), headers=headers
        ) as resp:
            assert resp.status == 200
        async with s.http.post(
            s.router.url + "/v1/completions", data=b"\x1f\x8bnot gzip at all", headers=headers
        ) as resp:
            assert resp.status == 400
            assert_openai_error(await resp.read(), 400)
    assert len(s.d[0].seen) == 1


async def test_body_that_never_finishes_is_cut_by_the_read_deadline(make) -> None:
    s: Setup = await make(body_read_timeout=0.3)
    status, _, body = await raw_exchange(
        s.router.url, post_head(s.router.url, "/v1/completions", "Content-Length: 1000\r\n"), b'{"prompt": "'
    )
    assert status == 408
    assert_openai_error(body, 408)


# --- request head deadline ---------------------------------------------------------------------


def _parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


async def test_a_request_head_trickled_byte_by_byte_is_cut_by_the_header_deadline(make) -> None:
    """Slowloris: a header byte every 50 ms keeps the connection busy forever unless the
    whole head has a deadline. The router answers 408 (OpenAI error JSON) and closes."""
    s: Setup = await make(header_read_timeout=0.3)
    parts = urlsplit(s.router.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        answer = asyncio.ensure_future(reader.read())  # everything until the router closes
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: slow\r\nX-Slow: ")

        async def closed_while_trickling() -> bool:
            """A byte of the header every look, until the router answered and closed."""
            if not answer.done():
                with contextlib.suppress(ConnectionError):
                    writer.write(b"a")
                    await writer.drain()
            return answer.done()

        # Far past the 0.3 s deadline: a connection still open then is the bug.
        await wait_until_async(closed_while_trickling, "the router to cut the trickling header", 5.0)
        status, headers, body = _parse_response(await answer)
    finally:
        writer.close()
    assert status == 408 and headers["connection"] == "close"
    assert_openai_error(body, 408)
    assert s.count("pdconnect_router_header_timeouts_total") == 1
    assert s.p[0].seen == [] and s.d[0].seen == []


async def test_the_header_deadline_spares_slow_bodies_idle_keepalive_and_long_streams(make) -> None:
    """Only the head has the deadline: a body may take longer (it has its own), an idle
    keep-alive connection waits for its next request, and a stream outlasts it."""
    # Each phase lasts twice the deadline: a scheduling hiccup on a loaded machine (one
    # CI run at load 28 with a 0.3 s deadline) must not read as a head that came late.
    s: Setup = await make(
        header_read_timeout=1.0, body_read_timeout=10.0, decode_first_byte_timeout=5.0, decode_timeout=5.0
    )
    parts = urlsplit(s.router.url)
    body = json.dumps(COMPLETION).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:

        async def answer() -> tuple[int, bytes]:
            status_line = await reader.readline()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            return int(status_line.split()[1]), await reader.readexactly(int(headers["content-length"]))

        async with asyncio.timeout(HANG):
            writer.write(post_head(s.router.url, "/v1/completions", f"Content-Length: {len(body)}\r\n"))
            for i in range(0, len(body), len(body) // 4 + 1):  # the body over ~2 s
                await asyncio.sleep(0.5)
                writer.write(body[i : i + len(body) // 4 + 1])
            assert (await answer())[0] == 200
            await asyncio.sleep(2.0)  # idle between requests: keep-alive's business
            writer.write(post_head(s.router.url, "/v1/completions", f"Content-Length: {len(body)}\r\n") + body)
            assert (await answer())[0] == 200
    finally:
        writer.close()
    s.d[0].faults.delay = 2.0
    status, _, streamed = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200 and sse_events(streamed)[-1] == "[DONE]"
    assert s.count("pdconnect_router_header_timeouts_total") == 0


async def test_an_idle_client_connection_is_closed_after_the_keepalive(make) -> None:
    """A client that sends one request and then nothing holds a descriptor only for the
    keep-alive (aiohttp's own default is an hour: idle clients could exhaust the limit)."""
    s: Setup = await make(client_keepalive=0.3)
    parts = urlsplit(s.router.url)
    body = json.dumps(COMPLETION).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        async with asyncio.timeout(HANG):
            writer.write(post_head(s.router.url, "/v1/completions", f"Content-Length: {len(body)}\r\n") + body)
            assert (await reader.readline()).split()[1] == b"200"
            while await reader.read(65536):  # the answer, then the close: EOF
                pass
    finally:
        writer.close()


# --- admin API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/internal",
        "http://127.0.0.1:9/?q=1",
        "http://u:p@127.0.0.1:9",
        "http://127.0.0.1:9#frag",
        "ftp://127.0.0.1:9",
        "http://127.0.0.1",
        "http://:9",
    ],
)
async def test_admin_engine_urls_are_scheme_host_and_port_only(make, url: str) -> None:
    s: Setup = await make(admin_open=True)
    async with s.http.post(s.router.url + "/admin/engines", json={"role": "decode", "url": url}) as resp:
        assert resp.status == 400
        assert_openai_error(await resp.read(), 400)
    assert len(s.router.router.registry.engines(Role.DECODE)) == 1


async def test_admin_token_is_compared_in_constant_time(make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDC_TEST_ADMIN", "s3cret")
    compared: list[tuple[bytes, bytes]] = []

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return hmac.compare_digest(a, b)

    monkeypatch.setattr("pdconnect.router.app.compare_digest", recording)
    s: Setup = await make(admin_token_env="PDC_TEST_ADMIN")
    async with s.http.get(s.router.url + "/admin/engines", headers={"Authorization": "Bearer wrong"}) as resp:
        assert resp.status == 401
        assert_openai_error(await resp.read(), 401)
    async with s.http.get(s.router.url + "/admin/engines", headers={"Authorization": "Bearer s3cret"}) as resp:
        assert resp.status == 200
    assert len(compared) == 2


async def test_admin_api_can_live_on_its_own_loopback_port_only(make) -> None:
    s: Setup = await make(admin_open=True, admin_port=0)
    admin_url = s.router.admin_url
    assert admin_url is not None and urlsplit(admin_url).hostname == "127.0.0.1"
    async with s.http.get(s.router.url + "/admin/engines") as resp:
        assert resp.status == 404
    async with s.http.get(admin_url + "/admin/engines") as resp:
        assert resp.status == 200 and len(await resp.json()) == 2
    async with s.http.get(admin_url + "/v1/models") as resp:
        assert resp.status == 404  # the admin port serves nothing else


# --- errors the router itself returns ------------------------------------------------------------


async def test_every_error_the_router_returns_is_openai_error_json(make) -> None:
    s: Setup = await make()
    async with s.http.get(s.router.url + "/v1/completions") as resp:
        assert resp.status == 405
        assert_openai_error(await resp.read(), 405)
    async with s.http.get(s.router.url + "/v1/nothing-here") as resp:
        assert resp.status == 404
        assert_openai_error(await resp.read(), 404)
    async with s.http.post(s.router.url + "/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400
        assert_openai_error(await resp.read(), 400)
    s.d[0].faults.health_status = 500
    s.router.router.registry.engines(Role.DECODE)[0].probe_ok = False
    status, _, body = await s.post("/v1/completions", COMPLETION)
    assert status == 503
    assert_openai_error(body, 503)


# --- streams --------------------------------------------------------------------------------


@pytest.mark.parametrize("with_prefill", [True, False], ids=["usage-merged", "decode-only-fallback"])
async def test_stream_cut_mid_event_ends_with_a_well_formed_error_event_and_done(make, with_prefill: bool) -> None:
    s: Setup = await make(prefill=1 if with_prefill else 0)
    s.d[0].faults.half_event_after_chunks = 2
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    status, _, raw = await s.post("/v1/completions", body)
    assert status == 200
    assert raw.endswith(b"\n\n")
    events = sse_events(raw)  # every event must be whole, valid JSON
    assert len(raw.split(b"\n\n")) - 1 == len(events)
    assert [e["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    assert "error" in events[-2] and events[-1] == "[DONE]"


# --- engines that compress, engines that need a key ---------------------------------------------


async def test_compressing_engines_never_reach_the_client_compressed(make) -> None:
    s: Setup = await make()
    for engine in s.p + s.d:
        engine.faults.gzip = True
    async with aiohttp.ClientSession(auto_decompress=False) as plain:
        async with asyncio.timeout(HANG):
            async with plain.post(s.router.url + "/v1/completions", json=COMPLETION) as resp:
                raw, headers = await resp.read(), resp.headers
            assert "Content-Encoding" not in headers and "X-PDConnect-Fallback" not in headers
            assert json.loads(raw)["usage"]["prompt_tokens"] == 5
            streamed = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
            async with plain.post(s.router.url + "/v1/completions", json=streamed) as resp:
                raw, headers = await resp.read(), resp.headers
    assert "Content-Encoding" not in headers and "X-PDConnect-Fallback" not in headers
    assert sse_events(raw)[-1] == "[DONE]"


async def test_authorization_reaches_every_engine_call_including_models(make) -> None:
    s: Setup = await make()
    for engine in s.p + s.d:
        engine.api_key = "engine-key"
    auth = {"Authorization": "Bearer engine-key"}
    async with s.http.get(s.router.url + "/v1/models", headers=auth) as resp:
        assert resp.status == 200
    status, headers, _ = await s.post("/v1/completions", COMPLETION, headers=auth)
    assert status == 200 and "X-PDConnect-Fallback" not in headers


# --- validation and breakers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {**COMPLETION, "stream": "yes"}),
        ("/v1/completions", {**COMPLETION, "max_tokens": "many"}),
        ("/v1/completions", {**COMPLETION, "stream_options": 3}),
        ("/v1/completions", {"model": "fake-model"}),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}),
        ("/v1/chat/completions", {**CHAT, "messages": [3]}),
        ("/v1/completions", {**COMPLETION, "kv_transfer_params": "forged"}),
        ("/v1/completions", {**COMPLETION, "vllm_xargs": "kv_transfer_params=forged"}),
        ("/v1/chat/completions", {**CHAT, "vllm_xargs": [{"kv_transfer_params": {}}]}),
        ("/v1/completions", {**COMPLETION, "vllm_xargs": 7}),
        ("/v1/completions", {**COMPLETION, "n": "2"}),
    ],
    ids=[
        "prompt-int",
        "stream-str",
        "max-tokens-str",
        "stream-options-int",
        "no-prompt",
        "messages-str",
        "message-int",
        "params-str",
        "xargs-str",
        "xargs-list",
        "xargs-int",
        "n-str",
    ],
)
async def test_fields_the_router_reads_are_validated_before_any_engine_sees_them(
    make, path: str, body: dict[str, Any]
) -> None:
    s: Setup = await make()
    status, _, answer = await s.post(path, body)
    assert status == 400
    assert_openai_error(answer, 400)
    assert s.p[0].seen == [] and s.d[0].seen == []


async def test_bad_requests_that_engines_answer_with_500_open_no_breaker(make) -> None:
    s: Setup = await make(prefill=2, decode=2, breaker_failures=2, health_interval=0)
    for engine in s.p + s.d:
        engine.faults.fail_on_field = "fake_poison"
    for _ in range(3):
        status, _, _ = await s.post("/v1/completions", {**COMPLETION, "fake_poison": True})
        assert status >= 500
    status, _, _ = await s.post("/v1/completions", COMPLETION)
    assert status == 200
    breakers = [e.breaker.state.value for e in s.router.router.registry.all_engines()]
    assert breakers == ["closed"] * 4


async def test_a_real_engine_fault_still_opens_its_breaker(make) -> None:
    s: Setup = await make(decode=2, breaker_failures=2, health_interval=0, policy="round-robin")
    broken, _ = s.d
    broken.faults.status = 500
    for _ in range(4):
        status, _, _ = await s.post("/v1/completions", COMPLETION)
        assert status == 200
    engine = s.router.router.registry.get(Role.DECODE, broken.url)
    assert engine is not None and engine.breaker.state.value == "open"


# --- the client's ways into kv_transfer_params ------------------------------------------------

FORGED_PLAN = {"do_remote_prefill": True, "remote_engine_id": "forged", "remote_host": "10.0.0.1"}


@pytest.mark.parametrize(
    "path,request_body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)], ids=["completions", "chat"]
)
@pytest.mark.parametrize("leg", ["pd", "decode-only-fallback", "decode-retry"])
@pytest.mark.parametrize(
    "value",
    [FORGED_PLAN, "a string vLLM would hand the connector", None, [1]],
    ids=["object", "string", "null", "list"],
)
async def test_vllm_xargs_kv_transfer_params_is_refused_on_every_leg(
    make, path: str, request_body: dict[str, Any], leg: str, value: Any
) -> None:
    """vLLM takes `vllm_xargs.kv_transfer_params` as the connector's params when the
    top-level field is unset (decode-only) or empty: the router refuses it outright."""
    s: Setup = await make(prefill=0 if leg == "decode-only-fallback" else 1, decode=2, policy="round-robin")
    if leg == "decode-retry":
        s.d[0].faults.status = 500
    for body in (
        {**request_body, "vllm_xargs": {"kv_transfer_params": value}},
        {**request_body, "kv_transfer_params": {}, "vllm_xargs": {"x": 1, "kv_transfer_params": value}},
    ):
        status, _, answer = await s.post(path, body)
        assert status == 400
        assert "vllm_xargs.kv_transfer_params" in assert_openai_error(answer, 400)["message"]
    assert [e.seen for e in s.p + s.d] == [[] for _ in s.p + s.d]


async def test_other_vllm_xargs_reach_decode_only(make) -> None:
    s: Setup = await make()
    status, _, _ = await s.post("/v1/completions", {**COMPLETION, "vllm_xargs": {"session_id": "s1", "k": [1, 2]}})
    assert status == 200
    assert s.d[0].seen[0].body["vllm_xargs"] == {"session_id": "s1", "k": [1, 2]}
    assert "vllm_xargs" not in s.p[0].seen[0].body


# --- what prefill gets ----------------------------------------------------------------------------

# Fields that shape only the answer: a prefill engine must never compute or send them.
ANSWER_ONLY = {
    "prompt_logprobs": 20,
    "logprobs": 5,
    "echo": True,
    "n": 1,
    "best_of": 1,
    "logit_bias": {"5": 1.0},
    "stop": ["x"],
    "seed": 3,
    "temperature": 0.5,
    "return_token_ids": True,
    "ignore_eos": True,
    "structured_outputs": {"regex": "a+"},
    "vllm_xargs": {"k": 1},
    "user": "u",
    "min_tokens": 2,
    "stream": True,
    "stream_options": {"include_usage": True},
    "request_id": "client-chosen",
}


@pytest.mark.parametrize(
    "path,request_body,kv_fields",
    [
        (
            "/v1/completions",
            COMPLETION,
            {
                "add_special_tokens": False,
                "cache_salt": "salt",
                "truncate_prompt_tokens": 4,
                "truncation_side": "left",
                "suffix": "tail",
                "priority": 1,
                "session_id": "s",
            },
        ),
        (
            "/v1/chat/completions",
            CHAT,
            {
                "add_special_tokens": True,
                "cache_salt": "salt",
                "chat_template_kwargs": {"enable_thinking": False},
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "tool_choice": "auto",
                "response_format": {"type": "json_object"},
                "add_generation_prompt": False,
                "continue_final_message": True,
                "documents": [{"t": "d"}],
                "reasoning_effort": "low",
                "mm_processor_kwargs": {"size": 2},
                "media_io_kwargs": {"image": {}},
                "chat_template": "{{ messages }}",
                "truncate_prompt_tokens": 9,
            },
        ),
    ],
    ids=["completions", "chat"],
)
async def test_prefill_gets_what_the_prompts_kv_depends_on_and_nothing_that_shapes_only_the_answer(
    make, path: str, request_body: dict[str, Any], kv_fields: dict[str, Any]
) -> None:
    s: Setup = await make()
    chat_only = {"top_logprobs": 3, "parallel_tool_calls": False} if "chat" in path else {}
    body = {**request_body, **kv_fields, **ANSWER_ONLY, **chat_only}
    status, _, _ = await s.post(path, body)
    assert status == 200
    prefill = s.p[0].seen[0].body
    overrides = {
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
        **({"max_completion_tokens": 1} if "chat" in path else {}),
    }
    kept = {k: v for k, v in body.items() if k not in ANSWER_ONLY and k not in chat_only}
    assert prefill == {**kept, **overrides}
    assert {k: v for k, v in s.d[0].seen[0].body.items() if k != "kv_transfer_params"} == body


# --- what the router reads from engines ------------------------------------------------------------


async def test_a_prefill_answer_over_its_limit_is_dropped_unread_and_the_request_served_decode_only(make) -> None:
    s: Setup = await make(prefill_attempts=1, max_prefill_answer_bytes=1 << 20)
    s.p[0].faults.answer_padding = 2 << 20
    status, headers, body = await s.post("/v1/completions", COMPLETION)
    assert status == 200 and json.loads(body)["choices"][0]["text"]
    assert headers["X-PDConnect-Fallback"] == "prefill_failed"
    assert s.count("pdconnect_router_oversized_answers_total", leg="prefill") == 1
    assert "kv_transfer_params" not in s.d[0].seen[0].body


async def test_a_decode_answer_over_its_limit_is_a_502_and_its_plan_is_released(make) -> None:
    s: Setup = await make(decode=2, max_answer_bytes=1 << 20)
    for engine in s.d:
        engine.faults.answer_padding = 2 << 20
    status, _, body = await s.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "big-1"})
    assert status == 502
    assert_openai_error(body, 502)
    assert sum(len(e.seen) for e in s.d) == 1  # another engine would answer the same: no retry
    assert s.count("pdconnect_router_oversized_answers_total", leg="decode") == 1
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="decode_failed") == 1
    await wait_until_async(
        lambda: "big-1" in s.p[0].released_ids(), "the release of big-1 at prefill", observe=s.p[0].released_ids
    )


async def test_a_streamed_event_over_its_limit_ends_the_stream_with_an_error_event(make) -> None:
    s: Setup = await make(max_event_bytes=1 << 20)
    s.d[0].faults.event_padding = 2 << 20
    status, _, raw = await s.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert "error" in events[0] and events[-1] == "[DONE]" and len(raw) < (1 << 20)
    assert s.count("pdconnect_router_oversized_answers_total", leg="event") == 1


async def test_an_engine_error_body_over_its_limit_is_replaced_by_the_routers_own(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pdconnect.router.attempt._ERROR_BODY_LIMIT", 16)  # the fake's 400 body is longer
    s: Setup = await make()
    s.p[0].faults.status = 400
    status, headers, body = await s.post("/v1/completions", COMPLETION)
    assert status == 400 and headers["Content-Type"] == "application/json"
    assert "over 16 bytes" in assert_openai_error(body, 400)["message"]
    assert s.count("pdconnect_router_oversized_answers_total", leg="error") == 1


# --- several sequences per request -----------------------------------------------------------------


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/v1/completions", {"n": 2}),
        ("/v1/completions", {"n": 0}),
        ("/v1/completions", {"best_of": 3}),
        ("/v1/completions", {"use_beam_search": True}),
        ("/v1/completions", {"prompt": ["a b", "c d"]}),
        ("/v1/completions", {"prompt": ["a b"]}),
        ("/v1/completions", {"prompt": [[1, 2], [3, 4]]}),
        ("/v1/chat/completions", {"n": 4}),
        ("/v1/chat/completions", {"use_beam_search": True}),
    ],
    ids=["n", "n-zero", "best-of", "beam-search", "batch", "batch-of-one", "token-batch", "chat-n", "chat-beam"],
)
async def test_requests_for_several_sequences_are_refused_while_prefill_engines_serve(
    make, path: str, extra: dict[str, Any]
) -> None:
    """Each sequence would make the prefill engine hold a plan; the router keeps and
    releases one per request, so the others would wait for their lease to expire."""
    s: Setup = await make()
    status, _, answer = await s.post(path, {**(CHAT if "chat" in path else COMPLETION), **extra})
    assert status == 400
    assert "one request per sequence" in assert_openai_error(answer, 400)["message"]
    assert s.p[0].seen == [] and s.d[0].seen == []


async def test_a_decode_only_router_passes_several_sequences_on(make) -> None:
    s: Setup = await make(prefill=0)
    status, _, _ = await s.post("/v1/completions", {**COMPLETION, "n": 2})
    assert status == 200 and s.d[0].seen[0].body["n"] == 2


# --- the router's memory -----------------------------------------------------------------------------


def test_a_long_prompt_with_prompt_logprobs_leaves_the_router_far_below_its_memory_limit_with_fake_engines(
    tmp_path: Any,
) -> None:
    """131k prompt tokens with `prompt_logprobs: 20` make a ~150 MB answer (the FAKE
    engines answer the way vLLM does). The prefill leg must not ask for it, and the
    decode answer, relayed, must not become Python objects: the router process (its own,
    measured alone) peaks far below the 2 GiB its pod may use."""
    import httpx

    from tests.router_support import peak_rss_bytes, router_process_with_fakes

    prompt = "w " * 131_072
    with router_process_with_fakes(tmp_path) as router, httpx.Client(timeout=HANG * 8) as http:
        assert http.post(router.base_url + "/v1/completions", json=COMPLETION).status_code == 200
        before = peak_rss_bytes(router.popen.pid)
        resp = http.post(
            router.base_url + "/v1/completions", json={**COMPLETION, "prompt": prompt, "prompt_logprobs": 20}
        )
        assert resp.status_code == 200
        answer_bytes = len(resp.content)
        after = peak_rss_bytes(router.popen.pid)
    growth = after - before
    print(f"answer {answer_bytes / 2**20:.0f} MiB, router peak RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
    assert answer_bytes > 100 << 20  # the answer really is that large
    # The relayed answer's bytes, held once while it is written (with room for the
    # allocator); never its decoded objects (several times its size, per leg).
    assert growth < 2 * answer_bytes, f"router peak grew {growth / 2**20:.0f} MiB"
