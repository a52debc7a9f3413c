"""The bytes that begin an engine's error and failure events in a stream, per API dialect.

One place for what three parts must agree on: the router tells by them that an engine's
stream failed after its 200 (`router.responses.DIALECTS`), the connector's API guard
(`connectors.api_guard`) finds by them the event it names a refused pairing in, and the
fake engine writes vLLM's events with them (`testbed.fake_engine`). `responses_error`
writes a Responses error event, the router's and the guard's.

A model's output cannot forge them: each holds a quote or a newline outside any JSON
string, and inside an event's JSON every quote and newline of the text is escaped. So a
byte search finds them only where an event begins, and a normal event is never parsed.
"""

from __future__ import annotations

import msgspec

__all__ = ["COMPLETIONS_ERROR", "RESPONSES_ERROR", "RESPONSES_FAILED", "responses_error"]

# How an error event of a completions or chat stream begins: vLLM's (`json.dumps` of its
# `ErrorResponse`), the router's and the guard's; no other event of those streams does.
COMPLETIONS_ERROR = b'data: {"error":'
# A Responses stream's error event (OpenAI's `ResponseErrorEvent`) and its failed response.
RESPONSES_ERROR = b"event: error\n"
RESPONSES_FAILED = b"event: response.failed\n"

_encode = msgspec.json.encode


def responses_error(message: str, code: str, param: str | None = None, sequence_number: int | None = None) -> bytes:
    """A Responses stream's `error` event (OpenAI's `ResponseErrorEvent`), with its blank line.

    `sequence_number`: the event's place in the stream (0 for the first event), when known."""
    event: dict[str, object] = {"type": "error", "code": code, "message": message, "param": param}
    if sequence_number is not None:
        event["sequence_number"] = sequence_number
    return RESPONSES_ERROR + b"data: " + _encode(event) + b"\n\n"
