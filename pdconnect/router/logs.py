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
handler writes a loop turn's access lines together, in one write (`_JsonHandler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = [
    "ACCESS_LOGGER",
    "AccessEntry",
    "JsonFormatter",
    "TextFormatter",
    "bind_request",
    "configure_logging",
]

ACCESS_LOGGER = "pdconnect.router.access"

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class _RequestIds:
    request_id: str
    trace_id: str | None


_CURRENT: contextvars.ContextVar[_RequestIds | None] = contextvars.ContextVar("pdconnect_request", default=None)


def bind_request(request_id: str, trace_id: str | None) -> None:
    """Tag every line logged from now on in this task (this request) with its ids."""
    _CURRENT.set(_RequestIds(request_id, trace_id))


@dataclass(slots=True)
class AccessEntry:
    """One request as the access log reports it (not frozen: a frozen init costs 1 us a request)."""

    method: str
    path: str
    status: int
    outcome: str
    route: str
    prefill: str | None
    decode: str | None
    ttft_seconds: float | None
    duration_seconds: float

    def message(self) -> str:
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
            logger.info("%s", self.message(), extra={"access": self})


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


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request and trace ids,
    the access entry's fields, and the exception, if any."""

    _encode = msgspec.json.Encoder().encode

    def __init__(self) -> None:
        super().__init__()
        self._second = -1  # the last line's whole second and its text: one strftime a second
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "access", None)
        entry = self._entry(record.created, record.levelname.lower(), record.name, record.getMessage())
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self._line(entry, access)

    def access_line(self, access: AccessEntry, logger_name: str) -> str:
        """The line `format` writes for `access` logged now at info on `logger_name`."""
        return self._line(self._entry(time.time(), "info", logger_name, access.message()), access)

    def _line(self, entry: dict[str, Any], access: object) -> str:
        line = self._encode(entry)
        if isinstance(access, AccessEntry):
            # msgspec encodes the dataclass as an object of its fields in order: spliced after
            # the entry's (`dataclasses.asdict` deep-copies: 20 us of a 25 us line).
            line = line[:-1] + b"," + self._encode(access)[1:]
        return line.decode()

    def _entry(self, created: float, level: str, name: str, message: str) -> dict[str, Any]:
        second = int(created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        stamp = self._stamp
        entry: dict[str, Any] = {
            "time": f"{stamp}.{int((created % 1) * 1000):03d}Z",
            "level": level,
            "logger": name,
            "message": message,
        }
        ids = _CURRENT.get()
        if ids is not None:
            entry["request_id"] = ids.request_id
            if ids.trace_id is not None:
                entry["trace_id"] = ids.trace_id
        return entry


class _JsonHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """`configure_logging`'s JSON handler: also writes access lines without a LogRecord.

    Access lines logged on an event loop wait for the end of the loop's turn and go out
    in one write: under load a turn ends many requests, and a write (and flush) each was
    most of a line's cost. Any other line, a `flush` (as at `logging.shutdown`) or an
    access line from another thread writes the waiting ones first, so the order holds; a
    process killed outright loses at most one turn's access lines.
    """

    def __init__(self) -> None:
        super().__init__()
        self.json = JsonFormatter()
        self.setFormatter(self.json)
        self._waiting: list[str] = []  # access lines of this loop turn; under the handler's lock

    def write_access(self, access: AccessEntry, logger_name: str) -> None:
        line = self.json.access_line(access, logger_name) + self.terminator
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: at once
            loop = None
        with self.lock or contextlib.nullcontext():
            self._waiting.append(line)
            if loop is None:
                self._write_waiting()
            elif len(self._waiting) == 1:
                loop.call_soon(self.flush)

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
        """Write the waiting access lines, one write; the caller holds the lock."""
        lines = "".join(self._waiting)
        self._waiting.clear()
        try:
            self.stream.write(lines)
            super().flush()
        except Exception:  # noqa: BLE001 - as `emit`: a log line never fails the request
            self.handleError(logging.makeLogRecord({"msg": lines}))


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
