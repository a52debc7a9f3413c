"""The life of one request: parse, prefill leg, decode leg, relay; retries, fallback, abort.

Read top to bottom in `PDFlow.handle`:
1. parse the client's body and hash its leading chunk (the affinity key); for the
   kv-aware policy also compute the prompt's token ids as the engine will (chat rendered
   with the model's template, `chat_template`), or leave the request to the key, and a
   long prompt's chain keys, off the loop, for every lookup of the request (`_keys`);
2. prefill: what the prompt's KV depends on (`PREFILL_FIELDS`, nothing that only shapes
   the answer) with `max_tokens=1`, `stream=false` and
   `kv_transfer_params={"do_remote_decode": true}` to the key's prefill engine; of its
   answer, at most `max_prefill_answer_bytes`, only `kv_transfer_params` and `usage` are
   decoded; on error or timeout the next engine, and when all failed, decode-only
   fallback (the decode engine prefills locally; the `x-pdconnect-fallback` header and a
   metric say so).
   With `--decode-local`, a request whose decode engine already holds all but a few of
   its prompt tokens skips this leg the same way (`decider`, `x-pdconnect-route`);
3. decode: the client's own body plus the prefill engine's `kv_transfer_params`,
   unchanged, to the key's decode engine; a failure before the first byte moves to the
   next decode engine with the same params (the prefill side holds the blocks under
   its lease until one of them pulls);
4. relay the decode engine's answer, with usage made true for the whole request, every
   write to the client within `client_write_timeout` (`writer.ClientWriter`).

The client's route into `kv_transfer_params` is the router's alone: the top-level field
is replaced, `vllm_xargs.kv_transfer_params` (vLLM's other way in) is refused. Requests
that make an engine run several sequences per request (`n`, `best_of`, beam search, a
batch of prompts) are refused while prefill engines are registered: each child would
hold a plan of its own, and the router keeps and releases one.

If the client leaves, the open upstream connection is closed (vLLM aborts a request
whose connection closes) and the prefill engine is told to free the blocks now
(`PrefillReleaser`, off the event loop). Every request ends with exactly one outcome
from `metrics.OUTCOMES`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
from aiohttp import web
from prometheus_client import Counter

from pdconnect.keyring import Keyring
from pdconnect.notifier import PeerNotifier
from pdconnect.protocol import Message, ProtocolError, Release, decode_plan
from pdconnect.router.body import read_body
from pdconnect.router.chat_template import NotRendered, PromptTokenizer
from pdconnect.router.config import RouterConfig
from pdconnect.router.decider import DecodeLocalDecider, Route
from pdconnect.router.engines import Engine, EngineRegistry, Role
from pdconnect.router.errors import (
    BadRequest,
    DecodeFailed,
    DecodeTimeout,
    EngineAnswerTooLarge,
    EngineRejected,
    NoEngineAvailable,
    PrefillFailed,
    RouterError,
    openai_error_body,
)
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.policy import AffinityTracker, KvAware, PrefixAffinity, RoutingPolicy, affinity_key
from pdconnect.router.upstream import (
    AnswerTooLarge,
    ConnectFailed,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from pdconnect.router.usage import Buffer, EventTooLarge, SseRewriter, UsageMerger
from pdconnect.router.writer import ClientStalled, ClientWriter
from pdconnect.sidechannel import is_loopback_host

__all__ = ["PREFILL_FIELDS", "Call", "Endpoint", "PDFlow", "PrefillReleaser", "decode_body", "prefill_body"]

logger = logging.getLogger("pdconnect.router.flow")

_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    def __init__(self, path: str) -> None:
        # Plain attributes, read several times per request: `.value` and properties go
        # through enum's Python-level descriptors on CPython 3.11.
        self.path = path
        self.label = "chat" if path == "/v1/chat/completions" else "completions"


class _Prompt(msgspec.Struct):
    """The fields of a completions request the router reads or rewrites, typed: decoding is
    validation, so a wrong type is a 400 naming the field before any engine sees it (an
    engine answering a malformed body with 5xx would otherwise count against it)."""

    prompt: str | list[str | int | list[int]]
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    n: int | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None


class _Chat(msgspec.Struct):
    """The same for chat: `messages` must be a non-empty list of objects (checked in
    `_parse`: converting to `list[dict]` would copy every message, several times the
    cost of checking them)."""

    messages: list[Any]
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    n: int | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None


class _PrefillAnswer(msgspec.Struct):
    """What the router reads of a prefill answer; every other member is skipped unparsed."""

    kv_transfer_params: Any = None
    usage: Any = None


_PREFILL_ANSWER: msgspec.json.Decoder[_PrefillAnswer] = msgspec.json.Decoder(_PrefillAnswer)
_decode_prefill_answer = _PREFILL_ANSWER.decode


@dataclass(frozen=True)
class Call:
    """One client request, parsed once."""

    endpoint: Endpoint
    body: dict[str, Any]
    request_id: str
    stream: bool
    key: int | None
    headers: dict[str, str]  # forwarded to every engine (request id, authorization)
    started: float
    raw: bytes = b"{}"  # the client's body as received (inflated)
    tokens: Sequence[int] | None = None  # the prompt's token ids, when the policy needs them
    # Their chain keys by block size, shared by every lookup of the request (filled as far as
    # the lookups reach, or all at once off the loop for a long prompt: `PDFlow._keys`).
    keys: dict[int, list[int]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Prefilled:
    engine: Engine
    params: dict[str, Any] | None
    usage: Any


# What the prefill engine needs to compute the same KV as the decode engine would (vLLM
# 0.32/0.33): the fields that decide the prompt's token ids (the prompt, FIM suffix,
# chat rendering: template, its kwargs, tools, response format, media processing;
# special tokens, truncation), the LoRA adapter (`model`), the cache salt, and how it is
# scheduled. Everything else shapes only the answer (logprobs, prompt_logprobs, echo,
# n, stop, sampling, structured output, extensions' `vllm_xargs`) and stays with
# decode: prefill's one token is discarded.
_COMMON_PREFILL_FIELDS = (
    "model",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "cache_salt",
    "priority",
    "session_id",
)
PREFILL_FIELDS: dict[Endpoint, frozenset[str]] = {
    Endpoint.COMPLETIONS: frozenset((*_COMMON_PREFILL_FIELDS, "prompt", "prompt_embeds", "suffix")),
    Endpoint.CHAT: frozenset(
        (
            *_COMMON_PREFILL_FIELDS,
            "messages",
            "tools",
            "tool_choice",
            "response_format",
            "chat_template",
            "chat_template_kwargs",
            "add_generation_prompt",
            "continue_final_message",
            "documents",
            "reasoning_effort",
            "media_io_kwargs",
            "mm_processor_kwargs",
        )
    ),
}


def prefill_body(call: Call) -> dict[str, Any]:
    """The prefill leg's body: compute the prompt, produce one token, hold the KV for decode."""
    fields = PREFILL_FIELDS[call.endpoint]
    body = {name: value for name, value in call.body.items() if name in fields}
    body["max_tokens"] = 1
    if call.endpoint is Endpoint.CHAT:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = {"do_remote_decode": True}
    return body


def decode_body(call: Call, params: dict[str, Any] | None) -> bytes:
    """The decode leg's body: the client's request plus P's params (none = local prefill).

    The common case splices the params into the client's bytes, so a long prompt is not
    re-encoded; a client body that carries `kv_transfer_params` itself is rebuilt instead
    (never two keys of one name: JSON parsers disagree on which one wins).
    """
    if "kv_transfer_params" not in call.body:
        if params is None:
            return call.raw
        # The body decoded as an object: its last "}" closes it (only whitespace may follow).
        end = call.raw.rfind(b"}")
        comma = b"," if call.body else b""
        # One copy of a possibly long prompt (slicing bytes, then concatenating, made three).
        return b"".join((memoryview(call.raw)[:end], comma, b'"kv_transfer_params":', _json_encode(params), b"}"))
    body = dict(call.body)
    if params is None:
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = params
    return _json_encode(body)


def _refuse_unroutable(fields: _Chat | _Prompt, pd: bool) -> None:
    """BadRequest for what the router cannot carry: a client's own way into
    `kv_transfer_params`, and, with prefill engines (`pd`), a request that makes the
    engine run several sequences, each of which would hold a prefill plan of its own."""
    xargs = fields.vllm_xargs
    if xargs is not None and "kv_transfer_params" in xargs:
        raise BadRequest(
            "invalid request: `vllm_xargs.kv_transfer_params` is not accepted: the router sets kv_transfer_params"
        )
    if not pd:
        return
    several = None
    if fields.n is not None and fields.n != 1:
        several = f"`n` = {fields.n}"
    elif fields.best_of is not None and fields.best_of > 1:
        several = f"`best_of` = {fields.best_of}"
    elif fields.use_beam_search:
        several = "`use_beam_search`"
    elif isinstance(fields, _Prompt) and _is_batch(fields.prompt):
        several = "a batch of prompts"
    if several is not None:
        raise BadRequest(
            f"invalid request: {several} is not supported through the prefill/decode router "
            "(one prefill plan per request); send one request per sequence"
        )


def _is_batch(prompt: str | list[Any]) -> bool:
    """Several prompts (strings or token lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


class _AttemptFailed(Exception):
    """One attempt at one engine failed in a way another engine may not; `reason` labels it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Trace:
    """What happened to one request, for its metrics and response headers."""

    __slots__ = ("decode_engines", "fallback", "outcome", "prefilled", "route", "stalled")

    def __init__(self) -> None:
        self.outcome = "bad_request"
        self.fallback: str | None = None
        self.prefilled: Prefilled | None = None
        self.stalled = False  # the client stopped reading and was dropped
        self.route: Route | None = None  # the decode-local decider's, when there is one
        self.decode_engines: list[Engine] | None = None  # pinned by a decode-local route


# The prompts of larger bodies are rendered and tokenized on a worker thread (whose batch
# encoder releases the GIL; jinja yields it every switch interval): inline, a long prompt
# would stall every other request on the loop (a 1 MB prompt took ~0.4 s to tokenize on
# these machines, a 4 MiB chat of tiny messages ~0.4 s to render); a short one costs
# less inline than the thread hop.
_INLINE_PROMPT_BYTES = 8192
# The same for the prompt's chain keys (pure Python, ~50 us per 1k tokens and block size):
# a longer prompt's are computed off the loop, all at once, before any lookup needs them.
_INLINE_KEY_TOKENS = 2048

_OUTCOME_OF_ERROR: dict[type[RouterError], str] = {
    BadRequest: "bad_request",
    NoEngineAvailable: "no_engine",
    PrefillFailed: "prefill_failed",
    DecodeFailed: "decode_failed",
    DecodeTimeout: "decode_timeout",
    EngineAnswerTooLarge: "decode_failed",
    EngineRejected: "rejected",
}
_SERVED = frozenset({"ok", "ok_fallback"})
# An engine's error body is relayed to the client; one over this is replaced by the router's own.
_ERROR_BODY_LIMIT = 1 << 20


class PrefillReleaser:
    """Tells a prefill engine to free a request's blocks now, without delaying anyone.

    Releases go through a `PeerNotifier` signing as "router": one worker and one kept
    connection per prefill address, so a release never waits for a connection of its
    own, and a stalled prefill engine delays only its own releases. Releases due for one
    address go out together; one the engine did not answer is sent again until the
    plan's lease would have run out anyway (`lease_expires_at`, at most
    `MAX_RELEASE_SECONDS`), and at most `MAX_PENDING` wait per address. Every outcome is
    counted in `pdconnect_router_prefill_releases` (ok, error, retried, expired, dropped,
    insecure), never raised. Params that are not a pdconnect plan (e.g. vLLM's
    NixlConnector) have no release channel and are left to their lease. Without keys,
    releases go to prefill engines on this machine only: nothing unsigned leaves it.
    """

    MAX_RELEASE_SECONDS: ClassVar[float] = 600.0
    MAX_PENDING: ClassVar[int] = 4096
    # Notifier counter -> the `result` label it is counted under.
    _RESULTS: ClassVar[dict[str, str]] = {
        "notification_failures": "error",
        "release_retries": "retried",
        "releases_expired": "expired",
        "releases_dropped": "dropped",
    }

    def __init__(self, keys: Keyring | None, timeout: float, metrics: RouterMetrics) -> None:
        self._keys = keys
        self._timeout = timeout
        self._metrics = metrics
        self._notifier = PeerNotifier(
            sender="router",
            keys=keys,
            timeout_seconds=timeout,
            heartbeat_seconds=3600.0,  # the router watches nothing: no heartbeats
            count=self._count,
            on_reply=self._answered,
            max_pending_releases=self.MAX_PENDING,
        )

    def release(self, params: dict[str, Any] | None, reason: str) -> None:
        if not params:
            return
        try:
            plan = decode_plan(params)
        except ProtocolError:
            return
        if self._keys is None and not is_loopback_host(plan.remote_host):
            self._metrics.releases.labels("insecure").inc()
            logger.warning("no side-channel keys: release to %s not sent (its lease will run out)", plan.side_channel)
            return
        lifetime = min(max(plan.lease_expires_at - time.time(), 0.0), self.MAX_RELEASE_SECONDS)
        # At least one try, even if the plan's clock says the lease is over already.
        until = time.monotonic() + max(lifetime, self._timeout)
        self._notifier.release(plan.side_channel, plan.remote_engine_id, [plan.remote_request_id], reason, until)

    def _answered(self, address: str, sent: Message, reply: Message) -> None:
        if isinstance(sent, Release):
            self._metrics.releases.labels("ok").inc(len(sent.request_ids))

    def _count(self, name: str, amount: int) -> None:
        self._metrics.releases.labels(self._RESULTS.get(name, name)).inc(amount)

    def close(self, wait: bool = True) -> None:
        """Stop; with `wait`, first give releases still pending one release timeout to go out."""
        if wait:
            deadline = time.monotonic() + self._timeout
            while self._notifier.pending_releases() and time.monotonic() < deadline:
                time.sleep(0.05)
        self._notifier.close()


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
        decider: DecodeLocalDecider | None = None,
    ) -> None:
        self._config = config
        self._decider = decider
        self._registry = registry
        self._upstream = upstream
        self._metrics = metrics
        self._releaser = releaser
        self._policies = {Role.PREFILL: prefill_policy, Role.DECODE: decode_policy}
        self._kv_aware = decode_policy if isinstance(decode_policy, KvAware) else None
        self._affinity = (
            {role: AffinityTracker() for role in Role} if isinstance(decode_policy, PrefixAffinity) else None
        )
        # Whole answers run under one overall deadline (asyncio.timeout in _send); streams
        # also under a limit on the silence between two chunks.
        self._stream_idle = config.stream_idle_timeout
        self._prefill_limit = config.max_prefill_answer_bytes
        self._wants_tokens = config.policy == "kv-aware"
        # Only these policies (and the affinity tracker, which needs one of them) read the
        # key: the others are spared hashing every prompt.
        self._wants_key = config.policy in ("prefix-affinity", "kv-aware")
        self._tokenizer: PromptTokenizer | None = None
        if self._wants_tokens and config.tokenizer:
            self._tokenizer = PromptTokenizer.load(config.tokenizer)
            if self._tokenizer.template is None:
                logger.warning(
                    "kv-aware: no usable chat template in %s; chat requests are placed by prefix affinity",
                    config.tokenizer,
                )
        # Not in RouterMetrics: only a kv-aware flow has prompts to turn into token ids.
        self._prompt_results = (
            Counter(
                "pdconnect_router_kv_aware_prompts",
                "kv-aware: requests whose prompt token ids the router computed (result=ok), or could not "
                "(result=the reason: no_tokenizer, no_chat_template, unsupported_request, unsupported_message, "
                "template_error, tokenizer_error), placed by prefix affinity instead",
                ["endpoint", "result"],
                registry=metrics.registry,
            )
            if self._wants_tokens
            else None
        )
        self._tokenize_pool: ThreadPoolExecutor | None = None  # made on the first long prompt

    # --- the request, top to bottom -------------------------------------------------------

    async def handle(self, http: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = time.perf_counter()
        trace = _Trace()
        try:
            raw = await read_body(http, self._config.max_body_bytes, self._config.body_read_timeout)
            call = self._parse(raw, endpoint, http.headers, started)
            if self._wants_tokens:
                tokens = await self._tokens(call)
                call = dataclasses.replace(call, tokens=tokens, keys=await self._keys(tokens))
            if not any(engine.routable for engine in self._registry.engines(Role.DECODE)):
                raise NoEngineAvailable(Role.DECODE.value)  # before P computes for nobody
            trace.route = self._route(call, trace)
            if trace.route is None or not trace.route.local:
                trace.prefilled = await self._prefill(call, trace)
            params = trace.prefilled.params if trace.prefilled else None
            response = await self._decode(http, call, trace, params)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            trace.outcome = "client_stalled" if trace.stalled else "client_disconnect"
            raise
        except RouterError as exc:
            trace.outcome = _OUTCOME_OF_ERROR.get(type(exc), "bad_request")
            raise
        finally:
            if trace.route is not None:
                trace.route.prefilled()
            if trace.outcome not in _SERVED and trace.prefilled is not None:
                self._releaser.release(trace.prefilled.params, trace.outcome)
            self._metrics.request_done(endpoint.label, trace.outcome, time.perf_counter() - started)

    def _parse(self, raw: bytes, endpoint: Endpoint, headers: Any, started: float) -> Call:
        try:
            body = _json_decode(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        try:
            fields: _Chat | _Prompt = (
                msgspec.convert(body, _Chat) if endpoint is Endpoint.CHAT else msgspec.convert(body, _Prompt)
            )
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid request: {exc}") from None
        if isinstance(fields, _Chat):
            if not fields.messages:
                raise BadRequest("invalid request: `messages` must not be empty")
            if not all(isinstance(message, dict) for message in fields.messages):
                raise BadRequest("invalid request: every message in `messages` must be an object")
        _refuse_unroutable(fields, pd=bool(self._registry.engines(Role.PREFILL)))
        # 128 random bits as 32 hex digits, like uuid4().hex without building a UUID.
        request_id = headers.get("X-Request-Id") or os.urandom(16).hex()
        forward = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        if "Authorization" in headers:
            forward["Authorization"] = headers["Authorization"]
        key = (
            affinity_key(
                body, endpoint is Endpoint.CHAT, self._config.affinity_prefix_chars, self._config.affinity_prefix_tokens
            )
            if self._wants_key
            else None
        )
        return Call(
            endpoint=endpoint,
            body=body,
            raw=raw,
            request_id=request_id,
            stream=fields.stream,
            key=key,
            headers=forward,
            started=started,
        )

    async def _tokens(self, call: Call) -> Sequence[int] | None:
        """The ids the engine will compute for the prompt, or None (prefix affinity places
        the request); each outcome is counted. Never an error: the engine renders for itself."""
        assert self._prompt_results is not None
        label = call.endpoint.label
        try:
            # Size first: what scales with the body (rendering a chat of many messages,
            # tokenizing a long text) runs on a worker thread; the loop keeps serving.
            if len(call.raw) <= _INLINE_PROMPT_BYTES:
                tokens = self._prompt_tokens(call, off_gil=False)
            else:
                if self._tokenize_pool is None:
                    self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdconnect-tokenize")
                tokens = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize_pool, self._prompt_tokens, call, True
                )
        except NotRendered as exc:
            self._prompt_results.labels(label, exc.reason).inc()
            logger.debug("kv-aware: no token ids for a %s request: %s", label, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a tokenizer bug must not fail the request either
            self._prompt_results.labels(label, "tokenizer_error").inc()
            logger.warning("kv-aware: tokenizing a %s request failed: %r", label, exc)
            return None
        self._prompt_results.labels(label, "ok").inc()
        return tokens

    async def _keys(self, tokens: Sequence[int] | None) -> dict[int, list[int]]:
        """The chain keys a long prompt's lookups need, computed in a worker thread (the part
        of a lookup that scales with the prompt); a short prompt's lookups fill them inline."""
        if tokens is None or self._kv_aware is None or len(tokens) <= _INLINE_KEY_TOKENS:
            return {}
        return await self._kv_aware.keys_for(tokens)

    def _prompt_tokens(self, call: Call, off_gil: bool) -> Sequence[int]:
        """The prompt's ids (`_prompt`, tokenized); `off_gil` on a worker thread."""
        prompt = self._prompt(call)
        if not isinstance(prompt, tuple):
            return prompt
        assert self._tokenizer is not None
        return self._tokenizer.text_off_gil(*prompt) if off_gil else self._tokenizer.text(*prompt)

    def _prompt(self, call: Call) -> Sequence[int] | tuple[str, bool]:
        """The prompt's ids when the client sent ids, else its text (chat: rendered) and
        whether the engine adds special tokens; NotRendered when the router cannot tell."""
        body = call.body  # the types were checked by _parse
        if body.get("cache_salt") is not None:
            # A salt changes every block hash; the index matches content only.
            raise NotRendered("unsupported_request", "`cache_salt` is set")
        if call.endpoint is Endpoint.CHAT:
            if self._tokenizer is None:
                raise NotRendered("no_tokenizer", "no --tokenizer")
            return self._tokenizer.chat_text(body)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            raise NotRendered("unsupported_request", "a batch of prompts")
        if self._tokenizer is None:
            raise NotRendered("no_tokenizer", "no --tokenizer")
        add_special_tokens = body.get("add_special_tokens", True)  # vLLM's default for completions
        if not isinstance(add_special_tokens, bool):
            raise NotRendered("unsupported_request", "`add_special_tokens` is not a boolean")
        return prompt, add_special_tokens

    def _route(self, call: Call, trace: _Trace) -> Route | None:
        """Decode-first routing (`decider`): decode-local skips the prefill leg, on the decode
        engine the decision was made for (pinned); None without a decider."""
        if self._decider is None:
            return None
        engines = self._candidates(Role.DECODE, call, self._config.decode_attempts)
        route = self._decider.decide(engines[0] if engines else None, call.tokens, call.body, call.keys)
        if route.local:
            trace.decode_engines = engines
        return route

    # --- prefill leg ----------------------------------------------------------------------

    async def _prefill(self, call: Call, trace: _Trace, round_: int = 0) -> Prefilled | None:
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
            sent = time.perf_counter()
            try:
                resp, data = await self._send(
                    engine, call, body, deadline, whole=True, headers=headers, limit=self._prefill_limit
                )
                resp.release()
                answer = _decode_prefill_answer(data)
                verdict = True
            except _AttemptFailed as failure:
                verdict = self._judge(engine, failure, suspects)
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
                    Role.PREFILL, engine, _AttemptFailed("bad_answer", "not JSON"), retry=attempt + 1 < len(engines)
                )
                continue
            finally:
                engine.end(verdict)
            _blame(suspects)
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

    @staticmethod
    def _judge(engine: Engine, failure: _AttemptFailed, suspects: list[Engine]) -> bool | None:
        """An attempt's verdict on its engine. A 5xx answer may be the request's fault (a
        body the engine chokes on fails everywhere): the engine is only a suspect, blamed
        once another engine serves the same request; so may an answer over its size
        limit. Connect errors, timeouts and drops are the engine's."""
        if failure.reason in ("http_5xx", "too_large"):
            suspects.append(engine)
            return None
        return False

    def _fall_back(self, trace: _Trace, reason: str) -> None:
        trace.fallback = reason
        self._metrics.fallbacks.labels(reason).inc()
        logger.debug("decode-only fallback: %s", reason)

    # --- decode leg -----------------------------------------------------------------------

    async def _decode(
        self, http: web.Request, call: Call, trace: _Trace, params: dict[str, Any] | None
    ) -> web.StreamResponse:
        engines = trace.decode_engines or self._candidates(Role.DECODE, call, self._config.decode_attempts)
        if not engines:
            raise NoEngineAvailable(Role.DECODE.value)
        body = decode_body(call, params)
        deadline = self._config.decode_first_byte_timeout if call.stream else self._config.decode_timeout
        last: _AttemptFailed | None = None
        suspects: list[Engine] = []
        for attempt, engine in enumerate(engines):
            local = trace.route is not None and trace.route.local
            if attempt > 0 and (trace.prefilled is not None or local):
                # The failed engine may have claimed (or half-pulled) the plan: it must not
                # travel on. Free it, and prefill again for the next engine (which does not
                # hold a decode-local request's prompt either).
                body = decode_body(call, await self._prefill_again(call, trace, attempt))
            merger = UsageMerger.from_prefill(trace.prefilled.usage) if trace.prefilled else self._hit_check(trace)
            verdict: bool | None = None
            engine.begin()
            sent = time.perf_counter()
            try:
                try:
                    resp, first = await self._send(
                        engine, call, body, deadline, whole=not call.stream, limit=self._config.max_answer_bytes
                    )
                except _AttemptFailed as failure:
                    verdict = self._judge(engine, failure, suspects)
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
                _blame(suspects)
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
        raise DecodeFailed(f"all {len(engines)} decode attempts failed; last: {last}")

    async def _prefill_again(self, call: Call, trace: _Trace, round_: int) -> dict[str, Any] | None:
        """Release the current plan and get a fresh one (None: decode-only from here)."""
        if trace.route is not None and trace.route.local:
            trace.route.local, trace.route.reason = False, "decode_retry"
        if trace.prefilled is not None:
            self._releaser.release(trace.prefilled.params, "decode_retry")
        self._metrics.retries.labels(Role.PREFILL.value, "decode_retry").inc()
        trace.prefilled = None
        trace.prefilled = await self._prefill(call, trace, round_)
        return trace.prefilled.params if trace.prefilled else None

    def _writer(self, http: web.Request, out: web.StreamResponse, trace: _Trace) -> ClientWriter:
        def stalled() -> None:
            trace.stalled = True
            self._metrics.client_write_timeouts.inc()

        return ClientWriter(http, out, self._config.client_write_timeout, stalled)

    async def _answer(
        self, http: web.Request, trace: _Trace, status: int, headers: dict[str, str], parts: list[Buffer]
    ) -> web.StreamResponse:
        """A whole (non-streaming) answer, in pieces, written by the flow itself: aiohttp
        would write a returned Response with no deadline."""
        out = _HeadersWithBodyResponse(status=status, headers=headers)
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
        trace: _Trace,
        engine: Engine,
        resp: UpstreamResponse,
        first: bytes,
        merger: UsageMerger | None,
        headers: dict[str, str],
    ) -> tuple[web.StreamResponse, bool | None]:
        """Stream the decode answer to the client. Returns the response and the engine's verdict."""
        out = _HeadersWithBodyResponse(status=resp.status, headers=headers)
        # Always framed: whatever the engine leaves half-written is held back, never sent.
        rewriter = SseRewriter(merger, self._config.max_event_bytes)
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
                    self._metrics.first_token(call.endpoint.label, time.perf_counter() - call.started)
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
                # The last bytes and the chunked terminator in one write (with the headers
                # too when the answer came in one read): each write wakes the client.
                await writer.write_eof(data)
                if timed:
                    self._metrics.first_token(call.endpoint.label, time.perf_counter() - call.started)
                return out, True
            # The client may already have bytes, so no retry: drop any half event and end
            # the stream with a whole error event and [DONE], the way vLLM reports errors.
            resp.close()
            partial = rewriter.drop_partial()
            trace.outcome = "decode_dropped"
            reason = broke or ("ended mid-event" if partial else "ended without [DONE]")
            logger.warning("decode stream from %s broke: %s", engine.url, reason)
            await writer.write_eof(data + _stream_error(f"decode engine stream broke: {reason}"))
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

    # --- one attempt at one engine ----------------------------------------------------------

    async def _send(
        self,
        engine: Engine,
        call: Call,
        body: bytes,
        deadline: float,
        whole: bool,
        headers: dict[str, str] | None = None,
        limit: int | None = None,
    ) -> tuple[UpstreamResponse, bytes]:
        """POST `body`; the response and its whole body (`whole`, at most `limit` bytes)
        or first chunk.

        Raises _AttemptFailed for what another engine may not suffer (connect error,
        timeout, 5xx/408/429, a connection dropped before any byte, an answer over
        `limit`) and EngineRejected for the engine's verdict on the request itself
        (other 4xx).
        """
        resp: UpstreamResponse | None = None
        try:
            # The deadline rides on the connection (one timer), not on asyncio.timeout.
            resp = await self._upstream.post(
                engine.url, call.endpoint.path, body, headers or call.headers, timeout=deadline
            )
            if resp.status >= 400:
                await self._raise_for_status(resp)
            data = await (resp.read(limit) if whole else resp.chunk())
            if not data:
                raise _AttemptFailed("dropped", "connection closed before the first byte")
            resp.clear_deadline()  # a stream goes on under the idle limit alone
            return resp, data
        except _AttemptFailed:
            _close(resp)
            raise
        except TimeoutError:
            _close(resp)
            raise _AttemptFailed("timeout", f"no answer within {deadline}s") from None
        except ConnectFailed as exc:
            raise _AttemptFailed("connect", str(exc)) from None
        except AnswerTooLarge as exc:
            _close(resp)
            raise _AttemptFailed("too_large", str(exc)) from None
        except UpstreamError as exc:
            _close(resp)
            raise _AttemptFailed("dropped", f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            _close(resp)
            raise

    async def _raise_for_status(self, resp: UpstreamResponse) -> None:
        content_type = resp.headers.get(b"content-type", b"application/json").decode()
        try:
            data = await resp.read(_ERROR_BODY_LIMIT)
        except AnswerTooLarge:
            self._metrics.oversized_answers.labels("error").inc()
            message = f"engine answered {resp.status} with a body over {_ERROR_BODY_LIMIT} bytes"
            data, content_type = openai_error_body(resp.status, message, "EngineError"), "application/json"
        if resp.status >= 500 or resp.status in (408, 429):
            raise _AttemptFailed(
                f"http_{resp.status // 100}xx" if resp.status >= 500 else f"http_{resp.status}",
                data[:200].decode(errors="replace"),
            )
        raise EngineRejected(resp.status, data, content_type)

    # --- helpers ----------------------------------------------------------------------------

    def _candidates(self, role: Role, call: Call, attempts: int) -> list[Engine]:
        return self._policies[role].order(self._registry.engines(role), call.key, call.tokens, call.keys)[:attempts]

    def _hit_check(self, trace: _Trace) -> UsageMerger | None:
        """A decode-local answer's usage is the engine's own: read it to check the prediction."""
        if self._decider is None or trace.route is None or not trace.route.local:
            return None
        return self._decider.usage_check(trace.route)

    def _note_failure(self, role: Role, engine: Engine, failure: _AttemptFailed, retry: bool) -> None:
        logger.warning("%s attempt at %s failed: %s", role.value, engine.url, failure)
        if retry:
            self._metrics.retries.labels(role.value, failure.reason).inc()

    def _observe_affinity(self, role: Role, call: Call, engine: Engine) -> None:
        if self._affinity is not None and call.key is not None:
            self._metrics.placement(role.value, self._affinity[role].observe(call.key, engine.url))

    def _response_headers(self, call: Call, trace: _Trace, engine: Engine, resp: UpstreamResponse) -> dict[str, str]:
        # A plain dict: aiohttp's responses copy whatever they are given into a CIMultiDict.
        headers: dict[str, str] = {}
        headers["Content-Type"] = resp.headers.get(b"content-type", b"application/json").decode()
        headers["X-Request-Id"] = call.request_id
        if trace.fallback:
            headers["X-PDConnect-Fallback"] = trace.fallback
        if trace.route is not None:
            headers["X-PDConnect-Route"] = trace.route.header(self._config.route_headers)
        if self._config.route_headers:
            headers["X-PDConnect-Decode"] = engine.url
            headers["X-PDConnect-Prefill"] = trace.prefilled.engine.url if trace.prefilled else "none"
        return headers


class _HeadersWithBodyResponse(web.StreamResponse):
    """A stream whose status line and headers leave with its first bytes, in one write.

    aiohttp's StreamResponse writes the headers on `prepare()`, a write (and a wake-up of
    the client) of their own; its `Response` buffers them until the body. This flag (an
    aiohttp 3.12+ class attribute; older versions ignore it and send at `prepare()`) asks
    for the same on a stream. The first chunk follows `prepare()` at once, so no client
    waits longer for its headers.
    """

    _send_headers_immediately = False


def _blame(suspects: list[Engine]) -> None:
    """Another engine served the request these answered with 5xx: the fault was theirs."""
    for engine in suspects:
        engine.blame()
    suspects.clear()


def _close(resp: UpstreamResponse | None) -> None:
    if resp is not None:
        resp.close()


def _stream_error(message: str) -> bytes:
    event = {"error": {"message": message, "type": "BadGateway", "code": 502}}
    return b"data: " + _json_encode(event) + b"\n\ndata: [DONE]\n\n"
