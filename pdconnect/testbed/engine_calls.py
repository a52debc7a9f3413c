"""What the real-engine tests (and `scripts/gpu_check.py`) send to local engines: prompts, completions, the P/D flow.

They boot their servers with `pdconnect.testbed.processes` from the tiny-engine recipe
(`pdconnect.testbed.recipes`); what they send and how they read the engines' counters
lives here, once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx

from pdconnect.bench.scrape import PrefixCacheCounters
from pdconnect.testbed.recipes import MODEL_NAME, SPEC
from pdconnect.testbed.tinymodel import FIRST_WORD_ID

__all__ = [
    "REQUEST_TIMEOUT_S",
    "Answer",
    "PDResult",
    "answer_of",
    "completed",
    "completion",
    "decode_answer",
    "prompt_ids",
    "remote_decode_plan",
    "serve_pd",
    "token_ids",
]

REQUEST_TIMEOUT_S = 300.0


def prompt_ids(seed: int, length: int, vocab_size: int = SPEC.vocab_size) -> list[int]:
    """Random word ids (no special tokens): each seed is a prefix no other test shares."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, vocab_size) for _ in range(length)]


def completion(
    client: httpx.Client,
    base_url: str,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> httpx.Response:
    """A greedy completion; random weights emit EOS now and then, so EOS is ignored."""
    payload: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    if kv_transfer_params is not None:
        payload["kv_transfer_params"] = kv_transfer_params
    return client.post(f"{base_url}/v1/completions", json=payload, headers=headers)


def completed(response: httpx.Response) -> dict[str, Any]:
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def token_ids(body: dict[str, Any]) -> list[int]:
    return list(body["choices"][0]["token_ids"])


@dataclass(frozen=True)
class Answer:
    """A decode answer: the tokens when served, else why not."""

    tokens: list[int] | None
    error: str = ""

    @property
    def served(self) -> bool:
        return self.tokens is not None


def answer_of(response: httpx.Response) -> Answer:
    if response.status_code >= 400:
        return Answer(None, f"HTTP {response.status_code}")
    choice = response.json()["choices"][0]
    if choice.get("finish_reason") == "error":
        return Answer(None, "finish_reason=error")
    return Answer(list(choice["token_ids"]))


def decode_answer(
    client: httpx.Client, base_url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None
) -> Answer:
    """A decode leg's answer; a connection that broke is an answer too (a fault test's)."""
    try:
        return answer_of(completion(client, base_url, prompt, max_tokens, params))
    except httpx.HTTPError as exc:
        return Answer(None, type(exc).__name__)


def remote_decode_plan(client: httpx.Client, prefill_url: str, prompt: list[int]) -> dict[str, Any]:
    """The kv_transfer_params a prefill engine returns for `prompt` asked for remote decode."""
    response = completion(client, prefill_url, prompt, 1, {"do_remote_decode": True})
    response.raise_for_status()
    params = response.json().get("kv_transfer_params")
    assert params, f"prefill returned no kv_transfer_params: {response.text[:500]}"
    return dict(params)


@dataclass(frozen=True)
class PDResult:
    """One request served prefill-then-decode, with each engine's counter deltas."""

    body: dict[str, Any]
    prefill: PrefixCacheCounters
    decode: PrefixCacheCounters

    @property
    def tokens(self) -> list[int]:
        return token_ids(self.body)


def serve_pd(
    client: httpx.Client,
    prefill_url: str,
    decode_url: str,
    prompt: list[int],
    max_tokens: int,
    prefill_params: dict[str, Any] | None = None,
    **extra: Any,
) -> PDResult:
    """The P/D flow without a router: one token on P asking for remote decode (our
    connector needs only `do_remote_decode`; vLLM's toy proxy sends more, `prefill_params`),
    then the original request on D with the kv_transfer_params P returned."""
    prefill_before = PrefixCacheCounters.scrape(prefill_url, client)
    decode_before = PrefixCacheCounters.scrape(decode_url, client)
    prefilled = completed(completion(client, prefill_url, prompt, 1, prefill_params or {"do_remote_decode": True}))
    params = prefilled.get("kv_transfer_params")
    assert params, f"prefill engine returned no kv_transfer_params: {prefilled}"
    body = completed(completion(client, decode_url, prompt, max_tokens, params, **extra))
    return PDResult(
        body=body,
        prefill=PrefixCacheCounters.scrape(prefill_url, client) - prefill_before,
        decode=PrefixCacheCounters.scrape(decode_url, client) - decode_before,
    )
