"""What the real-engine parity suites share: the colocated reference, answers compared, pools drained, a chat.

`tests/test_connector_engines.py` (one rank a side) and `tests/test_tp2_engines.py` (two
ranks a side) compare a P/D pair with one engine alone serving the same model and flags:
the same tokens and logprobs, and on sibling prompts the same decode-local prefix-cache hit.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, fetch_metrics
from pdconnect.testbed.engine_calls import completed, completion, prompt_ids, token_ids
from pdconnect.testbed.processes import ManagedProcess
from tests.waiting import wait_until

PROMPT_TOKENS = 1000
SIBLING_EXTRA = 64
DECODE_TOKENS = 16
LONG_SUFFIX = 300
CHAT_SYSTEM, CHAT_QUESTION, CHAT_TURNS = 1100, 300, 4


def colocated(http: httpx.Client, single: ManagedProcess, prompt: list[int]) -> tuple[int, dict]:
    """One request on the colocated reference engine: its local hit and its answer."""
    before = PrefixCacheCounters.scrape(single.base_url, http)
    body = completed(completion(http, single.base_url, prompt, DECODE_TOKENS, logprobs=1))
    return int((PrefixCacheCounters.scrape(single.base_url, http) - before).hits), body


def assert_pools_back_to_baseline(http: httpx.Client, *engines: ManagedProcess) -> None:
    """Nothing held by the connector and no block in use once every request ended."""
    for proc in engines:

        def held_and_used(proc: ManagedProcess = proc) -> tuple[float, float]:
            metrics = fetch_metrics(proc.base_url, http)
            return metrics.total("pdconnect:blocks_held"), metrics.total("vllm:kv_cache_usage_perc")

        wait_until(
            lambda: held_and_used() == (0, 0), f"{proc.name}: no block held or in use", 10, observe=held_and_used
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
