"""The scheduler half's idle wait: a step that schedules nothing sleeps until a peer answers, and only then.

Real vLLM Schedulers with our connector (`tests.pd_harness`), a real lease desk and side
channel: a prefill engine lending a lease sleeps until the lease ends, a decode engine
whose request waits for its claim sleeps until the answer is in, and neither sleeps
while it has something to do (a load in flight, ended leases to collect) or waits for
nothing. Each wait is given a minute: a wait that news does not end fails the test by
returning False, never by a clock comparison.
"""

from __future__ import annotations

import os
import signal

import pytest

from connectors.kvsim import random_tokens
from connectors.scheduler import IDLE_WAIT_SECONDS, PDScheduler
from connectors.settings import ConnectorSettings
from connectors.vllm_adapter import build_kv_cache_config
from pdconnect.testbed.processes import freeze
from tests.connector_support import loopback_settings
from tests.pd_harness import GEOMETRY, RemoteEngine, SimEngine, engine_config, module_engine

pytestmark = pytest.mark.transport

BASE = loopback_settings()
MINUTE = 60.0


prefill = module_engine(
    RemoteEngine, role="kv_producer", extra=BASE, engine_id="prefill-idle", max_num_batched_tokens=2048
)

decode = module_engine(SimEngine, role="kv_consumer", extra=BASE, engine_id="decode-idle")


def test_an_engine_that_waits_for_nothing_never_sleeps(decode):
    assert decode.connector.scheduler_half.wait_while_idle(MINUTE) is None


def test_a_decode_engine_whose_claim_is_unanswered_sleeps_until_the_answer(prefill, decode):
    tokens = random_tokens(1500, seed=41)
    params = prefill.prefill("i41", tokens).kv_transfer_params
    half = decode.connector.scheduler_half
    assert half.consumer is not None

    decode.add("i41", tokens, params)  # claims at once; nothing has stepped yet

    # True: the answer ended the sleep; None: it was in before the look. Never False.
    assert half.wait_while_idle(MINUTE) is not False
    assert half.consumer.has_work()  # the answer, queued for the next step
    done = decode.result("i41")
    assert done.external_cached_tokens == len(tokens)
    decode.drain()
    assert decode.free_blocks() == decode.start_free_blocks


def test_a_decode_engine_never_sleeps_while_a_load_is_in_flight(prefill, decode):
    first, second = random_tokens(1500, seed=42), random_tokens(1500, seed=44)
    params = {rid: prefill.prefill(rid, tokens).kv_transfer_params for rid, tokens in (("i42", first), ("i44", second))}
    half = decode.connector.scheduler_half
    decode.add("i42", first, params["i42"])
    decode.run_until(lambda: decode.status("i42") == "WAITING_FOR_REMOTE_KVS", what="the load posted")
    desk = prefill.call("desk_pid")
    freeze(desk)  # the load cannot be confirmed, and the next claim is not answered
    try:
        decode.add("i44", second, params["i44"])
        assert half.consumer is not None and half.consumer.claims_pending()

        # A claim waits, but only the workers report the load's end, a step at a time:
        # sleeping would delay that.
        assert half.wait_while_idle(MINUTE) is None
    finally:
        os.kill(desk, signal.SIGCONT)
    for request_id in ("i42", "i44"):
        decode.result(request_id)
    decode.drain()
    assert decode.free_blocks() == decode.start_free_blocks


def test_a_prefill_engine_lending_a_lease_sleeps_until_it_ends(decode):
    prefill = SimEngine(role="kv_producer", extra=BASE, engine_id="prefill-local-idle", max_num_batched_tokens=2048)
    try:
        tokens = random_tokens(1500, seed=43)
        prefill.add("i43", tokens, {"do_remote_decode": True}, 1)
        params = prefill.result("i43").kv_transfer_params
        half = prefill.connector.scheduler_half
        assert half.producer is not None
        assert half.wait_while_idle(0.0) is False  # a lease is out and nothing ended it

        decode.add("i43", tokens, params)
        decode.abort("i43")  # never scheduled: decode sends a release, which ends the lease

        assert half.wait_while_idle(MINUTE) is not False
        assert half.producer.has_news()
        prefill.run_until(lambda: prefill.free_blocks() == prefill.start_free_blocks, timeout=10)
        assert half.wait_while_idle(MINUTE) is None  # nothing lent any more
    finally:
        prefill.shutdown()


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "async_scheduling", "sleeps"),
    [
        (2, 1, 1, False, True),
        (1, 1, 1, False, False),  # no workers to spare a wake-up: vLLM's pace
        (2, 2, 1, False, False),  # a batch may be in flight behind an empty step
        (2, 1, 1, True, False),  # likewise
        (2, 1, 2, False, False),  # DP ranks step in lockstep: one asleep holds the others
    ],
)
def test_only_a_tensor_parallel_engine_whose_sleep_holds_nothing_back_sleeps(tp, pp, dp, async_scheduling, sleeps):
    config = engine_config("kv_consumer", BASE, f"decode-tp{tp}-pp{pp}-dp{dp}")
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.pipeline_parallel_size = pp
    config.parallel_config.data_parallel_size = dp
    config.scheduler_config.async_scheduling = async_scheduling
    settings = ConnectorSettings.from_extra_config(config.kv_transfer_config.kv_connector_extra_config)
    half = PDScheduler(config, build_kv_cache_config(GEOMETRY, 100), settings)
    try:
        assert half.idle_wait_seconds == (IDLE_WAIT_SECONDS if sleeps else 0.0)
    finally:
        half.shutdown()
