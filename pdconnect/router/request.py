"""One client request as the router reads it: its typed view (`Call`) and the bodies of its two legs.

`parse_call` decodes the client's body once: typed structs check the fields the router
reads or rewrites (decoding is validation: a wrong type is a 400 naming the field before
any engine sees it), refuse what the router cannot carry (`_refuse_unroutable`), and keep
the body as received for the decode leg. `prefill_body` and `decode_body` build what each
engine is sent; `PREFILL_FIELDS` says which fields the prompt's KV depends on.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from pdconnect.router.engines import Role
from pdconnect.router.errors import BadRequest
from pdconnect.router.prompt import RoutingPrompt
from pdconnect.router.responses import as_messages, refuse_unsupported

if TYPE_CHECKING:
    from pdconnect.router.pools import Pool, Pools

__all__ = ["PREFILL_FIELDS", "Call", "Endpoint", "decode_body", "forward_trace_context", "parse_call", "prefill_body"]

_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode

# The affinity key of a body (`policy.affinity_key` with the configured prefix lengths).
KeyOf = Callable[[dict[str, Any], bool], int | None]


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"  # OpenAI's Responses API, stateless (`responses`)

    def __init__(self, path: str) -> None:
        # Plain attributes, read several times per request: `.value` and properties go
        # through enum's Python-level descriptors on CPython 3.11.
        self.path = path
        self.label = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}.get(path, "completions")


class _Fields(msgspec.Struct, kw_only=True):
    """The fields of a request the router reads or rewrites, typed: decoding is validation,
    so a wrong type is a 400 naming the field before any engine sees it (an engine
    answering a malformed body with 5xx would otherwise count against it)."""

    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    n: int | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None


class _Completion(_Fields, kw_only=True):
    """A completions request's."""

    prompt: str | list[str | int | list[int]]


class _Chat(_Fields, kw_only=True):
    """A chat request's: `messages` must be a non-empty list of objects (checked in
    `parse_call`: converting to `list[dict]` would copy every message, several times the
    cost of checking them)."""

    messages: list[Any]
    max_completion_tokens: int | None = None


class _Responses(_Fields, kw_only=True):
    """A Responses API request's (`responses.refuse_unsupported` checks the rest)."""

    input: str | list[Any]
    max_output_tokens: int | None = None
    store: bool | None = None
    background: bool | None = None


_STRUCTS: dict[Endpoint, type[_Fields]] = {
    Endpoint.COMPLETIONS: _Completion,
    Endpoint.CHAT: _Chat,
    Endpoint.RESPONSES: _Responses,
}


class Call(msgspec.Struct, frozen=True):
    """One client request, parsed once (a frozen Struct: a frozen dataclass's init cost 1.2 us
    more a request)."""

    endpoint: Endpoint
    body: dict[str, Any]
    request_id: str
    stream: bool
    key: int | None
    headers: dict[str, str]  # forwarded to every engine (request id, authorization, trace context)
    started: float
    pool: Pool  # the model pool that serves it (`pools`): its engines and policies
    trace_id: str = ""  # the W3C trace id both legs carry (`traceparent`)
    raw: bytes = b"{}"  # the client's body as received (inflated)
    # The prompt's token ids, when the policy needs them, and their chain keys, shared by
    # every lookup of the request (filled off the loop for a long prompt: `tokenizing`).
    prompt: RoutingPrompt | None = None


def parse_call(
    raw: bytes,
    endpoint: Endpoint,
    headers: Mapping[str, str],
    started: float,
    *,
    pools: Pools,
    key_of: KeyOf | None,
    tracing: bool = False,
    trace_id: str | None = None,
) -> Call:
    """The request in `raw`, checked; BadRequest names what is wrong. `pools`: the body's
    `model` picks one (ModelNotFound otherwise); with prefill engines in it, what would make
    several sequences is refused (`_refuse_unroutable`); `key_of`: the affinity key, None
    when no policy reads it; `tracing`: the router's own spans carry the trace context
    (`forward_trace_context`), of `trace_id` when given (the request's span's)."""
    try:
        body = _json_decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    pool = pools.select(body.get("model"))
    try:
        fields = msgspec.convert(body, _STRUCTS[endpoint])
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    if isinstance(fields, _Chat):
        if not fields.messages:
            raise BadRequest("invalid request: `messages` must not be empty")
        if not all(isinstance(message, dict) for message in fields.messages):
            raise BadRequest("invalid request: every message in `messages` must be an object")
    if isinstance(fields, _Responses):
        refuse_unsupported(body)
    _refuse_unroutable(fields, bool(pool.engines(Role.PREFILL)))
    # 128 random bits as 32 hex digits, like uuid4().hex without building a UUID.
    request_id = headers.get("X-Request-Id") or os.urandom(16).hex()
    forward = {"X-Request-Id": request_id, "Content-Type": "application/json"}
    if "Authorization" in headers:
        forward["Authorization"] = headers["Authorization"]
    forwarded = forward_trace_context(headers, forward, tracing=tracing)
    trace_id = trace_id if trace_id is not None else forwarded
    key = None
    if key_of is not None:
        # A Responses input is hashed as the chat messages it becomes.
        key = (
            key_of({"messages": as_messages(body)}, True)
            if isinstance(fields, _Responses)
            else key_of(body, endpoint is Endpoint.CHAT)
        )
    return Call(
        stream=fields.stream,
        endpoint=endpoint,
        body=body,
        raw=raw,
        request_id=request_id,
        key=key,
        headers=forward,
        started=started,
        trace_id=trace_id,
        pool=pool,
    )


# W3C Trace Context (https://www.w3.org/TR/trace-context/): version 00, a 32-hex trace id
# and a 16-hex parent id, neither all zeros, and flags.
_TRACEPARENT = re.compile(r"00-(?!0{32})([0-9a-f]{32})-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE_LIMIT = 512  # the spec's 32 members fit; a longer header is not forwarded


def forward_trace_context(headers: Mapping[str, str], forward: dict[str, str], *, tracing: bool = False) -> str:
    """Copy a well-formed `traceparent` (and its `tracestate`) into `forward`, so both legs'
    engine spans (vLLM's `--otlp-traces-endpoint`) join the client's trace; with none, start
    a trace, sampled, so prefill's and decode's spans still share one. Returns the trace id
    ("" when none was sent and `tracing`).

    A malformed header is not forwarded: the engines would start traces of their own. With
    `tracing` (the router's own spans) nothing is started here: the request's span starts
    the trace and each attempt's span puts its own `traceparent` on the leg.
    """
    parent = headers.get("traceparent", "")
    match = _TRACEPARENT.fullmatch(parent)
    if match is None and tracing:
        return ""
    if match is None:
        trace_id = os.urandom(16).hex()
        forward["traceparent"] = f"00-{trace_id}-{os.urandom(8).hex()}-01"
        return trace_id
    forward["traceparent"] = parent
    state = headers.get("tracestate")
    if state and len(state) <= _TRACESTATE_LIMIT:
        forward["tracestate"] = state
    return match.group(1)


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
    # vLLM renders a Responses input as a chat: instructions, input items, tools, reasoning
    # (its effort reaches the template), template kwargs; `text` too, since a harmony
    # model's prompt states the response format.
    Endpoint.RESPONSES: frozenset(
        (
            *_COMMON_PREFILL_FIELDS,
            "input",
            "instructions",
            "tools",
            "tool_choice",
            "reasoning",
            "text",
            "truncation",
            "chat_template_kwargs",
            "previous_input_messages",
            "media_io_kwargs",
            "mm_processor_kwargs",
        )
    ),
}


def prefill_body(call: Call) -> dict[str, Any]:
    """The prefill leg's body: compute the prompt, produce one token, hold the KV for decode."""
    fields = PREFILL_FIELDS[call.endpoint]
    body = {name: value for name, value in call.body.items() if name in fields}
    if call.endpoint is Endpoint.RESPONSES:
        body["max_output_tokens"] = 1
        body["store"] = False  # an engine that stores responses keeps none of these one-token answers
    else:
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


def _refuse_unroutable(fields: _Fields, pd: bool) -> None:
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
    elif isinstance(fields, _Completion) and _is_batch(fields.prompt):
        several = "a batch of prompts"
    if several is not None:
        raise BadRequest(
            f"invalid request: {several} is not supported through the prefill/decode router "
            "(one prefill plan per request); send one request per sequence"
        )


def _is_batch(prompt: str | list[Any]) -> bool:
    """Several prompts (strings or token lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
