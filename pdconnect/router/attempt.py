"""One attempt at one engine: the POST, its first byte or whole answer, and what a failure says of the engine.

Both legs (`flow`) try engines in turn. An attempt either gets an answer, or fails in a
way another engine may not (`AttemptFailed`: a connect error, a timeout, a 5xx, 408 or
429, a connection dropped before any byte, an answer over its limit), or is refused by
the engine for the request itself (`errors.EngineRejected`: any other 4xx, relayed to the
client, no retry). A failed attempt's verdict on its engine is `judge`'s: a 5xx or an
answer over the limit may be the request's fault (a body every engine chokes on), so
the engine is only a suspect until another engine serves the same request (`blame`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdconnect.router.engine_errors import error_message
from pdconnect.router.engines import Engine
from pdconnect.router.errors import EngineRejected, openai_error_body
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.request import Call
from pdconnect.router.upstream import AnswerTooLarge, ConnectFailed, UpstreamError, UpstreamPool, UpstreamResponse

__all__ = ["AttemptFailed", "EngineCaller", "blame", "judge"]

# An engine's error body is relayed to the client; one over this is replaced by the router's own.
_ERROR_BODY_LIMIT = 1 << 20


class AttemptFailed(Exception):
    """One attempt at one engine failed in a way another engine may not; `reason` labels it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class EngineCaller:
    """Sends one leg's body to one engine over the router's keep-alive connections."""

    upstream: UpstreamPool
    metrics: RouterMetrics

    async def send(
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

        Raises AttemptFailed for what another engine may not suffer (connect error,
        timeout, 5xx/408/429, a connection dropped before any byte, an answer over
        `limit`) and EngineRejected for the engine's verdict on the request itself
        (other 4xx).
        """
        resp: UpstreamResponse | None = None
        try:
            # The deadline rides on the connection (one timer), not on asyncio.timeout.
            sent_headers = headers or call.headers
            if engine.dp_rank is not None:
                sent_headers = {**sent_headers, **engine.headers}  # pinned to the rank the policy chose
            resp = await self.upstream.post(engine.url, call.endpoint.path, body, sent_headers, timeout=deadline)
            if resp.status >= 400:
                await self._raise_for_status(resp)
            data = await (resp.read(limit) if whole else resp.chunk())
            if not data:
                raise AttemptFailed("dropped", "connection closed before the first byte")
            resp.clear_deadline()  # a stream goes on under the idle limit alone
            return resp, data
        except AttemptFailed:
            _close(resp)
            raise
        except TimeoutError:
            _close(resp)
            raise AttemptFailed("timeout", f"no answer within {deadline}s") from None
        except ConnectFailed as exc:
            raise AttemptFailed("connect", str(exc)) from None
        except AnswerTooLarge as exc:
            _close(resp)
            raise AttemptFailed("too_large", str(exc)) from None
        except UpstreamError as exc:
            _close(resp)
            raise AttemptFailed("dropped", f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            _close(resp)
            raise

    async def _raise_for_status(self, resp: UpstreamResponse) -> None:
        content_type = resp.headers.get(b"content-type", b"application/json").decode()
        try:
            data = await resp.read(_ERROR_BODY_LIMIT)
        except AnswerTooLarge:
            self.metrics.oversized_answers.labels("error").inc()
            message = f"engine answered {resp.status} with a body over {_ERROR_BODY_LIMIT} bytes"
            data, content_type = openai_error_body(resp.status, message, "EngineError"), "application/json"
        if resp.status >= 500 or resp.status in (408, 429):
            raise AttemptFailed(
                f"http_{resp.status // 100}xx" if resp.status >= 500 else f"http_{resp.status}",
                error_message(data),
            )
        raise EngineRejected(resp.status, data, content_type)


def judge(engine: Engine, failure: AttemptFailed, suspects: list[Engine]) -> bool | None:
    """An attempt's verdict on its engine. A 5xx answer may be the request's fault (a
    body the engine chokes on fails everywhere): the engine is only a suspect, blamed
    once another engine serves the same request; so may an answer over its size
    limit. Connect errors, timeouts and drops are the engine's."""
    if failure.reason in ("http_5xx", "too_large"):
        suspects.append(engine)
        return None
    return False


def blame(suspects: list[Engine]) -> None:
    """Another engine served the request these answered with 5xx: the fault was theirs."""
    for engine in suspects:
        engine.blame()
    suspects.clear()


def _close(resp: UpstreamResponse | None) -> None:
    if resp is not None:
        resp.close()
