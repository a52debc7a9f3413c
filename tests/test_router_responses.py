"""`/v1/responses` through the router against FAKE engines: routed P/D like chat (a one-token
prefill leg, then decode with its plan), usage true for the whole request, streams that end
with vLLM's terminal event, and what the router cannot carry refused in OpenAI's words."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdconnect.testbed.fake_engine import RESPONSES_STREAM_ERROR
from tests.router_support import Setup
from tests.waiting import wait_until_async

pytestmark = pytest.mark.asyncio

RESPONSE = {
    "model": "fake-model",
    "instructions": "be brief",
    "input": "the quick brown fox jumps over",
    "max_output_tokens": 4,
    "temperature": 0.3,
}


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A Responses stream's events: (name, data)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            head, _, data = block.partition("\ndata: ")
            events.append((head.removeprefix("event: "), json.loads(data)))
    return events


async def test_a_response_is_prefilled_then_decoded_with_the_prefill_plan_FAKE(make) -> None:
    s: Setup = await make()
    status, headers, raw = await s.post("/v1/responses", RESPONSE)
    assert status == 200, raw
    [prefill], [decode] = s.p[0].seen, s.d[0].seen
    assert prefill.path == decode.path == "/v1/responses"
    # The prefill leg: what shapes the prompt, one token, no stream, nothing stored.
    assert prefill.body == {
        "model": "fake-model",
        "instructions": "be brief",
        "input": "the quick brown fox jumps over",
        "max_output_tokens": 1,
        "store": False,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    # The decode leg: the client's own body plus the plan the prefill engine issued.
    assert decode.body == {**RESPONSE, "kv_transfer_params": s.p[0].plans[0]}
    assert headers["X-PDConnect-Prefill"] == s.p[0].url and "X-PDConnect-Fallback" not in headers
    answer = json.loads(raw)
    assert answer["object"] == "response" and answer["output"][0]["content"][0]["text"] == " t0 t1 t2 t3"
    # Decode counts the pulled prompt as cached; the client is told what prefill computed.
    assert answer["usage"] == {
        "input_tokens": 6,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    assert s.count("pdconnect_router_requests_total", endpoint="responses", outcome="ok") == 1


async def test_a_streamed_response_ends_with_its_completed_event_and_true_usage_FAKE(make) -> None:
    s: Setup = await make()
    status, _, raw = await s.post("/v1/responses", {**RESPONSE, "stream": True})
    assert status == 200, raw
    events = _events(raw)
    assert [name for name, _ in events] == [
        "response.created",
        *["response.output_text.delta"] * 4,
        "response.completed",
    ]
    assert "".join(data["delta"] for name, data in events if name.endswith(".delta")) == " t0 t1 t2 t3"
    assert events[-1][1]["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert s.d[0].seen[0].body["kv_transfer_params"] == s.p[0].plans[0]
    # Complete: a stream without [DONE] is not taken for a broken one.
    assert s.count("pdconnect_router_requests_total", endpoint="responses", outcome="ok") == 1


async def test_a_response_stream_cut_by_decode_ends_with_an_error_event_FAKE(make) -> None:
    s: Setup = await make()
    s.d[0].faults.drop_after_chunks = 3
    status, _, raw = await s.post("/v1/responses", {**RESPONSE, "stream": True})
    assert status == 200
    name, data = _events(raw)[-1]
    assert name == "error" and data["type"] == "error" and "stream broke" in data["message"]
    assert s.count("pdconnect_router_requests_total", endpoint="responses", outcome="decode_dropped") == 1


async def test_a_response_stream_the_engine_ends_with_its_error_event_is_not_served_FAKE(make) -> None:
    """An engine that failed the request after its 200 ends the stream with an `error` event
    (the stream is complete: terminal event). It reaches the client as the engine wrote it,
    and the request is not counted served: its plan is released like any dropped decode."""
    s: Setup = await make()
    s.d[0].faults.error_event_after_chunks = 2
    status, _, raw = await s.post("/v1/responses", {**RESPONSE, "stream": True})
    assert status == 200
    assert raw.endswith(RESPONSES_STREAM_ERROR), raw  # the engine's words, untouched
    assert s.count("pdconnect_router_requests_total", endpoint="responses", outcome="decode_dropped") == 1
    [plan] = s.p[0].plans
    await wait_until_async(
        lambda: s.p[0].released_ids() == [plan["remote_request_id"]], "the plan's release to reach prefill"
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_123"}}, "prompt"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "msg_123"}]}, "input"),
    ],
)
async def test_what_needs_server_state_or_server_tools_is_refused_before_any_engine_FAKE(
    make, extra: dict[str, Any], param: str
) -> None:
    s: Setup = await make()
    status, _, raw = await s.post("/v1/responses", {**RESPONSE, **extra})
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert error["type"] == "invalid_request_error" and param in error["message"]
    assert s.p[0].seen == [] and s.d[0].seen == []


async def test_function_tools_and_message_lists_are_routed_FAKE(make) -> None:
    s: Setup = await make()
    body = {
        **RESPONSE,
        "input": [{"role": "user", "content": "hello there"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "store": False,
    }
    status, _, raw = await s.post("/v1/responses", body)
    assert status == 200, raw
    assert s.p[0].seen[0].body["tools"] == body["tools"] and s.p[0].seen[0].body["input"] == body["input"]


async def test_a_response_with_a_wrong_input_type_is_refused_naming_the_field_FAKE(make) -> None:
    s: Setup = await make()
    status, _, raw = await s.post("/v1/responses", {**RESPONSE, "input": 5})
    assert status == 400 and "input" in json.loads(raw)["error"]["message"]
    assert s.p[0].seen == []
