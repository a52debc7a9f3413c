"""PDConnector at scheduler level: real vLLM Schedulers, DeepSeek-V4-like geometry, bytes over a real transport.

The prefill engine runs in its own process; decode engines run here. Geometry: full
attention 256-token blocks, sliding window 64-token blocks, window 128, EAGLE on (a
block-size mix no tiny CPU model gives). Every test ends with both block pools back at
their starting free counts: nothing held, nothing leaked.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from connectors.kvsim import random_tokens
from connectors.replay_slack import plan_request
from connectors.vllm_adapter import CacheRules
from tests.params_fuzz import JSON_VALUES, cases, expected_ask, json_type
from tests.pd_harness import GEOMETRY, Finished, RemoteEngine, SimEngine, module_engine
from tests.waiting import wait_until

pytestmark = pytest.mark.transport

BASE = {
    "transport": "mooncake",
    "protocol": "tcp",
    "side_channel_port": 0,
    "lease_seconds": 4.0,
    "heartbeat_seconds": 1.0,
    "handshake_timeout_seconds": 5.0,
    "transfer_timeout_seconds": 10.0,
}
X_LEN, SUFFIX = 5131, 16
FA, SWA = 0, 1


# Chunked prefill: slack blocks are freed by later chunks, so they must be held as computed.
prefill = module_engine(
    RemoteEngine, role="kv_producer", extra=BASE, engine_id="prefill-0", max_num_batched_tokens=2048
)

decode = module_engine(SimEngine, role="kv_consumer", extra=BASE, engine_id="decode-0")

# Today's behaviour: only the window tail is received; failed loads recompute.
decode_stock = module_engine(
    SimEngine,
    role="kv_consumer",
    extra={**BASE, "replay_slack": False},
    engine_id="decode-stock",
    failure_policy="recompute",
)


@pytest.fixture
def clean(prefill, decode, decode_stock):
    """Fails the test if any block is still held once everything has ended."""
    yield
    for engine in (decode, decode_stock):
        engine.drain()
    prefill.wait_idle(timeout=15)
    assert prefill.call("free_blocks") == prefill.start_free_blocks
    for engine in (decode, decode_stock):
        assert engine.free_blocks() == engine.start_free_blocks, engine.engine_id


def _siblings(seed: int) -> tuple[list[int], list[int], list[int]]:
    tokens = random_tokens(X_LEN + 2 * SUFFIX, seed)
    x = tokens[:X_LEN]
    return x, x + tokens[X_LEN : X_LEN + SUFFIX], x + tokens[X_LEN + SUFFIX :]


def _serve(
    prefill: RemoteEngine, decode: SimEngine, request_id: str, tokens: list[int], max_tokens: int = 4
) -> Finished:
    params = prefill.prefill(request_id, tokens).kv_transfer_params
    assert params is not None
    decode.add(request_id, tokens, params, max_tokens)
    return decode.result(request_id)


def _expected_sibling_hit(first: list[int], shared: int, sibling: list[int]) -> int:
    rules = CacheRules.for_geometry(GEOMETRY)
    cached = plan_request(rules, len(first)).decode_cached_blocks()
    return rules.lookup_hit(cached, shared, len(sibling))


def _report(label: str, done: Finished) -> None:
    print(
        f"[scheduler-level] {label}: decode-local hit {done.local_cached_tokens}, "
        f"pulled {done.external_cached_tokens} tokens"
    )


def test_sibling_hits_locally_after_remote_load(prefill, decode, clean):
    x, xa, xb = _siblings(seed=1)

    first = _serve(prefill, decode, "s1-xa", xa)
    second = _serve(prefill, decode, "s1-xb", xb)

    expected = _expected_sibling_hit(xa, len(x), xb)
    assert expected == 4864
    assert first.local_cached_tokens == 0 and first.external_cached_tokens == len(xa)
    assert second.local_cached_tokens == expected
    assert second.external_cached_tokens == len(xb) - expected  # only the rest is pulled
    assert second.finish_reason == "length" and len(second.output_tokens) == 4
    _report("x+a (slack on)", first)
    _report("x+b (slack on)", second)


def test_stock_tail_only_loses_the_decode_local_hit(prefill, decode_stock, clean):
    _x, xa, xb = _siblings(seed=2)

    _serve(prefill, decode_stock, "s2-xa", xa)
    second = _serve(prefill, decode_stock, "s2-xb", xb)

    assert second.local_cached_tokens == 0
    assert second.external_cached_tokens == len(xb)  # the whole context is pulled again
    _report("x+b (slack off)", second)


def test_received_blocks_carry_the_prefill_kv_at_their_logical_positions(prefill, decode, clean):
    _, xa, _ = _siblings(seed=3)
    _serve(prefill, decode, "s3-xa", xa)

    plan = plan_request(CacheRules.for_geometry(GEOMETRY), len(xa))
    for group in (FA, SWA):
        cached = decode.cached_blocks(xa, group)
        assert set(cached) == set(plan.groups[group].cached_blocks)
        for index, block_id in cached.items():
            assert decode.block_matches(xa, group, index, block_id), (group, index)
    assert decode.counter("slack_blocks_published") >= 3
    assert decode.counter("ranges_transferred") > 0  # exported for bench-handoff's bare pulls


def test_overlapping_siblings_both_load_and_a_later_one_hits(prefill, decode, clean):
    x, xa, xb = _siblings(seed=4)
    xc = x + random_tokens(SUFFIX, seed=44)
    params_a = prefill.prefill("s4-xa", xa).kv_transfer_params
    params_b = prefill.prefill("s4-xb", xb).kv_transfer_params

    decode.add("s4-xa", xa, params_a)
    decode.add("s4-xb", xb, params_b)  # arrives while x+a is still loading
    a, b = decode.result("s4-xa"), decode.result("s4-xb")
    third = _serve(prefill, decode, "s4-xc", xc)

    assert a.finish_reason == b.finish_reason == "length"
    assert third.local_cached_tokens == _expected_sibling_hit(xa, len(x), xc)
    _report("x+c after overlapping x+a, x+b", third)


def test_prefill_abort_mid_prefill_releases_held_slack(prefill, clean):
    # 6244 tokens in 2048-token chunks: the slack (blocks 90-92, tokens 5760-5952) is
    # computed and held in the third chunk, and freed by the core in the fourth.
    tokens = random_tokens(6244, seed=5)
    plan = plan_request(CacheRules.for_geometry(GEOMETRY), len(tokens))
    assert plan.groups[SWA].slack_blocks == (90, 91, 92)

    before = prefill.call("counter", "slack_blocks_held")

    prefill.call("add_steps_abort", "s5", tokens, {"do_remote_decode": True}, 3)

    assert prefill.call("counter", "slack_blocks_held") == before  # never handed off


def test_decode_abort_before_allocation_releases_prefill_at_once(prefill, decode, clean):
    _, xa, _ = _siblings(seed=6)
    params = prefill.prefill("s6-xa", xa).kv_transfer_params
    before = prefill.call("counter", "releases")

    decode.add("s6-xa", xa, params)
    decode.abort("s6-xa")  # before any step: never scheduled

    # `releases` counts holds freed by a notice only (a lease that ran out counts elsewhere).
    wait_until(
        lambda: prefill.call("counter", "releases") > before,
        "prefill to free the hold on decode's release",
        observe=lambda: prefill.call("counter", "releases"),
    )


def test_a_release_is_counted_by_the_step_that_frees_its_blocks(decode, clean, monkeypatch):
    # The desk reports a lease's end and its running counter totals in separate frames. A
    # prefill engine steps only while it holds something, and the release is its last: if
    # only the totals frame carried the count and it came after that step, the count would
    # wait for the engine's next request (`pdconnect:releases` stale on an idle engine).
    prefill = SimEngine(role="kv_producer", extra=BASE, engine_id="prefill-local", max_num_batched_tokens=2048)
    try:
        _, xa, _ = _siblings(seed=8)
        prefill.add("s8-xa", xa, {"do_remote_decode": True}, 1)
        params = prefill.result("s8-xa").kv_transfer_params
        before = prefill.counter("releases")
        desk = prefill.connector.scheduler_half.producer.desk
        # A desk whose totals frame is late: it says what it said before the release.
        late = desk.totals()
        monkeypatch.setattr(desk, "totals", lambda: dict(late))

        decode.add("s8-xa", xa, params)
        decode.abort("s8-xa")  # never scheduled: decode sends a release
        prefill.run_until(lambda: prefill.free_blocks() == prefill.start_free_blocks, timeout=10)

        assert not prefill.has_requests()  # idle now: no later step would report it
        assert prefill.counter("releases") == before + 1
    finally:
        prefill.shutdown()


def test_decode_abort_while_loading_frees_shadow_blocks_unpublished(prefill, decode, clean):
    _, xa, _ = _siblings(seed=7)
    params = prefill.prefill("s7-xa", xa).kv_transfer_params

    decode.add_steps_abort("s7-xa", xa, params, steps=1, max_tokens=4)

    decode.drain()
    assert decode.cached_blocks(xa, SWA) == {}  # the aborted load published nothing


def test_decode_abort_while_decoding(prefill, decode, clean):
    """An abort after the load: the request ends, decode holds nothing for it, and prefill
    (told Done when the load finished) gets no release for a lease it no longer holds."""
    _, xa, _ = _siblings(seed=8)
    params = prefill.prefill("s8-xa", xa).kv_transfer_params
    releases = prefill.call("counter", "releases")
    decode.add("s8-xa", xa, params, max_tokens=1000)
    decode.run_until(lambda: len(decode.finished.get("s8-xa", Finished(None, None, [], 0, 0)).output_tokens) >= 2)
    decode.abort("s8-xa")
    decode.drain()

    assert decode.status("s8-xa") is None  # gone from the scheduler
    assert decode.connector.scheduler_half.blocks_held() == 0
    assert decode.free_blocks() == decode.start_free_blocks
    assert prefill.call("counter", "releases") == releases


def test_lease_expiry_frees_prefill_blocks_nobody_pulled(prefill, clean):
    _, xa, _ = _siblings(seed=9)
    before = prefill.call("counter", "lease_expiries")

    prefill.prefill("s9-xa", xa)
    prefill.wait_idle(timeout=15)

    assert prefill.call("counter", "lease_expiries") == before + 1


def _tampered(params: dict, **changes) -> dict:
    params = copy.deepcopy(params)
    params.update(changes)
    return params


# Ill-typed params (a field missing, of the wrong type) are not a failed load: they are
# served as if absent (test_decode_params_of_every_json_type_... below).
@pytest.mark.parametrize(
    ("label", "tamper", "reason"),
    [
        ("compat mismatch", lambda p: _tampered(p, compat_hash="0" * 16), "incompatible"),
        # Edited plans are refused by the prefill engine: a claim naming another engine by
        # its side channel, one naming another plan digest by the lease table.
        ("unknown engine", lambda p: _tampered(p, remote_engine_id="prefill-999"), "this is not engine 'prefill-999'"),
        (
            "bad block ids",
            lambda p: _tampered(
                p,
                groups=[
                    {
                        **g,
                        "runs": [{"start": r["start"], "block_ids": [10**6] * len(r["block_ids"])} for r in g["runs"]],
                    }
                    for g in p["groups"]
                ],
            ),
            "differs from the plan lent",
        ),
        (
            "index past the prompt",
            lambda p: _tampered(p, groups=[{**g, "runs": [{"start": 10**4, "block_ids": [1]}]} for g in p["groups"]]),
            "the prompt has",
        ),
        (
            "prefill unreachable",
            lambda p: _tampered(p, remote_engine_id="prefill-gone", remote_port=1),
            "not sent: no connection",
        ),
    ],
)
def test_bad_transfer_params_end_the_request_with_an_error_and_leak_nothing(
    prefill, decode, clean, caplog, label, tamper, reason
):
    _, xa, _ = _siblings(seed=10 + len(label))
    params = tamper(prefill.prefill(f"bad-{label}", xa).kv_transfer_params)

    decode.add(f"bad-{label}", xa, params)
    done = decode.result(f"bad-{label}")

    assert done.finish_reason == "error"
    assert reason in caplog.text
    # The engine keeps serving.
    assert _serve(prefill, decode, f"after-{label}", random_tokens(600, seed=99 + len(label))).finish_reason == "length"


def test_recompute_policy_serves_the_request_despite_a_failed_load(prefill, decode_stock, clean, caplog):
    _, xa, _ = _siblings(seed=11)
    params = _tampered(prefill.prefill("s11-xa", xa).kv_transfer_params, remote_engine_id="prefill-999")

    decode_stock.add("s11-xa", xa, params, max_tokens=4)
    done = decode_stock.result("s11-xa")

    assert done.finish_reason == "length" and len(done.output_tokens) == 4
    assert "this is not engine 'prefill-999'" in caplog.text


def test_wrong_secret_is_refused_with_a_clear_error(prefill, clean, caplog):
    # The harness gives each role its keys; this decode engine signs with a key nobody trusts.
    wrong = SimEngine(
        role="kv_consumer", extra={**BASE, "secret": "not-the-decode-secret-" + "x" * 20}, engine_id="decode-bad"
    )
    try:
        _, xa, _ = _siblings(seed=12)
        params = prefill.prefill("s12-xa", xa).kv_transfer_params
        wrong.add("s12-xa", xa, params)
        assert wrong.result("s12-xa").finish_reason == "error"
        assert "authentication failed" in caplog.text
        wrong.drain()
        assert wrong.free_blocks() == wrong.start_free_blocks
    finally:
        wrong.shutdown()


def test_nixl_transport_restores_the_sibling_hit_too():
    extra = {**BASE, "transport": "nixl"}
    prefill = RemoteEngine(role="kv_producer", extra=extra, engine_id="prefill-nixl")
    decode = SimEngine(role="kv_consumer", extra=extra, engine_id="decode-nixl")
    try:
        x, xa, xb = _siblings(seed=13)
        _serve(prefill, decode, "n-xa", xa)
        second = _serve(prefill, decode, "n-xb", xb)
        assert second.local_cached_tokens == _expected_sibling_hit(xa, len(x), xb)
        assert decode.cached_blocks(xa, SWA) and all(
            decode.block_matches(xa, SWA, i, b) for i, b in decode.cached_blocks(xa, SWA).items()
        )
        _report("x+b over NIXL (slack on)", second)
        decode.drain()
        prefill.wait_idle()
        assert decode.free_blocks() == decode.start_free_blocks
        assert prefill.call("free_blocks") == prefill.start_free_blocks
    finally:
        prefill.stop()
        decode.shutdown()


def test_a_pull_that_ends_while_its_step_computes_is_reported_by_that_step(monkeypatch):
    """The poll round follows the pull's submission on the transport thread, so the step that
    posted a read the library ended meanwhile reports it. Over NIXL on loopback the read ends
    inside the posting call; the step waits, after computing, for the transport thread to be
    idle. A round begun only by the step's `transfer_results` reports it a step later."""
    extra = {**BASE, "transport": "nixl"}
    prefill = RemoteEngine(role="kv_producer", extra=extra, engine_id="prefill-steps")
    decode = SimEngine(role="kv_consumer", extra=extra, engine_id="decode-steps")
    posted: list[set[str]] = []  # per step: the pulls its metadata posted, and those it reported
    reported: list[set[str]] = []
    start, results, compute = decode.worker.start, decode.worker.transfer_results, decode._compute

    def start_and_record(metadata):
        posted.append({pull.request_id for pull in metadata.pulls})
        reported.append(set())
        start(metadata)

    def compute_then_let_the_transport_thread_finish(scheduled):
        sampled = compute(scheduled)
        decode.worker._executor.submit(lambda: None).result(timeout=30)
        return sampled

    def record_results():
        out = results()
        reported[-1] = set(out.finished_recving)
        return out

    monkeypatch.setattr(decode.worker, "start", start_and_record)
    monkeypatch.setattr(decode, "_compute", compute_then_let_the_transport_thread_finish)
    monkeypatch.setattr(decode.worker, "transfer_results", record_results)
    try:
        tokens = random_tokens(X_LEN, seed=17)
        # The first pull handshakes and opens NIXL's connection to the peer, which may take
        # longer than a round waits; the second reads over that connection.
        for last, request_id in enumerate(("steps-warm-up", "steps")):
            prompt = [*tokens, last + 1]
            params = prefill.prefill(request_id, prompt).kv_transfer_params
            decode.add(request_id, prompt, params)
            assert decode.result(request_id).finish_reason == "length"
        posted_at = next(step for step, ids in enumerate(posted) if "steps" in ids)
        reported_at = next(step for step, ids in enumerate(reported) if "steps" in ids)
        assert reported_at == posted_at, (posted[posted_at:], reported[posted_at:])
        decode.drain()
        prefill.wait_idle()
    finally:
        prefill.stop()
        decode.shutdown()


# --- kv_transfer_params of every JSON type, at every level ------------------------------------


def test_decode_params_of_every_json_type_are_served_locally_or_refused_never_crash(prefill, decode, clean):
    """Every case of `tests.params_fuzz` (every JSON type at every place of a real plan) on
    a real Scheduler: invalid params are counted and computed locally (no token pulled);
    well-typed plans load or fail under the policy; the scheduler never raises."""
    tokens = random_tokens(600, seed=120)
    plan = prefill.prefill("json-types-plan", tokens).kv_transfer_params
    assert plan is not None
    fuzz = cases(plan)
    before = decode.counter("invalid_transfer_params")
    outcomes: Counter[str] = Counter()
    for n, case in enumerate(fuzz):
        expected = expected_ask(case.params)
        decode.add(f"jt{n}", tokens, case.params, max_tokens=1)
        done = decode.result(f"jt{n}", timeout=30)
        outcomes[f"{expected}: {done.finish_reason}"] += 1
        if expected == "plan":
            assert done.finish_reason in ("length", "error"), case.name
        else:
            assert (done.finish_reason, done.external_cached_tokens) == ("length", 0), case.name
    invalid = sum(expected_ask(case.params) == "invalid" for case in fuzz)
    decode.drain()
    print(f"[json-type fuzz] {len(fuzz)} cases: {dict(outcomes)}")
    assert invalid > 300  # the generator really produces ill-typed params at every level
    assert decode.counter("invalid_transfer_params") - before == invalid
    assert decode.connector.scheduler_half.params.tracked() == 0  # nothing kept per request
    # The engine keeps serving P/D: the next request loads, and its KV is the prefill engine's.
    _, xa, _ = _siblings(seed=121)
    done = _serve(prefill, decode, "after-json-types", xa)
    assert done.finish_reason == "length" and done.external_cached_tokens == len(xa)
    assert all(decode.block_matches(xa, SWA, i, b) for i, b in decode.cached_blocks(xa, SWA).items())


def test_prefill_params_of_every_json_type_hand_off_only_when_asked(prefill, clean):
    """The prefill leg's params, whole and `do_remote_decode`, as every JSON value: only
    `{"do_remote_decode": true}` opens a lease; the rest are computed and hand off nothing."""
    tokens = random_tokens(600, seed=122)
    before = prefill.call("counter", "invalid_transfer_params")
    legs = [("<params>", value) for value in JSON_VALUES] + [
        ("do_remote_decode", {"do_remote_decode": value}) for value in JSON_VALUES
    ]
    invalid = 0
    for n, (place, params) in enumerate(legs):
        prefill.call("add", f"pj{n}", tokens, params, 1, None)
        done = wait_until(lambda n=n: prefill.call("get_finished", f"pj{n}"), f"{place}={params!r} to finish")
        asked = isinstance(params, dict) and params.get("do_remote_decode") is True
        assert done.finish_reason == "length", (place, params)
        assert (done.kv_transfer_params is not None) == asked, (place, params, done.kv_transfer_params)
        flag = params.get("do_remote_decode") if isinstance(params, dict) else None
        invalid += params is not None and (not isinstance(params, dict) or json_type(flag) not in ("bool", "null"))
    prefill.wait_idle(timeout=15)
    assert prefill.call("counter", "invalid_transfer_params") - before == invalid
