"""kv_transfer_params of any JSON type: the connector's strict decode and the API server's 400, without engines.

The engine-level proofs are in test_faults_engines.py (vLLM's real API server with the
guard) and test_connector_scheduler.py (vLLM's real scheduler); these pin the rules
themselves: what is refused, that each request is counted once, that a refused request
no longer carries its params, that the log stays bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest

from connectors.api_guard import TransferParamsGuard, refusal
from connectors.stats import StatsRecorder
from connectors.transfer_params import Leg, ParamsGate, read_params
from pdconnect.protocol import PROTOCOL_VERSION
from tests.params_fuzz import JSON_VALUES, cases, expected_ask
from tests.toy_proxy import TOY_PROXY_PARAMS

PLAN: dict[str, Any] = {
    "remote_engine_id": "prefill-0",
    "remote_request_id": "r1",
    "remote_host": "10.0.0.5",
    "remote_port": 5700,
    "compat_hash": "c" * 16,
    "num_prompt_tokens": 600,
    "lease_expires_at": 1.0e9,
    "groups": [
        {"group": 0, "runs": [{"start": 0, "block_ids": [4, 5, 6]}], "slack": []},
        {"group": 1, "runs": [{"start": 6, "block_ids": [9, 10]}], "slack": [6]},
    ],
    "lease_id": "lease-1",
    "prompt_digest": "d" * 32,
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "pdconnect": PROTOCOL_VERSION,
    "remote_prefill_cached_tokens": 0,
    "prompt_token_ids": None,
}


def _ask_kind(params: Any) -> str:
    ask = read_params(params)
    return "invalid" if ask.invalid else ("plan" if ask.leg is Leg.DECODE else "none")


def test_every_json_type_at_every_place_is_decoded_as_the_rules_say():
    fuzz = cases(PLAN)
    wrong = [
        (c.name, expected_ask(c.params), _ask_kind(c.params))
        for c in fuzz
        if expected_ask(c.params) != _ask_kind(c.params)
    ]
    assert not wrong, wrong[:10]
    kinds = {expected_ask(c.params) for c in fuzz}
    assert kinds == {"invalid", "plan", "none"}  # the cases reach every outcome


def test_refusals_name_the_field():
    assert (
        "$.groups[0].runs[0].block_ids[0]"
        in read_params({**PLAN, "groups": [{"group": 0, "runs": [{"start": 0, "block_ids": ["4"]}]}]}).invalid
    )
    assert "Expected `object`, got `str`" in read_params("x").invalid
    assert "do_remote_prefill" in read_params({"do_remote_prefill": "yes"}).invalid


def test_prefill_leg_keeps_other_proxies_keys():
    toy = TOY_PROXY_PARAMS  # vLLM's toy proxy sends these with the prefill leg
    assert read_params(toy).leg is Leg.PREFILL and not read_params(toy).invalid


class _Request:
    """What the gate reads of vLLM's Request: its id and params (the real one needs an engine config)."""

    def __init__(self, request_id: str, params: Any) -> None:
        self.request_id = request_id
        self.kv_transfer_params = params


def test_the_gate_counts_each_request_once_and_strips_what_it_refused(caplog):
    stats = StatsRecorder()
    gate = ParamsGate(stats, warn_interval=3600)
    requests = [_Request(f"r{i}", value) for i, value in enumerate(JSON_VALUES)]
    with caplog.at_level(logging.WARNING, logger="pdconnect.connector"):
        for _ in range(3):  # the scheduler asks about a request many times
            for request in requests:
                gate.ask(request)
    refused = [r for r, v in zip(requests, JSON_VALUES) if v is not None and not isinstance(v, dict)]
    taken = stats.take()
    assert taken is not None and taken.data["counters"]["invalid_transfer_params"] == len(refused)
    assert all(r.kv_transfer_params is None for r in refused)  # no later reader can trip on them
    assert {"a": 1} in [r.kv_transfer_params for r in requests]  # objects without a leg stay
    warnings = [r for r in caplog.records if "ignoring its kv_transfer_params" in r.getMessage()]
    assert len(warnings) == 1  # one per interval, whatever the rate
    for request in requests:
        gate.forget(request.request_id)
    assert gate.tracked() == 0


def test_the_bounded_warning_says_how_many_it_held_back(caplog, monkeypatch):
    gate = ParamsGate(StatsRecorder(), warn_interval=10)
    clock = [100.0]
    monkeypatch.setattr("connectors.transfer_params.time.monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="pdconnect.connector"):
        for i in range(5):
            gate.ask(_Request(f"a{i}", "x"))
        clock[0] += 11
        gate.ask(_Request("b", 1))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "4 more like it" in messages[1]


# --- the API server's guard --------------------------------------------------------------


async def _echo(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """Stands in for vLLM's app: answers 200 with the body it received."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _post(body: bytes) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=TransferParamsGuard(_echo))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.post("/v1/completions", content=body)

    return asyncio.run(go())


@pytest.mark.parametrize("carrier", ["kv_transfer_params", "vllm_xargs"])
def test_the_guard_answers_400_for_every_invalid_case_and_passes_the_rest(carrier):
    for case in cases(PLAN):
        params = case.params
        request = (
            {"prompt": "hi", "kv_transfer_params": params}
            if carrier == "kv_transfer_params"
            else {"prompt": "hi", "vllm_xargs": {"kv_transfer_params": params}}
        )
        body = json.dumps(request).encode()
        response = _post(body)
        if expected_ask(params) == "invalid":
            assert response.status_code == 400, case.name
            error = response.json()["error"]
            assert error["code"] == 400 and error["param"] == "kv_transfer_params" and error["message"], case.name
        else:
            assert (response.status_code, response.content) == (200, body), case.name


def test_the_guard_reads_the_params_vllm_reads():
    # vLLM takes the body's params when truthy, else vllm_xargs's: the guard judges those.
    assert refusal(json.dumps({"kv_transfer_params": {}, "vllm_xargs": {"kv_transfer_params": "x"}}).encode())
    assert refusal(json.dumps({"kv_transfer_params": PLAN, "vllm_xargs": {"kv_transfer_params": "x"}}).encode()) is None
    # Bodies vLLM refuses itself, in its own words, pass.
    assert refusal(b"[1, 2]") is None and refusal(b'{"kv_transfer_params": ') is None
    assert _post(b"not json kv_transfer_params").status_code == 200
