"""Shared pieces of the real-engine tests: engine arguments, prompts, requests, the P/D flow.

Every real-engine test module boots its own servers with `pdconnect.bench.cluster`; what
they send and how they read the engines' counters lives here, once.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdconnect.bench.cluster import PrefixCacheCounters
from pdconnect.bench.tinymodel import FIRST_WORD_ID, TinyModelSpec

MODEL_NAME = "tiny"
SPEC = TinyModelSpec(kind="hybrid-llama", num_layers=4, sliding_window=64)
BLOCK_SIZE = 128
REQUEST_TIMEOUT_S = 300.0


def engine_args(draft: Path | None, kv_transfer: dict[str, Any] | None = None, *,
                block_size: int = BLOCK_SIZE, num_speculative_tokens: int = 2) -> list[str]:
    """vLLM server flags shared by every engine of a test: float32 (no bf16 first-forward
    crash, ENV.md), no torch.compile (50 s of start-up for nothing at this size)."""
    args = [
        "--dtype", "float32",
        "--block-size", str(block_size),
        "--max-model-len", "4096",
        "--compilation-config", json.dumps({"mode": 0}),
        "--enable-prompt-tokens-details",
    ]
    if draft is not None:
        args += ["--speculative-config", json.dumps(
            {"method": "eagle3", "model": str(draft), "num_speculative_tokens": num_speculative_tokens})]
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return args


def pd_kv_transfer(role: str, transport: str, **extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` for our connector on loopback. The side channel binds any
    free port (plans carry the real one): a port picked in advance can be taken by the
    time an engine binds it, a minute into start-up."""
    return {
        "kv_connector": "PDConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"transport": transport, "protocol": "tcp", "side_channel_port": 0, **extra},
    }


def prompt_ids(seed: int, length: int, vocab_size: int = SPEC.vocab_size) -> list[int]:
    """Random word ids (no special tokens): each seed is a prefix no other test shares."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, vocab_size) for _ in range(length)]


def completion(client: httpx.Client, base_url: str, prompt: list[int], max_tokens: int,
               kv_transfer_params: dict[str, Any] | None = None, **extra: Any) -> httpx.Response:
    """A greedy completion; random weights emit EOS now and then, so EOS is ignored."""
    payload: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                               "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}
    if kv_transfer_params is not None:
        payload["kv_transfer_params"] = kv_transfer_params
    return client.post(f"{base_url}/v1/completions", json=payload)


def completed(response: httpx.Response) -> dict[str, Any]:
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def token_ids(body: dict[str, Any]) -> list[int]:
    return list(body["choices"][0]["token_ids"])


@dataclass(frozen=True)
class PDResult:
    """One request served prefill-then-decode, with each engine's counter deltas."""

    body: dict[str, Any]
    prefill: PrefixCacheCounters
    decode: PrefixCacheCounters

    @property
    def tokens(self) -> list[int]:
        return token_ids(self.body)


def serve_pd(client: httpx.Client, prefill_url: str, decode_url: str, prompt: list[int],
             max_tokens: int, prefill_params: dict[str, Any] | None = None, **extra: Any) -> PDResult:
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
