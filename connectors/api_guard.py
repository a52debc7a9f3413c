"""ASGI middleware for vLLM's API server: answer HTTP 400 to `kv_transfer_params` of the wrong JSON types.

Installed with vLLM's own flag, `--middleware connectors.api_guard.TransferParamsGuard`,
on prefill and decode engines alike. Without it, vLLM 0.32 and 0.33 pass such params on
unchecked: a non-empty string, number or list in `vllm_xargs.kv_transfer_params` makes
vLLM's own output processor fail with HTTP 500 and an empty message, before the
connector ever sees the request; the rest reach the connector, which serves the request
as if it had no params (`connectors.transfer_params`). With it, the client gets a 400
naming the field, in vLLM's error format, and the engine never sees the request.

It decodes the params exactly as the connector does (`read_params`), and reads them where
vLLM does: the body's `kv_transfer_params` when it is truthy, else
`vllm_xargs.kv_transfer_params`. Bodies that do not mention `kv_transfer_params` pass
untouched without being parsed; a body that is not a JSON object passes too, for vLLM to
refuse in its own words.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from connectors.transfer_params import read_params

__all__ = ["TransferParamsGuard", "refusal"]

Scope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_MARK = b"kv_transfer_params"


def refusal(body: bytes) -> str | None:
    """Why vLLM must not get this request body, or None to let it through."""
    if _MARK not in body:
        return None
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(request, dict):
        return None
    params = request.get("kv_transfer_params")
    extra = request.get("vllm_xargs")
    if not params and isinstance(extra, dict):
        params = extra.get("kv_transfer_params")
    return read_params(params).invalid or None


class TransferParamsGuard:
    """Refuses POST bodies whose `kv_transfer_params` the connector would refuse; passes the rest."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body arrived
                await self.app(scope, _replay([], message, receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        reason = refusal(body)
        if reason is None:
            await self.app(scope, _replay([body], None, receive), send)
            return
        error = {"error": {"message": reason, "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}}
        payload = msgspec.json.encode(error)
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _replay(bodies: list[bytes], pending: ASGIMessage | None, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then the client's later messages."""
    queued: list[ASGIMessage] = [{"type": "http.request", "body": b, "more_body": False} for b in bodies]
    if pending is not None:
        queued.append(pending)

    async def replayed() -> ASGIMessage:
        if queued:
            return queued.pop(0)
        return await receive()

    return replayed
