"""A data-parallel prefill server: each engine core lends its blocks from its own side channel.

A prefill server started with `--data-parallel-size N` has N engine cores, each with its
own KV cache, its own producer and lease desk. Real vLLM Schedulers with our connector
(`tests.pd_harness`), real desks and Mooncake over loopback: two prefill cores of one
server configured with the same `side_channel_port`, as every core of a server is, and
the engine ids vLLM gives them (`<id>_dp<rank>`). A plan must name the core that holds
the blocks (its id and its port: the configured one plus its rank), so the decode engine
claims from, reads from and confirms to that core, and only that core frees its blocks.
`make bench-parallel`'s `dp2-*` shapes run the same on real engines.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from connectors.kvsim import random_tokens
from tests.connector_support import loopback_settings
from tests.pd_harness import SimEngine, module_engine

pytestmark = pytest.mark.transport

SERVER_ID = "prefill-dp"

decode = module_engine(SimEngine, role="kv_consumer", extra=loopback_settings(), engine_id="decode-dp-prefill")


def _free_port_pair() -> int:
    """The first of two consecutive free ports on loopback."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", 0))
                base = int(first.getsockname()[1])
                second.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def cores() -> Iterator[tuple[int, list[SimEngine]]]:
    base = _free_port_pair()
    extra = loopback_settings() | {"side_channel_port": base}
    engines = [
        SimEngine(role="kv_producer", extra=extra, engine_id=f"{SERVER_ID}_dp{rank}", dp_rank=rank) for rank in (0, 1)
    ]
    yield base, engines
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize("rank", [1, 0])
def test_each_prefill_core_lends_from_its_own_port_and_frees_alone(cores, decode, rank):
    base, engines = cores
    lender, other = engines[rank], engines[1 - rank]
    tokens = random_tokens(1000, seed=3120 + rank)
    request_id = f"dp-prefill-{rank}"
    lender.add(request_id, tokens, {"do_remote_decode": True}, 1)
    params = lender.result(request_id).kv_transfer_params
    assert params is not None
    assert (params["remote_engine_id"], params["remote_port"]) == (f"{SERVER_ID}_dp{rank}", base + rank)
    assert lender.free_blocks() < lender.start_free_blocks  # lent, held until decode is done

    decode.add(request_id, tokens, params)
    done = decode.result(request_id)
    assert done.finish_reason != "error"
    assert done.external_cached_tokens == len(tokens)
    decode.drain()
    assert decode.free_blocks() == decode.start_free_blocks

    # The decode engine's done reached the core that lent: it frees, the other lent nothing.
    lender.run_until(
        lambda: lender.free_blocks() == lender.start_free_blocks and not lender.has_requests(),
        what="the lending core to free its blocks",
    )
    assert lender.counter("releases") == 0 and lender.counter("lease_expiries") == 0
    assert other.free_blocks() == other.start_free_blocks
