"""The private aiohttp internals the router builds on are still there, in the aiohttp pyproject allows.

`pdconnect.router.listener` bounds the time a request head may take by subclassing aiohttp's
`RequestHandler` and `web.Server` and reading their private state; `pdconnect.router.flow`
sends a stream's headers with its first bytes through a private class flag. aiohttp may
move any of them in a release, so pyproject.toml allows only the minor series they were
read from, and this test fails (naming what moved) when the installed aiohttp lacks one,
before the behaviour tests in test_router_edge.py and test_router_flow.py fail less clearly.
"""

from __future__ import annotations

import asyncio
import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]

# What `_HeadDeadlineHandler` reads or calls on itself (listener.py).
HANDLER_STATE = ("_request_count", "_messages", "_current_request", "_force_close", "_close", "_manager", "_loop")
HANDLER_METHODS = ("data_received", "connection_lost", "force_close")
# What `_HeadDeadlineServer` copies from the server aiohttp built (listener.py).
SERVER_STATE = ("_loop", "_kwargs", "request_handler", "request_factory", "handler_cancellation")


def _slots(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())}


def test_installed_aiohttp_is_in_the_series_pyproject_allows() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    [spec] = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "aiohttp"]
    assert spec.specifier.contains(version("aiohttp")), (version("aiohttp"), str(spec))
    # One minor series: the internals are read from it, a new minor may move them.
    bounds = {s.operator: tuple(int(part) for part in s.version.split(".")[:2]) for s in spec.specifier}
    assert set(bounds) == {">=", "<"}, str(spec)
    (major, minor), upper = bounds[">="], bounds["<"]
    assert upper == (major, minor + 1), f"{spec} spans more than one minor series"


def test_request_handler_still_has_the_state_the_head_deadline_reads() -> None:
    missing = [name for name in HANDLER_STATE if name not in _slots(RequestHandler)]
    assert missing == [], f"aiohttp's RequestHandler no longer has {missing}: see _HeadDeadlineHandler"
    for name in HANDLER_METHODS:
        assert callable(getattr(RequestHandler, name, None)), name


def test_server_still_keeps_what_the_head_deadline_server_copies() -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response()

    async def build() -> web.Server:
        return web.Server(handler, handler_cancellation=True, access_log=None)

    server = asyncio.run(build())
    missing = [name for name in SERVER_STATE if not hasattr(server, name)]
    assert missing == [], f"aiohttp's web.Server no longer has {missing}: see _HeadDeadlineServer"
    assert server._kwargs.get("access_log", "absent") is None  # the options ride in _kwargs
    assert inspect.iscoroutinefunction(web.AppRunner._make_server), "AppRunner._make_server moved"


def test_stream_response_still_has_the_deferred_header_flag() -> None:
    from pdconnect.router.writer import HeadersWithBodyResponse

    assert web.StreamResponse._send_headers_immediately is True, "the flag moved (aiohttp 3.12+)"
    assert HeadersWithBodyResponse._send_headers_immediately is False
