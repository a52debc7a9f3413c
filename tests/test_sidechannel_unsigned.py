"""A decode engine without side-channel keys follows plans naming this machine only.

A plan names the host its prefill engine answers on, and anyone can write a plan (it
arrives in a request's `kv_transfer_params`). Without keys nothing proves who answers
there, so a decode engine that trusted unsigned answers from any host a plan names
could be handed anyone's bytes and publish them. A real scheduler and connector half
(`tests.pd_harness.SimEngine`) gets plans that name another machine and this one.
"""

from __future__ import annotations

import logging

import pytest

from connectors.kvsim import random_tokens
from tests.pd_harness import SimEngine

pytestmark = pytest.mark.transport

UNSIGNED = {"transport": "mooncake", "protocol": "tcp", "side_channel_port": 0, "secret": None, "peer_keys": None}


def _plan(host: str) -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "p0",
        "remote_request_id": "r",
        "remote_host": host,
        "remote_port": 5700,
        "compat_hash": "not-this-engine",
        "num_prompt_tokens": 300,
        "lease_expires_at": 0.0,
        "groups": [],
        "lease_id": "lease",
        "prompt_digest": "d",
    }


def test_an_unsigned_decode_engine_refuses_plans_naming_another_machine(caplog) -> None:
    caplog.set_level(logging.ERROR, logger="pdconnect.connector")
    decode = SimEngine(role="kv_consumer", extra=UNSIGNED, engine_id="decode-unsigned")
    try:
        tokens = random_tokens(300, seed=7)
        for request_id, host in (("remote", "10.9.8.7"), ("named", "prefill-0.pd.svc"), ("local", "127.0.0.1")):
            decode.add(request_id, tokens, _plan(host))
            assert decode.result(request_id).finish_reason == "error", host
        refusals = [r.getMessage() for r in caplog.records if "refusing kv_transfer_params" in r.getMessage()]
        refused = [m for m in refusals if "not this machine" in m]
        assert len(refused) == 2 and "10.9.8.7" in refused[0] and "prefill-0.pd.svc" in refused[1]
        # This machine's plan passed that check and was refused for what it is (another engine's).
        # No engine listens there: the handshake that would name the differing fields fails.
        (local,) = [m for m in refusals if m.startswith("request local")]
        assert local.startswith(
            "request local: refusing kv_transfer_params: kv_transfer_params come from an incompatible prefill "
            "engine: 'p0' at tcp://127.0.0.1:5700: its compat digest differs and its handshake failed"
        ), local
        decode.drain()
        assert decode.free_blocks() == decode.start_free_blocks
    finally:
        decode.shutdown()
