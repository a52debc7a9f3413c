"""The usage a P/D client sees: prompt accounting from prefill, output accounting from decode.

A decode engine counts the KV it received from the prefill engine as cached prompt
tokens, so on its own a cold P/D request would look like a full prefix-cache hit. The
prompt was really computed on the prefill engine, whose `cached_tokens` is the true
saving; the generated tokens are the decode engine's (prefill's one token is never
shown). So: `prompt_tokens` and `prompt_tokens_details` from prefill, `completion_tokens`
from decode, `total_tokens` recomputed. When prefill reports no details, decode's are
dropped rather than left to claim a hit that did not happen.

Streams are re-framed into whole events (a partial event is held back, so an error
event can never be glued onto half of one, and never more than `max_event_bytes` of
it); only events that carry usage are parsed, so the common chunk passes through as the
same bytes object. Parsing an answer decodes its top level only: every other member
(choices, logprobs: an answer can be hundreds of megabytes) stays raw bytes, copied
through, never turned into Python objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

# What the rewriters take and give: bytes, or views of them.
Buffer = bytes | bytearray | memoryview

__all__ = [
    "Buffer",
    "EventTooLarge",
    "SseRewriter",
    "UsageMerger",
    "ends_with_done",
    "failure_pattern",
    "stream_error",
]

_DONE = b"data: [DONE]\n\n"
_decode = msgspec.json.decode
_encode = msgspec.json.encode
# An answer's members, each left as its raw JSON text.
_MEMBERS: msgspec.json.Decoder[dict[str, msgspec.Raw]] = msgspec.json.Decoder(dict[str, msgspec.Raw])
_decode_members = _MEMBERS.decode


class EventTooLarge(ValueError):
    """A streamed event grew past the limit without ending."""


class UsageMerger:
    """Rewrites decode-side usage objects with the prefill leg's prompt accounting.

    A usage object's members are named by the endpoint's dialect: these are Completions'
    and Chat's (a subclass renames them). `marker` is the bytes only a usage-carrying
    event holds (events without it pass untouched); `rewrite_event` rewrites one whole
    event that holds it."""

    prompt_field: ClassVar[str] = "prompt_tokens"
    details_field: ClassVar[str] = "prompt_tokens_details"
    output_field: ClassVar[str] = "completion_tokens"
    marker: ClassVar[bytes] = b'"prompt_tokens"'

    def __init__(self, prompt_tokens: int, details: Any) -> None:
        self._prompt_tokens = prompt_tokens
        self._details = details

    @classmethod
    def from_prefill(cls, usage: Any) -> UsageMerger | None:
        """The merger for a prefill answer's usage; None if it has no prompt count."""
        if isinstance(usage, dict) and isinstance(usage.get(cls.prompt_field), int):
            return cls(usage[cls.prompt_field], usage.get(cls.details_field))
        return None

    def merge(self, usage: dict[str, Any]) -> None:
        usage[self.prompt_field] = self._prompt_tokens
        if self._details is not None:
            usage[self.details_field] = self._details
        else:
            usage.pop(self.details_field, None)
        output = usage.get(self.output_field)
        if isinstance(output, int):
            usage["total_tokens"] = self._prompt_tokens + output

    def rewrite_body(self, body: Buffer) -> bytes:
        """A JSON answer with its usage merged; unchanged if it has no usage object."""
        parts = self.rewrite_parts(body)
        return bytes(body) if len(parts) == 1 and parts[0] is body else b"".join(parts)

    def rewrite_parts(self, body: Buffer) -> list[Buffer]:
        """The same as pieces to write in order (`[body]` when unchanged). Only the top
        level and `usage` are decoded; every other member is a view of `body`, not a copy."""
        try:
            members = _decode_members(body)
            usage = _decode(members["usage"]) if "usage" in members else None
        except msgspec.DecodeError:
            return [body]
        if not isinstance(usage, dict):
            return [body]
        self.merge(usage)
        parts: list[Buffer] = [b"{"]
        for name, value in members.items():
            if len(parts) > 1:
                parts.append(b",")
            parts += (_encode(name), b":", _encode(usage) if name == "usage" else memoryview(value))
        parts.append(b"}")
        return parts

    def rewrite_event(self, event: bytes) -> bytes:
        """One whole streamed event (no trailing blank line) with its usage merged."""
        if not event.startswith(b"data: ") or self.marker not in event:
            return event
        return b"data: " + self.rewrite_body(event[6:])


def stream_error(message: str) -> bytes:
    """The event that ends a completions or chat stream the router had to cut, the way vLLM reports errors."""
    event = {"error": {"message": message, "type": "BadGateway", "code": 502}}
    return b"data: " + _encode(event) + b"\n\ndata: [DONE]\n\n"


def ends_with_done(chunk: bytes) -> bool:
    """Whether a stream's whole events so far end it (completions and chat: `[DONE]`)."""
    return chunk.endswith(_DONE)


def failure_pattern(*marks: bytes) -> re.Pattern[bytes]:
    """One search for every failure mark at once, `SseRewriter`'s `failed`.

    Built once per dialect (`responses.Dialect.failed`), not per stream: joining, escaping
    and compiling the marks (or finding them in `re`'s cache) was most of a rewriter's
    construction, on every relayed stream, for a value that depends on the dialect alone."""
    return re.compile(b"|".join(map(re.escape, marks)))


class SseRewriter:
    """Re-frames a server-sent-event byte stream into whole events, merging usage if asked.

    Network reads do not follow event boundaries, so an incomplete tail is held back
    until its blank line arrives (vLLM writes whole events, so this rarely waits).
    Invariant: everything `feed` returned ends at an event boundary; `complete` says
    whether the stream so far ended with `[DONE]` and left nothing half-written;
    `failed`, whether a whole event so far matched the `failed` pattern (the bytes an
    engine's error event holds: `responses.Dialect.failed`, from `failure_pattern`).
    """

    def __init__(
        self,
        merger: UsageMerger | None,
        max_event_bytes: int | None = None,
        ends: Callable[[bytes], bool] = ends_with_done,
        failed: re.Pattern[bytes] | None = None,
    ) -> None:
        self._merger = merger
        self._limit = max_event_bytes
        self._ends = ends  # whether whole events end the stream (the Responses API has no [DONE])
        self._tail = b""
        self._done = False
        # One search of the whole events of a read for every mark at once (a chunk is
        # relayed per read: a check per mark per chunk was a generator each).
        self._failure = failed
        self.failed = False

    @property
    def complete(self) -> bool:
        return self._done and not self._tail

    def feed(self, chunk: bytes) -> bytes:
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n")
            self._tail = chunk if cut < 0 else chunk[cut + 2 :]
            if self._limit is not None and len(self._tail) > self._limit:
                raise EventTooLarge(f"a streamed event over the {self._limit}-byte limit")
            if cut < 0:
                return b""
            chunk = chunk[: cut + 2]
        self._done = self._ends(chunk)
        if self._failure is not None and not self.failed:
            self.failed = self._failure.search(chunk) is not None
        if self._merger is None or self._merger.marker not in chunk:
            return chunk
        return self._rewrite_usage(chunk)

    def drop_partial(self) -> bytes:
        """Forget a half-written event (its sender is gone); returns what was dropped."""
        tail, self._tail = self._tail, b""
        return tail

    def flush(self) -> bytes:
        """Whatever is held back (a stream that ended without a final blank line)."""
        return self.drop_partial()

    def _rewrite_usage(self, whole: bytes) -> bytes:
        # Rewrite only the events that carry usage; a read can hold a whole stream.
        merger = self._merger
        assert merger is not None
        out: list[bytes] = []
        start = 0
        while (at := whole.find(merger.marker, start)) >= 0:
            begin = whole.rfind(b"\n\n", start, at)
            begin = start if begin < 0 else begin + 2
            end = whole.find(b"\n\n", at)
            out += (whole[start:begin], merger.rewrite_event(whole[begin:end]), b"\n\n")
            start = end + 2
        out.append(whole[start:])
        return b"".join(out)
