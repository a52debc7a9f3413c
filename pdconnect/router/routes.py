"""How the router's apps answer: each route's errors as OpenAI error JSON, and 404/405 for what no route serves.

Every error the router answers itself is OpenAI error JSON (`errors.openai_error_body`):
its own causes (`errors.RouterError`) and aiohttp's, which are plain text otherwise. Each
route is wrapped (`add_route`) rather than the app given a middleware, and a catch-all
route (`answer_unrouted`) stands in for aiohttp's own 404 and 405.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from pdconnect.router.errors import ClientError, EngineRejected, RouterError, openai_error_body

__all__ = ["Handler", "add_route", "answer_unrouted", "error_response", "openai_error"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_error(status: int, message: str, kind: str) -> web.Response:
    """An error answered in OpenAI's JSON shape."""
    return web.Response(status=status, body=openai_error_body(status, message, kind), content_type="application/json")


def error_response(exc: RouterError) -> web.Response:
    """The answer to a request the router failed with `exc`: its status and OpenAI error JSON."""
    if isinstance(exc, EngineRejected):
        return web.Response(status=exc.status, body=exc.body, headers={"Content-Type": exc.content_type})
    if isinstance(exc, ClientError):  # OpenAI's own type, param and code (401, 404 model, 429, ...)
        body = openai_error_body(exc.http_status, str(exc), exc.error_type, exc.param, exc.code)
        return web.Response(status=exc.http_status, body=body, content_type="application/json", headers=exc.headers)
    response = openai_error(exc.http_status, str(exc), type(exc).__name__)
    if exc.closes:  # the body was not (fully) read: close rather than drain what is left
        response.force_close()
    return response


def _errors_as_json(handler: Handler) -> Handler:
    """`handler`, answering every error the router itself answers as OpenAI error JSON: its
    own causes, and aiohttp's (413, ...), which are plain text otherwise.

    A wrapper per route, not an aiohttp middleware: with any middleware aiohttp runs two
    more coroutines a request (the middleware and its own current-app one) and builds the
    chain through a cache lookup: `Application._handle` took 3.0 us a request with the
    middleware, 2.0 with this wrapper (microbenchmark, a handler that returns at once).
    No route, or a wrong method, reaches `_no_route`."""

    async def answered(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except RouterError as exc:
            return error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return openai_error(exc.status, exc.reason, type(exc).__name__)

    return answered


def add_route(app: web.Application, method: str, path: str, handler: Handler) -> None:
    """`handler` on `method` and `path`, its errors answered as OpenAI error JSON."""
    if method == "GET":
        app.router.add_get(path, _errors_as_json(handler))  # and HEAD, as aiohttp's add_get
    else:
        app.router.add_route(method, path, _errors_as_json(handler))


async def _no_route(request: web.Request) -> web.StreamResponse:
    """What aiohttp answers without a route, as OpenAI error JSON: 405 when another method
    has the path, else 404. Registered last, for every path and method."""
    allowed: set[str] = set()
    unrouted = request.match_info.route.resource  # this catch-all
    for resource in request.app.router.resources():
        if resource is not unrouted:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def answer_unrouted(app: web.Application) -> None:
    """Last on `app`: every path and method no route serves answers 404 or 405 in OpenAI error JSON."""
    add_route(app, "*", "/{path:.*}", _no_route)
