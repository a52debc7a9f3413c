"""Why a routed request failed: one exception type per cause, each carrying its HTTP status and outcome.

Code that knows the cause raises one of these; nothing below the HTTP layer picks a
status code. Each class says once, in its class line, what its cause becomes:
`http_status` (the response `routes.error_response` builds), `outcome` (the request's label
in `metrics.OUTCOMES`) and `closes` (whether the connection is closed after the answer,
the body not fully read).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

__all__ = [
    "AdminUnauthorized",
    "BadRequest",
    "BodyTimeout",
    "BodyTooLarge",
    "ClientError",
    "DecodeFailed",
    "DecodeTimeout",
    "EngineAnswerTooLarge",
    "EngineRejected",
    "InvalidApiKey",
    "ModelNotFound",
    "NoEngineAvailable",
    "PrefillFailed",
    "RateLimited",
    "RouterError",
    "UnknownEngine",
    "UnsupportedEncoding",
    "UnsupportedFeature",
    "openai_error_body",
]


def openai_error_body(
    status: int, message: str, kind: str, param: str | None = None, code: str | int | None = None
) -> bytes:
    """An error in the OpenAI (and vLLM) shape: `{"error": {"message", "type", "param", "code"}}`;
    `code` is the HTTP status unless the cause has a name of its own (`model_not_found`)."""
    body = {"message": message, "type": kind, "param": param, "code": status if code is None else code}
    return msgspec.json.encode({"error": body})


class RouterError(Exception):
    """Base of every error the router turns into an HTTP response. A cause declares what it
    becomes in its class line (`class BodyTimeout(RouterError, status=408, closes=True)`);
    what it leaves out it inherits."""

    http_status: ClassVar[int] = 500
    outcome: ClassVar[str] = "bad_request"
    closes: ClassVar[bool] = False

    def __init_subclass__(
        cls, *, status: int | None = None, outcome: str | None = None, closes: bool | None = None, **kw: Any
    ) -> None:
        super().__init_subclass__(**kw)
        if status is not None:
            cls.http_status = status
        if outcome is not None:
            cls.outcome = outcome
        if closes is not None:
            cls.closes = closes


class BadRequest(RouterError, status=400):
    """The client's request cannot be routed (not JSON, not an object, bad admin body)."""


class BodyTooLarge(RouterError, status=413, closes=True):
    """The request body, as sent or once inflated, is over `max_body_bytes`."""


class BodyTimeout(RouterError, status=408, closes=True):
    """The request body did not arrive within `body_read_timeout`."""


class UnsupportedEncoding(RouterError, status=415, closes=True):
    """The request body uses a Content-Encoding the router does not inflate."""


class NoEngineAvailable(RouterError, status=503, outcome="no_engine"):
    """No engine of the needed role is registered and healthy."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} engine available")
        self.role = role


class PrefillFailed(RouterError, status=502, outcome="prefill_failed"):
    """Every prefill attempt failed and decode-only fallback is switched off."""


class DecodeFailed(RouterError, status=502, outcome="decode_failed"):
    """Every decode attempt failed before the client got a byte."""


class DecodeTimeout(RouterError, status=504, outcome="decode_timeout"):
    """A non-streaming decode took longer than `decode_timeout` (not retried: it may be
    a long generation, and running it twice would double the cost)."""


class EngineAnswerTooLarge(RouterError, status=502, outcome="decode_failed"):
    """A decode engine's whole answer is over `max_answer_bytes`: dropped unread, not
    retried (another engine would produce the same answer for the same request)."""


class EngineRejected(RouterError, outcome="rejected"):
    """An engine refused the request itself (4xx): the client gets the engine's answer.

    Retrying elsewhere cannot help: every engine would refuse the same body. The answer
    is the engine's own, status included (`status`).
    """

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


class AdminUnauthorized(RouterError, status=401):
    """An admin call without the configured bearer token."""


class UnknownEngine(RouterError, status=404):
    """An admin call names an engine the registry does not hold."""


class ClientError(RouterError):
    """A refusal in OpenAI's own words: its `type`, the `param` at fault and a named `code`
    (what OpenAI's SDKs read), plus any headers the answer needs (`Retry-After`)."""

    error_type: str = "invalid_request_error"
    code: ClassVar[str] = "invalid_request"

    def __init_subclass__(cls, *, code: str | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if code is not None:
            cls.code = code

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.headers = headers or {}


class UnsupportedFeature(ClientError, status=400, code="unsupported_parameter"):
    """A request asks for what the router cannot carry (stored state, background runs,
    server-side tools): refused before any engine sees it."""


class ModelNotFound(ClientError, status=404, code="model_not_found"):
    """The body's `model` names no pool of this router."""


class InvalidApiKey(ClientError, status=401, outcome="unauthorized", code="invalid_api_key"):
    """Client API keys are on and the request has none, or an unknown one."""


class RateLimited(ClientError, status=429, outcome="rate_limited", code="rate_limit_exceeded"):
    """A key is over its request or token rate; `Retry-After` says when it is not."""

    def __init__(self, message: str, kind: str, retry_after: int) -> None:
        # OpenAI's 429 names the exhausted limit as its type: "requests" or "tokens".
        super().__init__(message, headers={"Retry-After": str(retry_after)})
        self.error_type = kind
