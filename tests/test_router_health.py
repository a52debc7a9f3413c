"""Engine health: the circuit breaker's states, active-poll verdicts, and the registry's
membership rules (several sources per engine, DNS sync)."""

from __future__ import annotations

from pdconnect.router.breaker import BreakerState, CircuitBreaker
from pdconnect.router.engines import Engine, EngineRegistry, Role
from tests.router_support import ManualClock
from tests.waiting import wait_until_async


def test_breaker_opens_at_the_threshold_and_lets_one_trial_through_after_cooldown() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown=10.0, clock=clock)
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now += 10.0
    assert breaker.allows()
    breaker.on_attempt()
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allows()  # only one trial at a time
    assert breaker.record_failure()  # a failed trial reopens at once
    assert breaker.opens == 2 and not breaker.allows()
    clock.now += 10.0
    breaker.on_attempt()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allows()


def test_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=3, cooldown=10.0, clock=ManualClock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_a_trial_that_never_reports_back_stops_blocking_after_a_cooldown() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown=5.0, clock=clock)
    breaker.record_failure()
    clock.now += 5.0
    breaker.on_attempt()  # its client vanished; no verdict ever comes
    assert not breaker.allows()
    clock.now += 5.0
    assert breaker.allows()


def engine(probe_ok: bool | None = None) -> Engine:
    return Engine(url="http://e:1", role=Role.DECODE, breaker=CircuitBreaker(3, 10.0), probe_ok=probe_ok)


def test_new_engine_is_not_routable_until_a_poll_answers() -> None:
    e = engine()
    assert not e.routable
    e.record_probe(False, failures_to_down=2)
    assert e.probe_ok is False
    e.record_probe(True, failures_to_down=2)
    assert e.routable


def test_a_live_engine_goes_down_only_after_consecutive_failed_polls() -> None:
    e = engine(probe_ok=True)
    e.record_probe(False, failures_to_down=2)
    assert e.routable
    e.record_probe(False, failures_to_down=2)
    assert not e.routable


def test_attempt_verdicts_feed_the_breaker_and_the_failure_count() -> None:
    e = engine(probe_ok=True)
    for _ in range(3):
        e.begin()
        e.end(False)
    assert e.failures == 3 and not e.routable and e.in_flight == 0
    e.begin()
    e.end(None)  # no verdict: the client left
    assert e.failures == 3


def registry() -> EngineRegistry:
    return EngineRegistry(make_breaker=lambda: CircuitBreaker(3, 10.0), probed=True)


def test_engine_stays_while_any_source_lists_it() -> None:
    r = registry()
    added: list[str] = []
    r.on_added.append(lambda e: added.append(e.url))
    r.add(Role.DECODE, "http://a:1", "static")
    r.add(Role.DECODE, "http://a:1", "dns:x")
    assert added == ["http://a:1"]
    assert not r.remove(Role.DECODE, "http://a:1", "dns:x")
    assert [e.url for e in r.engines(Role.DECODE)] == ["http://a:1"]
    assert r.remove(Role.DECODE, "http://a:1", "static")
    assert r.engines(Role.DECODE) == ()


def test_sync_follows_one_source_and_leaves_others_alone() -> None:
    r = registry()
    r.add(Role.PREFILL, "http://static:1", "static")
    r.sync(Role.PREFILL, "dns:p", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    snapshot = r.engines(Role.PREFILL)
    r.sync(Role.PREFILL, "dns:p", ["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    assert sorted(e.url for e in r.engines(Role.PREFILL)) == [
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
        "http://static:1",
    ]
    assert r.engines(Role.PREFILL) is not snapshot  # policies rebuild their ring
    r.sync(Role.PREFILL, "dns:p", ["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    assert r.engines(Role.DECODE) == ()


class _FlakyRegistry:
    """A registry whose listing fails unexpectedly once (a bug anywhere in a round)."""

    def __init__(self) -> None:
        self.calls = 0

    def all_engines(self) -> tuple[Engine, ...]:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected: a bug in one health round")
        return ()


def test_the_health_loop_logs_counts_and_survives_an_unexpected_error() -> None:
    import asyncio

    import aiohttp

    from pdconnect.router.health import HealthMonitor

    async def scenario() -> None:
        registry = _FlakyRegistry()
        errors: list[None] = []
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(
                registry,  # type: ignore[arg-type]  # only all_engines is called, and fails once
                session,
                0.01,
                1.0,
                2,
                on_error=lambda: errors.append(None),
            )
            task = asyncio.create_task(monitor.run())
            await wait_until_async(
                lambda: registry.calls >= 3 or task.done(), "three health rounds", observe=lambda: registry.calls
            )
            assert not task.done(), task.exception()
            task.cancel()
        assert errors == [None]

    asyncio.run(scenario())


def test_a_probe_failing_unexpectedly_is_a_failed_poll_and_counted() -> None:
    import asyncio

    from pdconnect.router.health import HealthMonitor

    class Broken:
        def get(self, *args: object, **kwargs: object) -> None:
            raise ValueError("injected: a session that raises what aiohttp never would")

    async def scenario() -> None:
        errors: list[None] = []
        e = engine(probe_ok=True)
        monitor = HealthMonitor(
            registry(),
            Broken(),  # type: ignore[arg-type]  # a session whose get raises
            1.0,
            1.0,
            1,
            on_error=lambda: errors.append(None),
        )
        await monitor.poll([e])
        assert e.probe_ok is False and errors == [None]

    asyncio.run(scenario())
