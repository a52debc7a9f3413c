"""The life of one request: its two legs (prefill, decode) and the relay; retries, fallback, abort.

Read top to bottom in `PDFlow.handle`:
1. parse the client's body and hash its leading chunk (the affinity key: `request`); for the
   kv-aware policy also compute the prompt's token ids as the engine will (chat rendered
   with the model's template, `chat_template`), or leave the request to the key, and a
   long prompt's chain keys, off the loop, for every lookup of the request (`tokenizing`);
2. prefill: what the prompt's KV depends on (`request.PREFILL_FIELDS`, nothing that only shapes
   the answer) with `max_tokens=1`, `stream=false` and
   `kv_transfer_params={"do_remote_decode": true}` to the key's prefill engine; of its
   answer, at most `max_prefill_answer_bytes`, only `kv_transfer_params` and `usage` are
   decoded; on error or timeout (`attempt`) the next engine, and when all failed, decode-only
   fallback (the decode engine prefills locally; the `x-pdconnect-fallback` header and a
   metric say so).
   With `--decode-first`, a request whose decode engine already holds all but a few of
   its prompt tokens skips this leg the same way (`decider`, `x-pdconnect-route`);
3. decode: the client's own body plus the prefill engine's `kv_transfer_params`,
   unchanged, to the key's decode engine; a failure before the first byte moves to the
   next decode engine with the same params (the prefill side holds the blocks under
   its lease until one of them pulls). A data-parallel rank is an engine of its own
   (`engines.py`): a request to it carries `X-data-parallel-rank`, on either leg;
4. relay the decode engine's answer, with usage made true for the whole request, every
   write to the client within `client_write_timeout` (`writer.ClientWriter`).
   A stream the engine itself ends with an error event (vLLM's for a request that failed
   after its 200, e.g. a refused plan, named by `connectors.api_guard`) is relayed as it
   is and counted `decode_dropped`, so its plan is released.

The client's route into `kv_transfer_params` is the router's alone: the top-level field
is replaced, `vllm_xargs.kv_transfer_params` (vLLM's other way in) is refused. Requests
that make an engine run several sequences per request (`n`, `best_of`, beam search, a
batch of prompts) are refused while prefill engines are registered: each child would
hold a plan of its own, and the router keeps and releases one.

If the client leaves, the open upstream connection is closed (vLLM aborts a request
whose connection closes) and the prefill engine is told to free the blocks now
(`releaser.PrefillReleaser`, off the event loop). Every request ends with exactly one outcome
from `metrics.OUTCOMES`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from pdconnect.router.apikeys import ApiKeys
from pdconnect.router.attempt import AttemptFailed, EngineCaller, blame, judge
from pdconnect.router.body import read_body
from pdconnect.router.chat_template import PromptTokenizer
from pdconnect.router.config import RouterConfig
from pdconnect.router.decider import DecodeFirstDecider, Route
from pdconnect.router.engines import Engine, EngineRegistry, Role
from pdconnect.router.errors import (
    DecodeFailed,
    DecodeTimeout,
    EngineAnswerTooLarge,
    EngineRejected,
    NoEngineAvailable,
    PrefillFailed,
    RouterError,
)
from pdconnect.router.logs import ACCESS_LOGGER, bind_request
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.policy import AffinityTracker, KvAware, PrefixAffinity, RoutingPolicy, affinity_key
from pdconnect.router.pools import Pool, Pools
from pdconnect.router.record import SERVED, Prefilled, RequestRecord
from pdconnect.router.releaser import PrefillReleaser
from pdconnect.router.request import Call, Endpoint, KeyOf, decode_body, parse_call, prefill_body
from pdconnect.router.responses import DIALECTS
from pdconnect.router.tokenizing import PromptReader
from pdconnect.router.tracing import NO_SPANS, Tracing
from pdconnect.router.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from pdconnect.router.usage import Buffer, EventTooLarge, SseRewriter, UsageMerger
from pdconnect.router.writer import ClientStalled, ClientWriter, HeadersWithBodyResponse

__all__ = ["PDFlow"]

logger = logging.getLogger("pdconnect.router.flow")
access_logger = logging.getLogger(ACCESS_LOGGER)

_json_encode = msgspec.json.encode


class _PrefillAnswer(msgspec.Struct):
    """What the router reads of a prefill answer; every other member is skipped unparsed."""

    kv_transfer_params: Any = None
    usage: Any = None


_PREFILL_ANSWER: msgspec.json.Decoder[_PrefillAnswer] = msgspec.json.Decoder(_PrefillAnswer)
_decode_prefill_answer = _PREFILL_ANSWER.decode


class PDFlow:
    """Serves `/v1/completions` and `/v1/chat/completions` through a prefill and a decode engine."""

    def __init__(
        self,
        config: RouterConfig,
        registry: EngineRegistry,
        upstream: UpstreamPool,
        metrics: RouterMetrics,
        releaser: PrefillReleaser,
        prefill_policy: RoutingPolicy,
        decode_policy: RoutingPolicy,
        decider: DecodeFirstDecider | None = None,
        tokenizer: PromptTokenizer | None = None,
        tracing: Tracing | None = None,
        pools: Pools | None = None,
        keys: ApiKeys | None = None,
    ) -> None:
        self._config = config
        policies = {Role.PREFILL: prefill_policy, Role.DECODE: decode_policy}
        # Without pools: one pool of every engine with these policies, the body's `model` unread.
        self._pools = pools or Pools([Pool("default", (), registry, None, policies)])
        self._keys = keys
        self._tracing = tracing
        self._decider = decider
        self._caller = EngineCaller(upstream, metrics)
        self._metrics = metrics
        self._releaser = releaser
        self._kv_aware = decode_policy if isinstance(decode_policy, KvAware) else None
        self._affinity = (
            {role: AffinityTracker() for role in Role} if isinstance(decode_policy, PrefixAffinity) else None
        )
        # Whole answers run under one overall deadline (asyncio.timeout in _send); streams
        # also under a limit on the silence between two chunks.
        self._stream_idle = config.stream_idle_timeout
        self._prefill_limit = config.max_prefill_answer_bytes
        # Only these policies (and the affinity tracker, which needs one of them) read the
        # key: the others are spared hashing every prompt.
        self._key_of: KeyOf | None = (
            functools.partial(
                affinity_key, prefix_chars=config.affinity_prefix_chars, prefix_tokens=config.affinity_prefix_tokens
            )
            if config.policy in ("prefix-affinity", "kv-aware")
            else None
        )
        self._reader = (
            PromptReader(tokenizer, self._kv_aware, metrics.registry) if config.policy == "kv-aware" else None
        )

    # --- the request, top to bottom -------------------------------------------------------

    async def handle(self, http: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = time.perf_counter()
        trace = RequestRecord(
            self._tracing.start(http.headers, f"{http.method} {http.path}") if self._tracing else NO_SPANS
        )
        try:
            client = self._keys.admit(http.headers) if self._keys is not None else None  # 401, 429 on requests
            raw = await read_body(http, self._config.max_body_bytes, self._config.body_read_timeout)
            call = parse_call(
                raw,
                endpoint,
                http.headers,
                started,
                pools=self._pools,
                key_of=self._key_of,
                tracing=self._tracing is not None,
                trace_id=trace.spans.trace_id,  # given here: `Call` is frozen, set later it would be copied
            )
            bind_request(call.request_id, call.trace_id)
            if self._reader is not None:
                call = msgspec.structs.replace(call, prompt=await self._reader.routing_prompt(call))
            if self._keys is not None and client is not None:
                self._keys.charge(client, call)  # 429 on tokens; the engines' own key
            if not any(engine.routable for engine in call.pool.engines(Role.DECODE)):
                raise NoEngineAvailable(Role.DECODE.value)  # before P computes for nobody
            trace.route = self._route(call, trace)
            if trace.route is not None:
                trace.spans.route("decode-first" if trace.route.local else "pd", trace.route.reason)
            if trace.route is None or not trace.route.local:
                trace.prefilled = await self._prefill(call, trace)
            params = trace.prefilled.params if trace.prefilled else None
            response = await self._decode(http, call, trace, params)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            trace.outcome = "client_stalled" if trace.stalled else "client_disconnect"
            trace.status = 499
            raise
        except RouterError as exc:
            trace.outcome = exc.outcome
            trace.status = exc.http_status
            raise
        finally:
            if trace.route is not None:
                trace.route.prefilled()
            if trace.outcome not in SERVED and trace.prefilled is not None:
                self._releaser.release(trace.prefilled.params, trace.outcome)
            elapsed = time.perf_counter() - started
            self._metrics.request_done(endpoint.label, trace.outcome, elapsed)
            if self._config.access_log:
                trace.access_entry(http.method, http.path, elapsed).log(access_logger)
            trace.spans.end(trace.status, trace.outcome)

    def _route(self, call: Call, trace: RequestRecord) -> Route | None:
        """Decode-first routing (`decider`): the local route skips the prefill leg, on the decode
        engine the decision was made for (pinned); None without a decider."""
        if self._decider is None:
            return None
        engines = self._candidates(Role.DECODE, call, self._config.decode_attempts)
        route = self._decider.decide(engines[0] if engines else None, call.prompt, call.body)
        if route.local:
            trace.decode_engines = engines
        return route

    # --- prefill leg ----------------------------------------------------------------------

    async def _prefill(self, call: Call, trace: RequestRecord, round_: int = 0) -> Prefilled | None:
        """P's answer, or None for decode-only (trace.fallback says why).

        `round_` > 0 is a fresh prefill for a decode retry: it goes out under its own
        request id, so the new plan never shares a name with the one whose claim ended.
        """
        engines = self._candidates(Role.PREFILL, call, self._config.prefill_attempts)
        if not engines:
            if not self._config.fallback:
                raise NoEngineAvailable(Role.PREFILL.value)
            self._fall_back(trace, "no_prefill_engine")
            return None
        body = _json_encode(prefill_body(call))
        headers = call.headers if round_ == 0 else {**call.headers, "X-Request-Id": f"{call.request_id}-r{round_}"}
        deadline = self._config.prefill_timeout
        suspects: list[Engine] = []
        for attempt, engine in enumerate(engines):
            verdict: bool | None = None
            engine.begin()
            leg = trace.spans.leg(Role.PREFILL.value, engine.name, attempt)
            sent = time.perf_counter()
            try:
                resp, data = await self._caller.send(
                    engine, call, body, deadline, whole=True, headers=leg.inject(headers), limit=self._prefill_limit
                )
                resp.release()
                answer = _decode_prefill_answer(data)
                verdict = True
            except AttemptFailed as failure:
                verdict = judge(engine, failure, suspects)
                if failure.reason == "too_large":
                    # Its plan, if any, is past the limit too: the lease is left to expire.
                    self._metrics.oversized_answers.labels(Role.PREFILL.value).inc()
                self._note_failure(Role.PREFILL, engine, failure, retry=attempt + 1 < len(engines))
                continue
            except EngineRejected:
                verdict = True
                raise
            except msgspec.DecodeError:
                verdict = False
                self._note_failure(
                    Role.PREFILL, engine, AttemptFailed("bad_answer", "not JSON"), retry=attempt + 1 < len(engines)
                )
                continue
            finally:
                engine.end(verdict)
                leg.end(verdict)
            blame(suspects)
            self._metrics.prefill_seconds.observe(time.perf_counter() - sent)
            self._observe_affinity(Role.PREFILL, call, engine)
            params = answer.kv_transfer_params
            if not isinstance(params, dict):
                # An engine without a KV connector: nothing to pull, decode computes locally.
                self._fall_back(trace, "no_transfer_params")
                return None
            return Prefilled(engine=engine, params=params, usage=answer.usage)
        if not self._config.fallback:
            raise PrefillFailed(f"all {len(engines)} prefill attempts failed")
        self._fall_back(trace, "prefill_failed")
        return None

    def _fall_back(self, trace: RequestRecord, reason: str) -> None:
        trace.fallback = reason
        trace.spans.route("fallback", reason)
        self._metrics.fallbacks.labels(reason).inc()
        logger.debug("decode-only fallback: %s", reason)

    # --- decode leg -----------------------------------------------------------------------

    async def _decode(
        self, http: web.Request, call: Call, trace: RequestRecord, params: dict[str, Any] | None
    ) -> web.StreamResponse:
        engines = trace.decode_engines or self._candidates(Role.DECODE, call, self._config.decode_attempts)
        if not engines:
            raise NoEngineAvailable(Role.DECODE.value)
        body = decode_body(call, params)
        deadline = self._config.decode_first_byte_timeout if call.stream else self._config.decode_timeout
        last: AttemptFailed | None = None
        suspects: list[Engine] = []
        for attempt, engine in enumerate(engines):
            local = trace.route is not None and trace.route.local
            if attempt > 0 and (trace.prefilled is not None or local):
                # The failed engine may have claimed (or half-pulled) the plan: it must not
                # travel on. Free it, and prefill again for the next engine (which does not
                # hold a locally routed request's prompt either).
                body = decode_body(call, await self._prefill_again(call, trace, attempt))
            merged = DIALECTS[call.endpoint.label].merger
            merger = merged.from_prefill(trace.prefilled.usage) if trace.prefilled else self._hit_check(trace)
            verdict: bool | None = None
            engine.begin()
            leg = trace.spans.leg(Role.DECODE.value, engine.name, attempt)
            sent = time.perf_counter()
            try:
                try:
                    resp, first = await self._caller.send(
                        engine,
                        call,
                        body,
                        deadline,
                        whole=not call.stream,
                        headers=leg.inject(call.headers),
                        limit=self._config.max_answer_bytes,
                    )
                except AttemptFailed as failure:
                    verdict = judge(engine, failure, suspects)
                    if failure.reason == "timeout" and not call.stream:
                        raise DecodeTimeout(f"decode took longer than {deadline}s") from None
                    if failure.reason == "too_large":
                        # Another engine would answer the same: no retry.
                        self._metrics.oversized_answers.labels(Role.DECODE.value).inc()
                        raise EngineAnswerTooLarge(
                            f"the decode answer is over the router's {self._config.max_answer_bytes}-byte limit"
                        ) from None
                    last = failure
                    self._note_failure(Role.DECODE, engine, failure, retry=attempt + 1 < len(engines))
                    continue
                except EngineRejected:
                    verdict = True
                    raise
                finally:
                    if trace.route is not None:
                        trace.route.prefilled()  # a local prefill is over at the first byte
                blame(suspects)
                self._observe_affinity(Role.DECODE, call, engine)
                headers = self._response_headers(call, trace, engine, resp)
                if call.stream:
                    out, verdict = await self._relay(http, call, trace, engine, resp, first, merger, headers)
                else:
                    resp.release()
                    verdict = True
                    parts = merger.rewrite_parts(first) if merger else [first]
                    out = await self._answer(http, trace, resp.status, headers, parts)
                self._metrics.decode_seconds.observe(time.perf_counter() - sent)
                return out
            finally:
                engine.end(verdict)
                leg.end(verdict)
        raise DecodeFailed(f"all {len(engines)} decode attempts failed; last: {last}")

    async def _prefill_again(self, call: Call, trace: RequestRecord, round_: int) -> dict[str, Any] | None:
        """Release the current plan and get a fresh one (None: decode-only from here)."""
        if trace.route is not None and trace.route.local:
            trace.route.local, trace.route.reason = False, "decode_retry"
        if trace.prefilled is not None:
            self._releaser.release(trace.prefilled.params, "decode_retry")
        self._metrics.retries.labels(Role.PREFILL.value, "decode_retry").inc()
        trace.prefilled = None
        trace.prefilled = await self._prefill(call, trace, round_)
        return trace.prefilled.params if trace.prefilled else None

    def _writer(self, http: web.Request, out: web.StreamResponse, trace: RequestRecord) -> ClientWriter:
        def stalled() -> None:
            trace.stalled = True
            self._metrics.client_write_timeouts.inc()

        return ClientWriter(http, out, self._config.client_write_timeout, stalled)

    async def _answer(
        self, http: web.Request, trace: RequestRecord, status: int, headers: dict[str, str], parts: list[Buffer]
    ) -> web.StreamResponse:
        """A whole (non-streaming) answer, in pieces, written by the flow itself: aiohttp
        would write a returned Response with no deadline."""
        out = HeadersWithBodyResponse(status=status, headers=headers)
        out.content_length = sum(len(part) for part in parts)
        await out.prepare(http)
        writer = self._writer(http, out, trace)
        try:
            for part in parts[:-1]:
                await writer.write(part)
            await writer.write_eof(parts[-1])
        except ClientStalled:
            trace.outcome = "client_stalled"
            return out
        trace.outcome = "ok_fallback" if trace.fallback else "ok"
        return out

    async def _relay(
        self,
        http: web.Request,
        call: Call,
        trace: RequestRecord,
        engine: Engine,
        resp: UpstreamResponse,
        first: bytes,
        merger: UsageMerger | None,
        headers: dict[str, str],
    ) -> tuple[web.StreamResponse, bool | None]:
        """Stream the decode answer to the client. Returns the response and the engine's verdict."""
        out = HeadersWithBodyResponse(status=resp.status, headers=headers)
        # Always framed: whatever the engine leaves half-written is held back, never sent.
        dialect = DIALECTS[call.endpoint.label]  # how this endpoint's streams end
        rewriter = SseRewriter(merger, self._config.max_event_bytes, dialect.ends, dialect.failed)
        idle = self._stream_idle
        writer = self._writer(http, out, trace)
        try:
            await out.prepare(http)
            chunk, broke, timed = first, None, True
            while True:
                try:
                    data = rewriter.feed(chunk)
                except EventTooLarge as exc:
                    self._metrics.oversized_answers.labels("event").inc()
                    data, broke = b"", str(exc)
                    break
                if resp.exhausted:
                    break  # the engine's whole answer is here: `data` goes out with the end
                await writer.write(data)
                if timed:
                    trace.ttft = time.perf_counter() - call.started
                    self._metrics.first_token(call.endpoint.label, trace.ttft)
                    timed = False
                try:
                    chunk = await resp.chunk(idle)
                except (UpstreamError, TimeoutError) as exc:
                    data, broke = b"", type(exc).__name__
                    break
                if not chunk:
                    data = b""
                    break
            if broke is None and rewriter.complete:
                resp.release()
                trace.outcome = "ok_fallback" if trace.fallback else "ok"
                if rewriter.failed:  # the engine failed the request after its 200: relayed, not served
                    trace.outcome = "decode_dropped"
                    logger.warning("decode stream from %s ended with the engine's error event", engine.name)
                # The last bytes and the chunked terminator in one write (with the headers
                # too when the answer came in one read): each write wakes the client.
                await writer.write_eof(data)
                if timed:
                    trace.ttft = time.perf_counter() - call.started
                    self._metrics.first_token(call.endpoint.label, trace.ttft)
                return out, True
            # The client may already have bytes, so no retry: drop any half event and end
            # the stream with a whole error event and [DONE], the way vLLM reports errors.
            resp.close()
            partial = rewriter.drop_partial()
            trace.outcome = "decode_dropped"
            reason = broke or ("ended mid-event" if partial else "ended without [DONE]")
            logger.warning("decode stream from %s broke: %s", engine.name, reason)
            await writer.write_eof(data + dialect.stream_error(f"decode engine stream broke: {reason}"))
            return out, False
        except ConnectionResetError as exc:
            # The client left (or stopped reading) mid-stream: closing our side aborts the
            # decode request.
            resp.close()
            trace.outcome = "client_stalled" if isinstance(exc, ClientStalled) else "client_disconnect"
            return out, None
        except BaseException:
            resp.close()
            raise

    # --- helpers ----------------------------------------------------------------------------

    def _candidates(self, role: Role, call: Call, attempts: int) -> list[Engine]:
        pool = call.pool
        ordered = pool.policies[role].order(pool.engines(role), call.key, call.prompt)
        return _other_servers_first(ordered)[:attempts]

    def _hit_check(self, trace: RequestRecord) -> UsageMerger | None:
        """A locally routed answer's usage is the engine's own: read it to check the prediction."""
        if self._decider is None or trace.route is None or not trace.route.local:
            return None
        return self._decider.usage_check(trace.route)

    def _note_failure(self, role: Role, engine: Engine, failure: AttemptFailed, retry: bool) -> None:
        logger.warning("%s attempt at %s failed: %s", role.value, engine.name, failure)
        if retry:
            self._metrics.retries.labels(role.value, failure.reason).inc()

    def _observe_affinity(self, role: Role, call: Call, engine: Engine) -> None:
        if self._affinity is not None and call.key is not None:
            self._metrics.placement(role.value, self._affinity[role].observe(call.key, engine.name))

    def _response_headers(
        self, call: Call, trace: RequestRecord, engine: Engine, resp: UpstreamResponse
    ) -> dict[str, str]:
        # A plain dict: aiohttp's responses copy whatever they are given into a CIMultiDict.
        trace.decode, trace.status = engine.name, resp.status
        headers: dict[str, str] = {}
        headers["Content-Type"] = resp.headers.get(b"content-type", b"application/json").decode()
        headers["X-Request-Id"] = call.request_id
        if trace.fallback:
            headers["X-PDConnect-Fallback"] = trace.fallback
        if trace.route is not None:
            headers["X-PDConnect-Route"] = trace.route.header(self._config.route_headers)
        if self._config.route_headers:
            headers["X-PDConnect-Decode"] = engine.name
            headers["X-PDConnect-Prefill"] = trace.prefilled.engine.name if trace.prefilled else "none"
        return headers


def _other_servers_first(engines: list[Engine]) -> list[Engine]:
    """The policy's order, except that the other ranks of the first choice's data-parallel
    server go last: what fails an attempt (a refused connection, a timeout, a 5xx) is most
    often the API server every rank shares, so a retry tries another server first."""
    if not engines or engines[0].dp_rank is None:
        return engines
    url = engines[0].url
    return [engines[0], *(e for e in engines[1:] if e.url != url), *(e for e in engines[1:] if e.url == url)]
