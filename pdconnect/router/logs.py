"""The router's log lines: text or JSON, each about a request carrying its request and trace ids; the access log.

A request's ids live in a context variable set when the request is parsed
(`bind_request`): aiohttp serves each request in a task of its own, so every line logged
on its behalf, by any module, carries them, and lines of other requests do not. Lines
from threads (the releaser's) carry what the line itself says.

The access log is one line per request, at its end, on the logger
`pdconnect.router.access`: endpoint, status, outcome, route, the engines, time to first
token and duration. In JSON each of those is a field of its own. With the JSON handler
`configure_logging` installs, an access line skips the logging machinery (a LogRecord,
the logger chain, the handler's formatting call: 5 % of the router's samples under
`bench-router --observed`, py-spy) and is written by the handler itself, the same line;
any other setup (a test's handler, a filter) gets it through `logging` as before. The
handler writes the access lines of up to `FLUSH_AFTER` seconds together, in one write
(`_JsonHandler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from typing import Any, Literal

import msgspec

_with_header = msgspec.structs.replace

__all__ = [
    "ACCESS_LOGGER",
    "FLUSH_AFTER",
    "AccessEntry",
    "JsonFormatter",
    "TextFormatter",
    "bind_request",
    "configure_logging",
]

ACCESS_LOGGER = "pdconnect.router.access"

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _RequestIds(msgspec.Struct, frozen=True):
    request_id: str
    trace_id: str | None


_CURRENT: contextvars.ContextVar[_RequestIds | None] = contextvars.ContextVar("pdconnect_request", default=None)


def bind_request(request_id: str, trace_id: str | None) -> None:
    """Tag every line logged from now on in this task (this request) with its ids."""
    _CURRENT.set(_RequestIds(request_id, trace_id))


class AccessEntry(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """One request as the access log reports it, and in JSON the line itself: the fields
    every line has come first, filled in when the line is written (`JsonFormatter`; the
    ids left out when unknown), then the request's. One field list: the line is this
    entry, copied with its header (`msgspec.structs.replace`), not restated."""

    time: str | None = None
    level: str | None = None
    logger: str | None = None
    message: str | None = None
    request_id: str | None = None
    trace_id: str | None = None
    method: str
    path: str
    status: int
    outcome: str
    route: str
    prefill: str | None
    decode: str | None
    ttft_seconds: float | None
    duration_seconds: float

    def text(self) -> str:
        """The line's message: the entry in words."""
        ttft = f"{self.ttft_seconds * 1000:.1f}ms" if self.ttft_seconds is not None else "-"
        return (
            f"{self.method} {self.path} {self.status} {self.outcome} route={self.route} "
            f"prefill={self.prefill or '-'} decode={self.decode or '-'} ttft={ttft} "
            f"duration={self.duration_seconds * 1000:.1f}ms"
        )

    def log(self, logger: logging.Logger) -> None:
        if not logger.isEnabledFor(logging.INFO):  # a router at --log-level warning builds no line
            return
        direct = _direct_handler(logger)
        if direct is not None:
            direct.write_access(self, logger.name)
        else:
            logger.info("%s", self.text(), extra={"access": self})


class TextFormatter(logging.Formatter):
    """The plain format, with `[request id]` after the level on a request's lines."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = _CURRENT.get()
        if ids is None:
            return line
        # After "date time LEVEL": the id sits where a reader looks for it.
        head, sep, rest = line.partition(f" {record.levelname} ")
        return f"{head}{sep}[{ids.request_id}] {rest}" if sep else line


# How long an access line logged on an event loop may wait to be written with others. A
# line written as soon as its request ended (formatting and a write: 9 us) ran while the
# client was taking the answer: on the 2-core bench (router and client sharing the cores)
# that added 40-53 us to the next request's p50, 16 us when held 10 ms
# (docs/benchmarks.md, "With tracing, JSON logs and the access log on").
FLUSH_AFTER = 0.01

# An access line logged on an event loop, waiting for `FLUSH_AFTER`: when it
# was logged, the request's ids then, the entry, the logger's name.
_Waiting = tuple[float, _RequestIds | None, AccessEntry, str]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request and trace ids,
    the access entry's fields, and the exception, if any."""

    _encode = msgspec.json.Encoder().encode
    _encode_lines = msgspec.json.Encoder().encode_lines

    def __init__(self) -> None:
        super().__init__()
        self._second = -1  # the last line's whole second and its text: one strftime a second
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "access", None)
        if isinstance(access, AccessEntry) and not record.exc_info:
            return self._encode(self._access(record.created, _CURRENT.get(), access, record.name)).decode()
        entry: dict[str, Any] = {
            "time": self._time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        ids = _CURRENT.get()
        if ids is not None:
            entry["request_id"] = ids.request_id
            if ids.trace_id is not None:
                entry["trace_id"] = ids.trace_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self._encode(entry).decode()

    def access_lines(self, waiting: list[_Waiting]) -> str:
        """The lines `format` writes for these access entries, each logged at info when it was."""
        return self._encode_lines([self._access(*item) for item in waiting]).decode()

    def _access(self, created: float, ids: _RequestIds | None, access: AccessEntry, name: str) -> AccessEntry:
        return _with_header(
            access,
            time=self._time(created),
            level="info",
            logger=name,
            message=access.text(),
            request_id=ids.request_id if ids is not None else None,
            trace_id=ids.trace_id if ids is not None else None,
        )

    def _time(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((created % 1) * 1000):03d}Z"


class _JsonHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """`configure_logging`'s JSON handler: also writes access lines without a LogRecord.

    Access lines logged on an event loop wait up to `FLUSH_AFTER` seconds and are
    formatted and written together, in one write, away from the moment a client takes its
    answer; under load that is many requests, and a write (and flush) each was most of a
    line's cost: formatted together, the encoder runs once for them all. Any other line,
    a `flush` (as at `logging.shutdown`) or an access line from another thread writes the
    waiting ones first, so the order holds; a process killed outright loses at most
    `FLUSH_AFTER` seconds of access lines.
    """

    def __init__(self) -> None:
        super().__init__()
        self.json = JsonFormatter()
        self.setFormatter(self.json)
        self._waiting: list[_Waiting] = []  # access lines not yet written; under the handler's lock

    def write_access(self, access: AccessEntry, logger_name: str) -> None:
        item = (time.time(), _CURRENT.get(), access, logger_name)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: at once
            loop = None
        with self.lock or contextlib.nullcontext():
            self._waiting.append(item)
            if loop is None:
                self._write_waiting()
            elif len(self._waiting) == 1:
                loop.call_later(FLUSH_AFTER, self.flush)

    def emit(self, record: logging.LogRecord) -> None:
        if self._waiting:  # `handle` holds the lock
            self._write_waiting()
        super().emit(record)

    def flush(self) -> None:
        with self.lock or contextlib.nullcontext():
            if self._waiting:
                self._write_waiting()
            else:
                super().flush()

    def _write_waiting(self) -> None:
        """Format and write the waiting access lines, one write; the caller holds the lock."""
        waiting, self._waiting = self._waiting, []
        try:
            self.stream.write(self.json.access_lines(waiting))
            super().flush()
        except Exception:  # noqa: BLE001 - as `emit`: a log line never fails the request
            self.handleError(logging.makeLogRecord({"msg": f"{len(waiting)} access lines"}))


def _direct_handler(logger: logging.Logger) -> _JsonHandler | None:
    """The handler to write `logger`'s access line straight to, when the only place the
    line would go is `configure_logging`'s JSON handler on the root, unfiltered."""
    node: logging.Logger | None = logger
    while node is not None and node.parent is not None:  # up to the root
        if node.handlers or node.filters or node.disabled or not node.propagate:
            return None
        node = node.parent
    if node is None or node.filters or len(node.handlers) != 1:
        return None
    handler = node.handlers[0]
    if isinstance(handler, _JsonHandler) and not handler.filters and handler.level <= logging.INFO:
        return handler
    return None


def configure_logging(level: str, fmt: Literal["text", "json"]) -> None:
    """Log to stderr at `level` in `fmt`, replacing what was there."""
    handler: logging.Handler
    if fmt == "json":
        handler = _JsonHandler()
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
