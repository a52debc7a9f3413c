"""What an engine's error answer says, as the line the router puts into its own error when it cannot relay it.

A decode engine's 5xx is retried elsewhere, and when every attempt failed the client gets
the router's 502 naming the last failure. vLLM and the connector answer errors in the
OpenAI shape (`{"error": {"message": ...}}`); the message is what says why (a refused
pairing names the field and both engines' values, `connectors.api_guard`), so it is
taken whole rather than the body's first bytes with its JSON around it.
"""

from __future__ import annotations

import msgspec

__all__ = ["MESSAGE_LIMIT", "error_message"]

MESSAGE_LIMIT = 2000  # a refusal naming every differing field of a hybrid model fits
_RAW_LIMIT = 200  # a body that is not an OpenAI error: its first bytes


class _Error(msgspec.Struct):
    message: str


class _Answer(msgspec.Struct):
    error: _Error


_DECODER: msgspec.json.Decoder[_Answer] = msgspec.json.Decoder(_Answer)


def error_message(body: bytes) -> str:
    """The OpenAI error's message (at most `MESSAGE_LIMIT` characters), else the body's first bytes."""
    try:
        message: str = _DECODER.decode(body).error.message
        return message[:MESSAGE_LIMIT]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return body[:_RAW_LIMIT].decode(errors="replace")
