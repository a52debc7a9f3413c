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

It also names a refused pairing: a decode request whose plan the engine refused (the
prefill engine's compat record differs, or an unequal-TP pairing cannot work) ends in
vLLM's fixed 500 "Internal server error". When the engine noted why for that plan's
prefill engine (`connectors.refusal_notes`), that 500's body is replaced by an
OpenAI-style error with the note: the fields and both sides' values. A streamed request
has its 200 and first events sent before the load fails; vLLM 0.32 and 0.33 then end a
completions or chat stream with one error event, `data: {"error": {"message": "Internal
server error", "type": "InternalServerError", "param": null, "code": 500}}`, and
`[DONE]`. That event is replaced by one carrying the note, in the same shape. Only body
messages holding the event's leading bytes (`pdconnect.sse`) are parsed (vLLM writes each
event in one message); the rest pass as they are. A `/v1/responses` stream gets no error
event from them: the error they build is not a Responses event, their own validation of
it raises, and the server cuts the stream with no terminal event. When a note exists,
that exception ends here instead: the stream is ended with a Responses `error` event
carrying the note (code `IncompatibleEnginesError`, the next sequence number: its events
are counted with a byte count per message, never parsed); a completions or chat stream
cut that way ends with the note's error event and `[DONE]`. Without a note the exception
goes on as before. A whole `/v1/responses` answer is a 500 like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from connectors.logs import log_like_vllm
from connectors.refusal_notes import RefusalNotes, notes_key
from connectors.transfer_params import TransferAsk, read_params
from pdconnect.sse import COMPLETIONS_ERROR, responses_error

__all__ = ["TransferParamsGuard", "refusal"]

Scope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_MARK = b"kv_transfer_params"
logger = logging.getLogger("pdconnect.connector")


def _ask(body: bytes) -> TransferAsk | None:
    """What the body's `kv_transfer_params` ask, or None when it has none (or is no JSON object)."""
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
    return read_params(params)


def refusal(body: bytes) -> str | None:
    """Why vLLM must not get this request body, or None to let it through."""
    ask = _ask(body)
    return None if ask is None else ask.invalid or None


def _error_json(status: int, message: str, kind: str) -> bytes:
    """An error in vLLM's (OpenAI's) format."""
    error = {"error": {"message": message, "type": kind, "param": "kv_transfer_params", "code": status}}
    return msgspec.json.encode(error)


def _error(status: int, message: str, kind: str) -> tuple[ASGIMessage, ASGIMessage]:
    """The response start and body of an error in vLLM's (OpenAI's) format."""
    payload = _error_json(status, message, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    return {"type": "http.response.start", "status": status, "headers": headers}, {
        "type": "http.response.body",
        "body": payload,
    }


def _server_notes(scope: Scope) -> RefusalNotes:
    """The refusal notes of the vLLM server whose app serves `scope` (off when it has no config)."""
    config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
    return RefusalNotes(None) if config is None else RefusalNotes.for_server(config)


_EVENT_END = b"\n\n"
_REFUSED = "IncompatibleEnginesError"  # the error's type (code, in a Responses stream)
_RESPONSES = "/v1/responses"


class _ErrorCode(msgspec.Struct):
    code: int | None = None


class _ErrorEvent(msgspec.Struct):
    error: _ErrorCode


_ERROR_EVENT_DECODER: msgspec.json.Decoder[_ErrorEvent] = msgspec.json.Decoder(_ErrorEvent)


def _is_server_error(event: bytes) -> bool:
    """Whether `event` (`data: {...}`, no blank line) is an error event with code 500."""
    try:
        return _ERROR_EVENT_DECODER.decode(event[len(b"data: ") :]).error.code == 500
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


def _is_event_stream(start: ASGIMessage) -> bool:
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in start.get("headers", ())
    )


class _StreamNamer:
    """Replaces a stream's error event of code 500 by one carrying the refusal note, when there is one.

    Fed each body message's bytes in order; holds back an error event whose blank line has
    not arrived yet (never anything else)."""

    def __init__(self, read_note: Callable[[], str | None]) -> None:
        self._read_note = read_note
        self._held = b""  # an error event's first bytes, awaiting its end

    def feed(self, body: bytes, last: bool) -> bytes:
        if self._held:
            body, self._held = self._held + body, b""
        elif COMPLETIONS_ERROR not in body:
            return body
        out: list[bytes] = []
        start = 0
        while (at := body.find(COMPLETIONS_ERROR, start)) >= 0:
            end = body.find(_EVENT_END, at)
            if end < 0:
                if not last:
                    out.append(body[start:at])
                    self._held = body[at:]
                    return b"".join(out)
                break  # the stream ends mid-event: passed on as vLLM wrote it
            out.append(body[start:at])
            out.append(self._named(body[at:end]))
            start = end
        out.append(body[start:])
        return b"".join(out)

    def _named(self, event: bytes) -> bytes:
        note = self._read_note() if _is_server_error(event) else None
        if note is None:
            return event
        return b"data: " + _error_json(500, note, _REFUSED)


class _RefusalNamer:
    """Wraps vLLM's `send` for a request that carries a plan: a 500's body, or a stream's
    error event of code 500, is replaced by the refusal note when there is one, and a
    stream vLLM cut with an exception is ended with an error event carrying it
    (`end_cut_stream`)."""

    def __init__(self, send: Send, read_note: Callable[[], str | None], responses: bool) -> None:
        self._send = send
        self._read_note = read_note
        self._responses = responses  # a `/v1/responses` request: its streams' dialect
        self._held: ASGIMessage | None = None  # a 500's start, until its body is known
        self._replaced = False  # the 500's body was replaced: the rest of vLLM's is dropped
        self._stream: _StreamNamer | None = None  # a completions or chat stream's namer
        self._streaming = False  # an event stream's 200 went out and its body has not ended
        self._events = 0  # whole events sent in a Responses stream: the next one's sequence number

    async def send(self, message: ASGIMessage) -> None:
        if self._replaced:
            return
        if message["type"] == "http.response.start":
            if message.get("status") == 500:
                self._held = message
                return
            if _is_event_stream(message):
                self._streaming = True
                if not self._responses:
                    self._stream = _StreamNamer(self._read_note)
        elif message["type"] == "http.response.body":
            more = bool(message.get("more_body", False))
            self._streaming = self._streaming and more
            if self._stream is not None:
                message = {**message, "body": self._stream.feed(message.get("body", b""), last=not more)}
            elif self._responses and self._streaming:
                self._events += message.get("body", b"").count(_EVENT_END)
            if self._held is not None:
                start, self._held = self._held, None
                note = self._read_note()
                if note is not None:
                    self._replaced = True
                    start, message = _error(500, note, _REFUSED)
                await self._send(start)
        await self._send(message)

    async def end_cut_stream(self) -> bool:
        """After vLLM's app raised: end a stream it had begun with the refusal note, if there
        is one. Whether it did (else the exception is vLLM's to report)."""
        if not self._streaming:
            return False
        note = self._read_note()
        if note is None:
            return False
        if self._responses:
            event = responses_error(note, _REFUSED, "kv_transfer_params", self._events)
        else:
            event = b"data: " + _error_json(500, note, _REFUSED) + _EVENT_END + b"data: [DONE]" + _EVENT_END
        self._streaming = False
        await self._send({"type": "http.response.body", "body": event, "more_body": False})
        return True


class TransferParamsGuard:
    """Refuses POST bodies whose `kv_transfer_params` the connector would refuse; passes the rest."""

    def __init__(self, app: ASGIApp) -> None:
        log_like_vllm()  # built by vLLM's API server, which has no connector to do it
        self.app = app
        self._notes: RefusalNotes | None = None  # the server's, found at the first plan

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
        ask = _ask(body)
        if ask is not None and ask.invalid:
            start, answer = _error(400, ask.invalid, "BadRequestError")
            await send(start)
            await send(answer)
            return
        if ask is not None and ask.plan is not None:
            plan = ask.plan
            if self._notes is None:
                self._notes = _server_notes(scope)
            notes = self._notes
            key = notes_key(plan.remote_engine_id, plan.side_channel, plan.compat_hash)
            namer = _RefusalNamer(send, lambda: notes.read(key), str(scope.get("path", "")).endswith(_RESPONSES))
            try:
                await self.app(scope, _replay([body], None, receive), namer.send)
            except Exception as exc:
                if not await namer.end_cut_stream():
                    raise
                logger.warning("a stream whose plan was refused raised, ended with the refusal: %.300r", exc)
            return
        await self.app(scope, _replay([body], None, receive), send)


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
