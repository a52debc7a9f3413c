"""pdconnect's log lines inside vLLM processes go through vLLM's own handlers (`connectors.logs`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import vllm.logger  # noqa: F401  configures vLLM's logger tree, as in an engine or an API server

from connectors.api_guard import ASGIApp, Receive, Scope, Send, TransferParamsGuard


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def vllm_handler() -> Iterator[_Kept]:
    """One more handler on vLLM's logger; pdconnect's logger bare, restored afterwards."""
    ours, theirs = logging.getLogger("pdconnect"), logging.getLogger("vllm")
    saved_handlers, saved_level = list(ours.handlers), ours.level
    for handler in saved_handlers:
        ours.removeHandler(handler)
    kept = _Kept()
    theirs.addHandler(kept)
    try:
        yield kept
    finally:
        theirs.removeHandler(kept)
        for handler in list(ours.handlers):
            ours.removeHandler(handler)
        for handler in saved_handlers:
            ours.addHandler(handler)
        ours.setLevel(saved_level)


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("not called")


def test_the_api_guard_sends_pdconnect_lines_through_vllms_handlers(vllm_handler: _Kept) -> None:
    """The API server builds the middleware but never a connector: before, the guard's
    warnings reached only Python's last-resort handler (bare text, no time or level)."""
    app: ASGIApp = _app
    TransferParamsGuard(app)
    logging.getLogger("pdconnect.connector").warning("a refused pairing, named")
    logging.getLogger("pdconnect.connector").debug("below vLLM's level")
    assert vllm_handler.lines == ["a refused pairing, named"]
