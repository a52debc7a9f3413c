"""A FAKE vLLM OpenAI server for router tests and benchmarks: no model, no KV, instant answers.

It speaks just enough of vLLM's P/D dialect to stand in for either role: a request with
`kv_transfer_params.do_remote_decode` gets a one-token answer carrying a pdconnect
`TransferPlan` (pointing at a real side-channel server, so release notices can be
observed), any other request streams or returns `chunks` tokens. Like vLLM, a whole
answer carries `prompt_logprobs` when asked (one entry of that many alternatives per
prompt word: a long prompt makes a long answer). Faults are switched
on per instance (`FakeFaults`): error statuses, slowness, connections dropped or stalled
mid-stream, a failing `/health`. It records what it saw, which requests were aborted
by their caller, and which releases arrived.

Never deploy this: it is a test double, named fake everywhere it is used.

    python -m pdconnect.testbed.fake_engine --chunks 16 [--port 0] [--side-channel]

prints one JSON line `{"url": ..., "side_channel": ...}` once it is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from pdconnect.protocol import PROTOCOL_VERSION, Ack, Message, Release
from pdconnect.sidechannel import SideChannelServer
from pdconnect.sse import COMPLETIONS_ERROR, RESPONSES_ERROR

__all__ = ["FakeCluster", "FakeEngine", "FakeFaults", "Seen"]

_encode = msgspec.json.encode
# vLLM 0.32/0.33's event for a streamed request that failed in the engine (`json.dumps` of its error).
VLLM_STREAM_ERROR = (
    COMPLETIONS_ERROR + b' {"message": "Internal server error", "type": "InternalServerError", "param": null, '
    b'"code": 500}}\n\n'
)

# A Responses stream's error event (OpenAI's `ResponseErrorEvent`), ending a request that failed in the engine.
RESPONSES_STREAM_ERROR = (
    RESPONSES_ERROR + b'data: {"type": "error", "code": "500", "message": "Internal server error", "param": null, '
    b'"sequence_number": 1}\n\n'
)


@dataclass
class FakeFaults:
    """What to get wrong. Tests flip these on a running fake."""

    status: int = 200  # answer every inference request with this status
    fail_next: int = 0  # answer the next N inference requests with 500
    delay: float = 0.0  # seconds before answering at all
    drop_before_answer: bool = False  # close the connection without any answer
    drop_after_chunks: int | None = None  # stream: close the connection after N chunks
    stall_after_chunks: int | None = None  # stream: go silent (connection open) after N chunks
    chunk_interval: float = 0.0  # stream: seconds between chunks (a long generation)
    half_event_after_chunks: int | None = None  # stream: write half an event after N chunks, hang up
    error_event_after_chunks: int | None = None  # stream: vLLM's error event and [DONE] after N chunks
    answer_only: int | None = None  # answer the first N inference requests, 500 after
    fail_on_field: str | None = None  # answer 500 to any request whose body has this key
    gzip: bool = False  # compress every answer, whatever the caller accepts
    answer_padding: int = 0  # bytes of filler in every whole inference answer
    event_padding: int = 0  # bytes of filler in every streamed event
    health_status: int = 200


@dataclass(frozen=True)
class Seen:
    path: str
    request_id: str
    body: dict[str, Any]
    traceparent: str | None = None
    tracestate: str | None = None


@dataclass
class FakeEngine:
    """One fake engine; `await start()` serves it on this loop."""

    name: str = "fake"
    chunks: int = 8
    side_channel: bool = False
    prefill_cached_tokens: int = 0
    model: str = "fake-model"
    # Like `vllm serve --api-key`: /v1/* needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    faults: FakeFaults = field(default_factory=FakeFaults)
    seen: list[Seen] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    # Every transfer plan this fake (as prefill) handed out, in order.
    plans: list[dict[str, Any]] = field(default_factory=list)
    # Request ids in the order this fake answered them as prefill / as decode.
    served: list[tuple[str, str]] = field(default_factory=list)
    # For prompts that start with a `rid-...` word (benchmarks): the plan id this fake
    # issued for it as prefill, or received with it as decode. A request went prefill
    # then decode iff the decode side received the plan the prefill side issued.
    ledger: dict[str, dict[str, str]] = field(default_factory=lambda: {"prefill": {}, "decode": {}})
    url: str = ""
    _runner: web.AppRunner | None = field(default=None, init=False, repr=False)
    _side: SideChannelServer | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    # --- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        # Bodies as large as a router may pass on (its --max-body-bytes can be raised).
        app = web.Application(client_max_size=64 << 20, middlewares=[self._auth, self._compress])
        app.router.add_post("/v1/completions", self._inference)
        app.router.add_post("/v1/chat/completions", self._inference)
        app.router.add_post("/v1/responses", self._inference)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/fake/ledger", self._ledger)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self.side_channel:
            self._side = SideChannelServer(host, 0, self._on_side_message, engine_id=self.name)
        # handler_cancellation: a caller hanging up cancels the handler, which is how
        # vLLM notices aborts too; the fake records it.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._side is not None:
            self._side.close()

    @property
    def side_channel_address(self) -> str | None:
        return self._side.address if self._side else None

    def _on_side_message(self, message: Message) -> Message:
        if isinstance(message, Release):
            with self._lock:
                self.releases.append(message)
        return Ack()

    def released_ids(self) -> list[str]:
        with self._lock:
            return [rid for release in self.releases for rid in release.request_ids]

    # --- handlers -------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            self.api_key is not None
            and request.path.startswith("/v1/")
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _compress(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if self.faults.gzip and not response.prepared:
            response.enable_compression(web.ContentCoding.gzip)
        return response

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.faults.health_status, text="")

    async def _ledger(self, request: web.Request) -> web.Response:
        return web.Response(body=_encode(self.ledger), content_type="application/json")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]}
        )

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != "application/json":  # vLLM refuses anything else
            return web.json_response(
                {"error": {"message": "Only 'application/json' is allowed", "code": 400}}, status=400
            )
        body = msgspec.json.decode(await request.read())
        request_id = request.headers.get("X-Request-Id", "")
        self.seen.append(
            Seen(
                request.path,
                request_id,
                body,
                request.headers.get("traceparent"),
                request.headers.get("tracestate"),
            )
        )
        try:
            return await self._answer(request, body, request_id)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.append(request_id)
            raise

    async def _answer(self, request: web.Request, body: dict[str, Any], request_id: str) -> web.StreamResponse:
        faults = self.faults
        if faults.delay:
            await asyncio.sleep(faults.delay)
        if faults.drop_before_answer:
            _hang_up(request)
            return web.Response()
        if faults.answer_only is not None:
            if faults.answer_only <= 0:
                return web.json_response({"error": {"message": "fake 500", "code": 500}}, status=500)
            faults.answer_only -= 1
        if faults.fail_on_field is not None and faults.fail_on_field in body:
            return web.json_response({"error": {"message": "fake 500 on a bad field", "code": 500}}, status=500)
        if faults.fail_next > 0 or faults.status != 200:
            status = 500 if faults.fail_next > 0 else faults.status
            faults.fail_next = max(0, faults.fail_next - 1)
            return web.json_response({"error": {"message": f"fake {status}", "code": status}}, status=status)
        if request.path.endswith("/responses"):
            return await self._responses(request, body, request_id)
        chat = request.path.endswith("/chat/completions")
        params = body.get("kv_transfer_params") or {}
        prompt_tokens = _count_prompt_tokens(body, chat)
        rid = _bench_id(body)
        if params.get("do_remote_decode"):
            self.served.append(("prefill", request_id))
            answer = self._prefill_answer(body, chat, request_id, prompt_tokens)
            if rid is not None:
                self.ledger["prefill"][rid] = self.plans[-1]["remote_request_id"]
            return answer
        self.served.append(("decode", request_id))
        if rid is not None and isinstance(params.get("remote_request_id"), str):
            self.ledger["decode"][rid] = params["remote_request_id"]
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.chunks
        n = max(1, min(int(limit), self.chunks))
        # A real decode engine counts KV received from prefill as cached prompt tokens.
        cached = prompt_tokens if params.get("do_remote_prefill") else 0
        usage = _usage(prompt_tokens, n, cached)
        if body.get("stream"):
            return await self._stream(request, body, chat, request_id, n, usage)
        text = "".join(_token(i) for i in range(n))
        return self._whole(body, _full(chat, request_id, self.model, text, usage), prompt_tokens)

    async def _responses(self, request: web.Request, body: dict[str, Any], request_id: str) -> web.StreamResponse:
        """The Responses API, as vLLM shapes it: usage as input/output tokens, a stream of
        named events ending with `response.completed` (no [DONE])."""
        params = body.get("kv_transfer_params") or {}
        items = body.get("input")
        texts = (
            [items]
            if isinstance(items, str)
            else [str(i.get("content", "")) for i in items or [] if isinstance(i, dict)]
        )
        prompt = sum(len(text.split()) for text in texts)
        if params.get("do_remote_decode"):
            self.served.append(("prefill", request_id))
            cached = min(self.prefill_cached_tokens, prompt)
            answer = _response(request_id, self.model, _token(0), _responses_usage(prompt, 1, cached))
            answer["kv_transfer_params"] = self._plan(request_id, prompt)
            return web.json_response(answer)
        self.served.append(("decode", request_id))
        n = max(1, min(int(body.get("max_output_tokens") or self.chunks), self.chunks))
        usage = _responses_usage(prompt, n, prompt if params.get("do_remote_prefill") else 0)
        whole = _response(request_id, self.model, "".join(_token(i) for i in range(n)), usage)
        if not body.get("stream"):
            return web.json_response(whole)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [("response.created", {"type": "response.created", "response": {**whole, "status": "in_progress"}})]
        events += [
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": _token(i)}) for i in range(n)
        ]
        events.append(("response.completed", {"type": "response.completed", "response": whole}))
        for i, (kind, event) in enumerate(events):
            if self.faults.drop_after_chunks is not None and i >= self.faults.drop_after_chunks:
                _hang_up(request)
                return resp
            if self.faults.error_event_after_chunks is not None and i >= self.faults.error_event_after_chunks:
                await resp.write(RESPONSES_STREAM_ERROR)  # the request failed in the engine: no completed event
                break
            await resp.write(f"event: {kind}\ndata: ".encode() + _encode({**event, "sequence_number": i}) + b"\n\n")
        await resp.write_eof()
        return resp

    def _whole(self, body: dict[str, Any], answer: dict[str, Any], prompt_tokens: int) -> web.Response:
        """A whole answer, with the prompt logprobs asked for and any filler."""
        if self.faults.answer_padding:
            answer["fake_padding"] = "x" * self.faults.answer_padding
        encoded = _encode(answer)
        alternatives = body.get("prompt_logprobs")
        if isinstance(alternatives, int) and not isinstance(alternatives, bool) and prompt_tokens > 1:
            # vLLM's shape: null for the first token, then {token id: logprob} per token.
            # One entry, encoded once, repeated: a big answer without a big Python object.
            entry = _encode(
                {str(i): {"logprob": -1.5, "rank": i + 1, "decoded_token": f" w{i}"} for i in range(alternatives + 1)}
            )
            logprobs = b"[null," + b",".join([entry] * (prompt_tokens - 1)) + b"]"
            encoded = b"".join((encoded[:-1], b',"prompt_logprobs":', logprobs, b"}"))
        return web.Response(body=encoded, content_type="application/json")

    def _prefill_answer(self, body: dict[str, Any], chat: bool, request_id: str, prompt_tokens: int) -> web.Response:
        answer = _full(
            chat,
            request_id,
            self.model,
            _token(0),
            _usage(prompt_tokens, 1, min(self.prefill_cached_tokens, prompt_tokens)),
        )
        answer["kv_transfer_params"] = self._plan(request_id, prompt_tokens)
        return self._whole(body, answer, prompt_tokens)

    def _plan(self, request_id: str, prompt_tokens: int) -> dict[str, Any]:
        """A transfer plan pointing at this fake's side channel, recorded in `plans`."""
        host, port = ("127.0.0.1", 1)
        if self._side is not None:
            host, _, port_text = self._side.address.removeprefix("tcp://").rpartition(":")
            port = int(port_text)
        plan = {
            "remote_engine_id": self.name,
            "remote_request_id": request_id or f"fake-plan-{len(self.plans)}",
            "remote_host": host,
            "remote_port": port,
            "compat_hash": "fake",
            "num_prompt_tokens": max(1, prompt_tokens),
            "lease_expires_at": time.time() + 60.0,
            "groups": [],
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "pdconnect": PROTOCOL_VERSION,
        }
        self.plans.append(plan)
        return plan

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, request_id: str, n: int, usage: dict[str, Any]
    ) -> web.StreamResponse:
        faults = self.faults
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if faults.gzip:
            resp.enable_compression(web.ContentCoding.gzip)
        await resp.prepare(request)
        options = body.get("stream_options") or {}
        events = [_chunk(chat, request_id, self.model, i, n) for i in range(n)]
        if options.get("include_usage"):
            events.append(_usage_chunk(chat, request_id, self.model, usage))
        if faults.event_padding:
            for event in events:
                event["fake_padding"] = "x" * faults.event_padding
        for i, event in enumerate(events):
            if faults.drop_after_chunks is not None and i >= faults.drop_after_chunks:
                _hang_up(request)
                return resp
            if faults.half_event_after_chunks is not None and i >= faults.half_event_after_chunks:
                encoded = b"data: " + _encode(event)
                await resp.write(encoded[: len(encoded) // 2])
                await asyncio.sleep(0.05)  # let the half event reach the caller on its own
                _hang_up(request)
                return resp
            if faults.error_event_after_chunks is not None and i >= faults.error_event_after_chunks:
                await resp.write(VLLM_STREAM_ERROR)  # a request that failed in the engine (finish reason "error")
                break
            if faults.stall_after_chunks is not None and i >= faults.stall_after_chunks:
                await asyncio.sleep(3600)
            if faults.chunk_interval and i:
                await asyncio.sleep(faults.chunk_interval)
            await resp.write(b"data: " + _encode(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclass
class FakeCluster:
    """Fake prefill engines (each with a real side channel) and fake decode engines."""

    prefill: list[FakeEngine]
    decode: list[FakeEngine]

    @classmethod
    async def start(cls, prefill: int = 1, decode: int = 1, chunks: int = 8) -> FakeCluster:
        cluster = cls(
            [FakeEngine(name=f"fake-p{i}", chunks=chunks, side_channel=True) for i in range(prefill)],
            [FakeEngine(name=f"fake-d{i}", chunks=chunks) for i in range(decode)],
        )
        for engine in cluster.prefill + cluster.decode:
            await engine.start()
        return cluster

    @property
    def prefill_urls(self) -> list[str]:
        return [e.url for e in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [e.url for e in self.decode]

    def engine(self, url: str) -> FakeEngine:
        return next(e for e in self.prefill + self.decode if e.url == url)

    async def close(self) -> None:
        for engine in self.prefill + self.decode:
            await engine.close()


def _hang_up(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def _bench_id(body: dict[str, Any]) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt.startswith("rid-"):
        return prompt.split(" ", 1)[0]
    return None


def _token(i: int) -> str:
    return f" t{i}"


def _count_prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        return sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or [] if isinstance(m, dict))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split())


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _full(chat: bool, request_id: str, model: str, text: str, usage: dict[str, Any]) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        kind = "text_completion"
    return {
        "id": f"fake-{request_id}",
        "object": kind,
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def _responses_usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _response(request_id: str, model: str, text: str, usage: dict[str, Any]) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {
        "id": f"resp_fake-{request_id}",
        "object": "response",
        "model": model,
        "status": "completed",
        "output": [message],
        "usage": usage,
    }


def _chunk(chat: bool, request_id: str, model: str, i: int, n: int) -> dict[str, Any]:
    finish = "length" if i == n - 1 else None
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": _token(i)}, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": _token(i), "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": f"fake-{request_id}", "object": kind, "created": 0, "model": model, "choices": [choice]}


def _usage_chunk(chat: bool, request_id: str, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": f"fake-{request_id}", "object": kind, "created": 0, "model": model, "choices": [], "usage": usage}


async def _serve(args: argparse.Namespace) -> None:
    engine = FakeEngine(name=args.name, chunks=args.chunks, side_channel=args.side_channel)
    engine.faults.answer_padding = args.answer_padding
    engine.faults.event_padding = args.event_padding
    await engine.start(args.host, args.port)
    print(json.dumps({"url": engine.url, "side_channel": engine.side_channel_address}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdconnect.testbed.fake_engine",
        description="FAKE vLLM OpenAI server (tests and benchmarks only)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--chunks", type=int, default=8, help="tokens streamed per decode answer")
    parser.add_argument("--side-channel", action="store_true", help="serve a real side channel for releases")
    parser.add_argument("--answer-padding", type=int, default=0, help="bytes of filler in every whole answer")
    parser.add_argument("--event-padding", type=int, default=0, help="bytes of filler in every streamed event")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args))
    else:
        uvloop.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
