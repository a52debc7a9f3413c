"""The tests' wait helper: it returns what the condition saw, and its failure says what it waited for."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import wait_until, wait_until_async


def test_wait_until_returns_the_conditions_first_truthy_value() -> None:
    calls = itertools.count(1)
    assert wait_until(lambda: max(0, next(calls) - 2) and "third call", "the third call") == "third call"


def test_a_wait_that_never_ends_says_what_it_waited_for_how_long_and_what_it_saw() -> None:
    with pytest.raises(AssertionError) as failure:
        wait_until(list, "the queue to fill", within=0.05)
    assert str(failure.value) == "waited 0.05 s for the queue to fill; last observed: []"


def test_observe_says_what_a_yes_or_no_condition_looked_at() -> None:
    free = [287]
    with pytest.raises(AssertionError, match=r"for 299 free blocks; last observed: '287 free'$"):
        wait_until(lambda: free[0] == 299, "299 free blocks", within=0.05, observe=lambda: f"{free[0]} free")


def test_the_async_twin_awaits_a_coroutine_condition_and_fails_alike() -> None:
    seen: list[int] = []

    async def grows() -> int:
        seen.append(len(seen))
        return len(seen) if len(seen) >= 3 else 0

    async def never() -> int:
        return 0

    async def scenario() -> None:
        assert await wait_until_async(grows, "three polls") == 3
        assert await wait_until_async(lambda: len(seen), "a plain condition") == 3
        with pytest.raises(AssertionError, match=r"^waited 0.05 s for nothing; last observed: 0$"):
            await wait_until_async(never, "nothing", within=0.05)

    asyncio.run(scenario())
