"""The tests' one way to wait for something: poll a condition until it holds, or fail saying what.

A condition returns a truthy value once what the test waits for has happened. When it never
does, the AssertionError names what was awaited, for how long, and what was last observed:
the condition's last value, or, for a condition that only says yes or no, what `observe`
returns at the end (the count the test waited on, say). `within` (seconds) bounds a hang
and is never a measurement: no test asserts on how long a wait took.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

# Long enough for an engine step on two shared cores; a wait that needs more says why.
DEFAULT_TIMEOUT_S = 30.0
_POLL_S = 0.02


def _failure(what: str, within: float, last: object) -> AssertionError:
    return AssertionError(f"waited {within:g} s for {what}; last observed: {last!r}")


def wait_until(
    condition: Callable[[], T],
    what: str,
    within: float = DEFAULT_TIMEOUT_S,
    observe: Callable[[], object] | None = None,
    *,
    poll_s: float = _POLL_S,
) -> T:
    """Poll `condition` until it returns a truthy value, and return that value. `poll_s`: the
    pause between looks (shorter for a wait repeated a thousand times in one test)."""
    deadline = time.monotonic() + within
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _failure(what, within, last if observe is None else observe())
        time.sleep(poll_s)


@overload
async def wait_until_async(
    condition: Callable[[], Awaitable[T]],
    what: str,
    within: float = ...,
    observe: Callable[[], object] | None = ...,
) -> T: ...


@overload
async def wait_until_async(
    condition: Callable[[], T],
    what: str,
    within: float = ...,
    observe: Callable[[], object] | None = ...,
) -> T: ...


async def wait_until_async(
    condition: Callable[[], Any],
    what: str,
    within: float = DEFAULT_TIMEOUT_S,
    observe: Callable[[], object] | None = None,
) -> Any:
    """`wait_until` for a test on an event loop: sleeps without blocking it; the condition
    may be a coroutine function."""
    deadline = time.monotonic() + within
    while True:
        result = condition()
        last = await result if inspect.isawaitable(result) else result
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _failure(what, within, last if observe is None else observe())
        await asyncio.sleep(_POLL_S)
