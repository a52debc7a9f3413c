"""Why a routed request failed: one exception type per cause, mapped to HTTP in `app.py` only.

Code that knows the cause raises one of these; nothing below the HTTP layer picks a
status code, so the mapping from cause to status lives in exactly one table.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "AdminUnauthorized",
    "BadRequest",
    "BodyTimeout",
    "BodyTooLarge",
    "DecodeFailed",
    "DecodeTimeout",
    "EngineAnswerTooLarge",
    "EngineRejected",
    "NoEngineAvailable",
    "PrefillFailed",
    "RouterError",
    "UnknownEngine",
    "UnsupportedEncoding",
    "openai_error_body",
]


def openai_error_body(status: int, message: str, kind: str) -> bytes:
    """An error in the OpenAI (and vLLM) shape: `{"error": {"message", "type", "param", "code"}}`."""
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": None, "code": status}})


class RouterError(Exception):
    """Base of every error the router turns into an HTTP response."""


class BadRequest(RouterError):
    """The client's request cannot be routed (not JSON, not an object, bad admin body)."""


class BodyTooLarge(RouterError):
    """The request body, as sent or once inflated, is over `max_body_bytes`."""


class BodyTimeout(RouterError):
    """The request body did not arrive within `body_read_timeout`."""


class UnsupportedEncoding(RouterError):
    """The request body uses a Content-Encoding the router does not inflate."""


class NoEngineAvailable(RouterError):
    """No engine of the needed role is registered and healthy."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} engine available")
        self.role = role


class PrefillFailed(RouterError):
    """Every prefill attempt failed and decode-only fallback is switched off."""


class DecodeFailed(RouterError):
    """Every decode attempt failed before the client got a byte."""


class DecodeTimeout(RouterError):
    """A non-streaming decode took longer than `decode_timeout` (not retried: it may be
    a long generation, and running it twice would double the cost)."""


class EngineAnswerTooLarge(RouterError):
    """A decode engine's whole answer is over `max_answer_bytes`: dropped unread, not
    retried (another engine would produce the same answer for the same request)."""


class EngineRejected(RouterError):
    """An engine refused the request itself (4xx): the client gets the engine's answer.

    Retrying elsewhere cannot help: every engine would refuse the same body.
    """

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


class AdminUnauthorized(RouterError):
    """An admin call without the configured bearer token."""


class UnknownEngine(RouterError):
    """An admin call names an engine the registry does not hold."""
