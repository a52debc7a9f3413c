"""The router's logs and trace context: `traceparent` on both legs, ids on every line, the access log.

Against FAKE engines (`pdconnect.testbed.fake_engine`), which record the trace headers
each leg brought; the last test runs `pdconnect router --log-format json` as a process.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdconnect.router import logs
from pdconnect.router.logs import ACCESS_LOGGER, JsonFormatter, TextFormatter
from tests.router_support import COMPLETION, router_process_with_fakes, sse_events
from tests.waiting import wait_until, wait_until_async

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """What the router logs while the test runs, in the JSON format."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    router_logger = logging.getLogger("pdconnect.router")
    level = router_logger.level
    router_logger.addHandler(handler)
    router_logger.setLevel(logging.INFO)
    try:
        yield out
    finally:
        router_logger.removeHandler(handler)
        router_logger.setLevel(level)


def _entries(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.asyncio
async def test_the_clients_trace_context_reaches_both_legs(make) -> None:
    s = await make()
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"traceparent": PARENT, "tracestate": "k=v"})
    assert status == 200
    legs = [s.p[0].seen[-1], s.d[0].seen[-1]]
    assert [(leg.traceparent, leg.tracestate) for leg in legs] == [(PARENT, "k=v")] * 2


@pytest.mark.asyncio
@pytest.mark.parametrize("sent", [None, "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "garbage"])
async def test_without_a_valid_trace_context_both_legs_share_a_new_sampled_trace(make, sent: str | None) -> None:
    s = await make()
    headers = {"traceparent": sent} if sent else {}
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers=headers)
    assert status == 200
    prefill, decode = s.p[0].seen[-1].traceparent, s.d[0].seen[-1].traceparent
    assert prefill is not None and prefill == decode and prefill != sent
    version, trace_id, parent_id, flags = prefill.split("-")
    assert (version, flags, len(trace_id), len(parent_id)) == ("00", "01", 32, 16)
    assert int(trace_id, 16) != 0


@pytest.mark.asyncio
async def test_the_access_log_has_a_line_per_request_with_its_route_engines_and_ids(make, json_lines) -> None:
    s = await make()
    status, _, raw = await s.post(
        "/v1/completions",
        {**COMPLETION, "stream": True},
        headers={"traceparent": PARENT, "X-Request-Id": "logged-1"},
    )
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
    [access] = [e for e in _entries(json_lines) if e["logger"] == ACCESS_LOGGER]
    assert access["request_id"] == "logged-1" and access["trace_id"] == TRACE_ID
    assert (access["method"], access["path"], access["status"], access["outcome"], access["route"]) == (
        "POST",
        "/v1/completions",
        200,
        "ok",
        "pd",
    )
    assert (access["prefill"], access["decode"]) == (s.p[0].url, s.d[0].url)
    assert 0 < access["ttft_seconds"] <= access["duration_seconds"]


@pytest.mark.asyncio
async def test_every_line_about_a_request_carries_its_ids(make, json_lines) -> None:
    """A prefill engine fails once: the retry's warning and the access line both name the request."""
    s = await make(prefill=2)
    for fake in s.p:
        fake.faults.fail_next = 1
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "retried-1"})
    assert status == 200
    entries = _entries(json_lines)
    warnings = [e for e in entries if e["level"] == "warning"]
    assert warnings and all(e["request_id"] == "retried-1" for e in warnings), entries
    assert {e["logger"] for e in entries} >= {"pdconnect.router.flow", ACCESS_LOGGER}


@pytest.mark.asyncio
async def test_a_refused_request_is_logged_with_its_status(make, json_lines) -> None:
    s = await make()
    status, _, _ = await s.post("/v1/completions", {"model": "m", "prompt": 7})
    assert status == 400
    [access] = [e for e in _entries(json_lines) if e["logger"] == ACCESS_LOGGER]
    assert (access["status"], access["outcome"], access["route"]) == (400, "bad_request", "-")


@pytest.mark.asyncio
async def test_the_access_log_can_be_turned_off(make, json_lines) -> None:
    s = await make(access_log=False)
    assert (await s.post("/v1/completions", COMPLETION))[0] == 200
    assert not [e for e in _entries(json_lines) if e["logger"] == ACCESS_LOGGER]


def test_text_lines_name_the_request_in_brackets() -> None:
    from pdconnect.router.logs import bind_request

    record = logging.LogRecord("pdconnect.router.flow", logging.WARNING, __file__, 1, "attempt failed", None, None)
    formatter = TextFormatter()
    assert "[" not in formatter.format(record)

    def in_request() -> str:
        bind_request("req-7", TRACE_ID)
        return formatter.format(record)

    import contextvars

    line = contextvars.copy_context().run(in_request)
    assert " WARNING [req-7] pdconnect.router.flow: attempt failed" in line


def test_a_router_started_with_json_logs_writes_only_json_lines(tmp_path: Path) -> None:
    with router_process_with_fakes(tmp_path, router_args=("--log-level", "info", "--log-format", "json")) as router:
        with httpx.Client(timeout=30) as http:
            response = http.post(f"{router.base_url}/v1/completions", json=COMPLETION, headers={"traceparent": PARENT})
            assert response.status_code == 200

        def access_lines() -> list[dict[str, Any]]:
            # The log file opens with the command line the cluster ran.
            lines = [line for line in router.log_text().splitlines() if line.strip() and not line.startswith("$ ")]
            entries = [json.loads(line) for line in lines]  # every line is JSON
            return [e for e in entries if e["logger"] == ACCESS_LOGGER]

        access = wait_until(access_lines, "the router to log the request")
        assert [(e["trace_id"], e["status"], e["route"]) for e in access] == [(TRACE_ID, 200, "pd")]


@pytest.mark.parametrize(("level", "built"), [(logging.WARNING, 0), (logging.INFO, 1)])
def test_the_access_line_is_built_only_for_a_logger_that_keeps_it(
    monkeypatch: pytest.MonkeyPatch, level: int, built: int
) -> None:
    """A router at `--log-level warning` formats no access line per request."""
    from pdconnect.router.logs import AccessEntry

    calls: list[AccessEntry] = []
    real = AccessEntry.text

    def counted(self: AccessEntry) -> str:
        calls.append(self)
        return real(self)

    monkeypatch.setattr(AccessEntry, "text", counted)
    logger = logging.getLogger("tests.access-level")
    handler = _Kept()
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        _entry().log(logger)
    finally:
        logger.removeHandler(handler)
    assert (len(calls), len(handler.records)) == (built, built)
    if handler.records:
        line = handler.records[0].getMessage()
        assert line.startswith("POST /v1/completions 200 ok route=pd prefill=p decode=d ttft=10.0ms")


def _entry() -> Any:
    from pdconnect.router.logs import AccessEntry

    return AccessEntry(
        method="POST",
        path="/v1/completions",
        status=200,
        outcome="ok",
        route="pd",
        prefill="p",
        decode="d",
        ttft_seconds=0.01,
        duration_seconds=0.02,
    )


class _Kept(logging.Handler):
    """Every record that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def json_root() -> Iterator[Callable[[], logging.Handler]]:
    """`configure_logging("info", "json")` on a router process's logger tree, called in the
    test (pytest's own handler on the root, added for the test's call, goes), undone after."""
    from pdconnect.router.logs import configure_logging

    def configured() -> logging.Handler:
        configure_logging("info", "json")
        return root.handlers[0]

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    # A router process's tree: a connector test earlier in this process may have handed the
    # `pdconnect` loggers vLLM's handlers (as an engine does), and then the direct path
    # rightly steps aside.
    chain = [logging.getLogger(name) for name in ("pdconnect", "pdconnect.router", ACCESS_LOGGER)]
    saved_chain = [(list(node.handlers), node.level, node.propagate, node.disabled) for node in chain]
    try:
        for node in chain:
            node.handlers[:] = []
            node.setLevel(logging.NOTSET)
            node.propagate, node.disabled = True, False
        yield configured
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for node, (handlers, level, propagate, disabled) in zip(chain, saved_chain):
            node.handlers[:] = handlers
            node.setLevel(level)
            node.propagate, node.disabled = propagate, disabled


def test_the_json_access_line_written_by_the_handler_is_the_line_logging_writes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], json_root: Callable[[], logging.Handler]
) -> None:
    """With `configure_logging`'s JSON handler the access line skips the LogRecord path;
    it must be the same line (but for the time) as through `logging`, and a second
    handler (here a test's) sends it back through `logging`."""
    from pdconnect.router.logs import bind_request

    json_root()
    entry = _entry()
    logger = logging.getLogger(ACCESS_LOGGER)
    context = contextvars.copy_context()  # the request's ids stay in this test
    context.run(bind_request, "direct-1", TRACE_ID)
    through_logging: list[object] = []

    def made(*args: object, **kwargs: object) -> None:
        through_logging.append(args)

    monkeypatch.setattr(logging.Logger, "makeRecord", made)
    context.run(entry.log, logger)  # the direct path: no record made
    assert through_logging == []
    monkeypatch.undo()
    direct = json.loads(capsys.readouterr().err)
    kept = _Kept()
    logging.getLogger().addHandler(kept)  # two handlers: through `logging`, to both
    context.run(entry.log, logger)
    [record] = kept.records
    via_logging = json.loads(capsys.readouterr().err)
    assert direct.pop("time")[:4] == via_logging.pop("time")[:4]
    assert direct == via_logging
    assert (direct["request_id"], direct["trace_id"], direct["status"], direct["decode"]) == (
        "direct-1",
        TRACE_ID,
        200,
        "d",
    )
    assert record.getMessage() == direct["message"]


class _Writes:
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        self.chunks: list[str] = []

    def write(self, text: str) -> None:
        self.chunks.append(text)

    def flush(self) -> None:
        pass


@pytest.mark.asyncio
async def test_access_lines_logged_close_together_leave_in_one_write(
    json_root: Callable[[], logging.Handler], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an event loop the JSON handler holds access lines for up to `FLUSH_AFTER` seconds
    and writes them together, across loop turns and requests (not one write per request,
    just as its client takes the answer); another line, or a flush (`logging.shutdown`),
    writes those waiting first."""

    monkeypatch.setattr(logs, "FLUSH_AFTER", 0.3)  # longer than three loop turns on any machine
    handler = json_root()
    assert isinstance(handler, logging.StreamHandler)
    out = _Writes()
    handler.setStream(out)
    entry = _entry()
    access = logging.getLogger(ACCESS_LOGGER)
    for _ in range(3):
        entry.log(access)
        await asyncio.sleep(0)  # the loop's turn ends: another request's line comes later
    assert out.chunks == []
    await wait_until_async(lambda: out.chunks, "the waiting access lines to be written")
    assert [chunk.count("\n") for chunk in out.chunks] == [3]
    entry.log(access)
    logging.getLogger("pdconnect.router.flow").warning("after the access line")
    entry.log(access)
    handler.flush()
    lines = [json.loads(line) for line in "".join(out.chunks[1:]).splitlines()]
    assert [line["logger"] for line in lines] == [ACCESS_LOGGER, "pdconnect.router.flow", ACCESS_LOGGER]
