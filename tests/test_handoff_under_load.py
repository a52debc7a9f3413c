"""The hand-off under CPU contention: real P/D engines, with CPU hogs beside them, serve every request.

On a host whose cores are oversubscribed (here: 2 cores, a prefill engine, a decode engine,
the router, the client and two processes that never stop computing), a prefill engine
must still answer its side channel and serve its reads, so that shared-prefix traffic
through the router is served in full, with no load failed and no lease lost. Before the
Mooncake transfer stopped spinning a core while it waited, the same traffic lost requests
to "prefill engine is down" and to reads that made no progress for a whole stall period.

What is asserted is what the product promises: every request answered 200 within the
router's request timeout, no failed load, no lost lease, and the prefill engine's blocks
back to none held once idle. No speed is asserted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdconnect.bench.scrape import engine_client, fetch_metrics
from pdconnect.testbed.engine_calls import prompt_ids
from pdconnect.testbed.local_pd import LocalPD, LocalPDConfig, start_local_pd
from pdconnect.testbed.processes import Cluster
from pdconnect.testbed.recipes import MODEL_NAME
from tests.waiting import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.faults]

# The product's promise under load: the router's and the engines' request timeout.
REQUEST_TIMEOUT_S = 120.0
GROUPS, SIBLINGS, CONCURRENCY = 3, 6, 6
HOGS = 2


@pytest.fixture(params=["mooncake", "nixl"])
def loaded_pd(request: pytest.FixtureRequest) -> Iterator[LocalPD]:
    """A fresh P/D pair and router for the transport, with CPU hogs running beside them."""
    with Cluster() as cluster:
        pd = start_local_pd(cluster, LocalPDConfig(transport=request.param, request_timeout_s=REQUEST_TIMEOUT_S))
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
        try:
            yield pd
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()


def _counter(client: httpx.Client, base_url: str, name: str) -> float:
    return fetch_metrics(base_url, client).total(f"pdconnect:{name}_total")


def test_every_shared_prefix_request_is_served_with_cpu_hogs_beside_the_engines(loaded_pd: LocalPD) -> None:
    prefixes = [prompt_ids(seed=700 + g, length=1000 + 100 * g) for g in range(GROUPS)]
    prompts = [
        prefixes[i % GROUPS] + prompt_ids(seed=800 + i, length=150 + 50 * (i % 5)) for i in range(GROUPS * SIBLINGS)
    ]
    router = loaded_pd.router.base_url

    with engine_client(REQUEST_TIMEOUT_S + 30) as client:

        def serve(prompt: list[int]) -> tuple[int, float, str]:
            started = time.monotonic()
            response = client.post(
                f"{router}/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            )
            return response.status_code, time.monotonic() - started, response.text[:200]

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            outcomes = list(pool.map(serve, prompts))

        failed = [
            (status, round(took, 1), body)
            for status, took, body in outcomes
            if status != 200 or took > REQUEST_TIMEOUT_S
        ]
        assert not failed, f"{len(failed)} of {len(prompts)} requests not served in time: {failed[:3]}"
        decode, prefill = loaded_pd.decode.base_url, loaded_pd.prefill.base_url
        assert _counter(client, decode, "transfers") >= GROUPS  # P/D really happened (no fallback)
        assert _counter(client, decode, "transfer_failures") == 0
        assert _counter(client, decode, "leases_lost") == 0
        assert _counter(client, prefill, "lease_expiries") == 0
        # Every hold ends with its request: nothing stays held on prefill once idle.
        wait_until(
            lambda: fetch_metrics(prefill, client).total("pdconnect:blocks_held") == 0,
            "prefill to hold no block once idle",
            60,
            observe=lambda: fetch_metrics(prefill, client).total("pdconnect:blocks_held"),
        )
