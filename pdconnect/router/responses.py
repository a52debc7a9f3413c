"""The OpenAI Responses API (`/v1/responses`), stateless, routed P/D like chat.

vLLM (0.32) serves `/v1/responses` itself and carries `kv_transfer_params` both ways on
it: the request's field reaches the connector through the sampling params, and a whole
answer returns the prefill engine's plan. So the router forwards to the engines' own
`/v1/responses` and nothing is translated: the prefill leg is the request's
prompt-shaping fields with `max_output_tokens=1` (`request.prefill_body`), the decode leg
the client's body plus the plan.

What differs from chat, and lives here:
- what the router cannot carry is refused before any engine sees it
  (`refuse_unsupported`): anything that needs state kept between requests
  (`previous_response_id`, `conversation`, `store: true`, `background`, stored prompt
  templates, item references) would live on one engine that a later request may not
  reach; tools other than `function` tools run on the engine, not routed;
- usage is `input_tokens`/`output_tokens`, nested in the `response.completed` event of a
  stream (`ResponsesUsage`), and a stream ends with a terminal event, not `[DONE]`
  (`ends_with_terminal_event`); a broken stream ends with an `error` event
  (`responses_stream_error`); `DIALECTS` holds these per endpoint for the flow;
- the affinity key hashes the input as chat messages (`as_messages`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdconnect.router.errors import UnsupportedFeature
from pdconnect.router.usage import UsageMerger, ends_with_done, failure_pattern, stream_error
from pdconnect.sse import COMPLETIONS_ERROR, RESPONSES_ERROR, RESPONSES_FAILED, responses_error

__all__ = ["DIALECTS", "Dialect", "ResponsesUsage", "as_messages", "refuse_unsupported"]

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_MEMBERS: msgspec.json.Decoder[dict[str, msgspec.Raw]] = msgspec.json.Decoder(dict[str, msgspec.Raw])

# The events a Responses stream ends with (OpenAI's and vLLM's): after one, nothing follows.
_TERMINAL = (b"event: response.completed\n", b"event: response.incomplete\n", RESPONSES_FAILED, RESPONSES_ERROR)

# Fields that ask for state kept on a server between requests: one engine would keep it
# and a later request, routed elsewhere, would not find it.
_STATEFUL = {
    "previous_response_id": "responses are not stored: send the whole conversation in `input`",
    "conversation": "conversations are not stored: send the whole conversation in `input`",
    "prompt": "stored prompt templates are not supported: send the prompt in `input`",
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """UnsupportedFeature (400, naming the field) for what the router cannot carry."""
    for field, why in _STATEFUL.items():
        if body.get(field) is not None:
            raise UnsupportedFeature(f"`{field}` is not supported through the router: {why}", param=field)
    if body.get("store") is True:
        raise UnsupportedFeature(
            "`store: true` is not supported through the router (it keeps no responses): send `store: false`",
            param="store",
        )
    if body.get("background") is True:
        raise UnsupportedFeature("`background` runs are not supported through the router", param="background")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise UnsupportedFeature("`tools` must be a list of tools", param="tools")
        for tool in tools:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise UnsupportedFeature(
                    f"tool type {kind!r} is not supported through the router: built-in tools run on "
                    "the engine; only `function` tools (run by the client) are routed",
                    param="tools",
                )
    items = body.get("input")
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("type") == "item_reference":
                raise UnsupportedFeature(
                    "`item_reference` inputs need stored items, which the router does not keep", param="input"
                )


def as_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's input as chat messages, for the affinity key (only its leading chunk
    is hashed): instructions first, as the engine renders them."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages.extend(item for item in items if isinstance(item, dict))
    return messages


def ends_with_terminal_event(chunk: bytes) -> bool:
    """Whether the last whole event of `chunk` (which ends at an event boundary) ends a Responses stream."""
    start = chunk.rfind(b"\n\n", 0, len(chunk) - 2)
    return chunk.startswith(_TERMINAL, start + 2 if start >= 0 else 0)


def responses_stream_error(message: str) -> bytes:
    """The event that ends a Responses stream the router had to cut (the client may have bytes)."""
    return responses_error(message, "bad_gateway")


class ResponsesUsage(UsageMerger):
    """`UsageMerger` for Responses usage: `input_tokens` and `input_tokens_details` from the
    prefill leg, `output_tokens` from decode, `total_tokens` recomputed; in a stream, the
    usage is in the terminal event's `response` object."""

    prompt_field = "input_tokens"
    details_field = "input_tokens_details"
    output_field = "output_tokens"
    marker = b'"input_tokens"'

    def rewrite_event(self, event: bytes) -> bytes:
        at = event.find(b"data: ")
        if at < 0 or self.marker not in event:
            return event
        try:
            members = _MEMBERS.decode(event[at + 6 :])
            response = members.get("response")
            if response is None:
                return event
            inner = self.rewrite_body(bytes(response))
        except msgspec.DecodeError:
            return event
        members["response"] = msgspec.Raw(inner)
        return event[: at + 6] + _encode(members)


@dataclass(frozen=True)
class Dialect:
    """How an endpoint's answers carry usage (`merger`), end a stream (`ends`: whether whole
    events end it), report a stream the router cut (`stream_error`), and how an engine's
    stream says its request failed after the 200 (`failed`: a search for the bytes such an
    event holds, compiled here once for every stream of the endpoint)."""

    merger: type[UsageMerger]
    ends: Callable[[bytes], bool]
    stream_error: Callable[[str], bytes]
    failed: re.Pattern[bytes]


# How an engine's stream says its request failed: a completions or chat stream's error
# event; a Responses stream's error event or failed response.
_DATA_ERROR = failure_pattern(COMPLETIONS_ERROR)
_RESPONSES_FAILED = failure_pattern(RESPONSES_ERROR, RESPONSES_FAILED)


# By `Endpoint.label`.
DIALECTS = {
    "completions": Dialect(UsageMerger, ends_with_done, stream_error, _DATA_ERROR),
    "chat": Dialect(UsageMerger, ends_with_done, stream_error, _DATA_ERROR),
    "responses": Dialect(ResponsesUsage, ends_with_terminal_event, responses_stream_error, _RESPONSES_FAILED),
}
