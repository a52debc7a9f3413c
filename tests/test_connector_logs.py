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
def vllm_handlers() -> Iterator[tuple[_Kept, _Kept]]:
    """Two more handlers on vLLM's logger: one named, as vLLM's logging config names its own,
    and one attached by hand (as pytest attaches its capture for a test's phase); pdconnect's
    logger bare; all restored afterwards."""
    ours, theirs = logging.getLogger("pdconnect"), logging.getLogger("vllm")
    saved_handlers, saved_level = list(ours.handlers), ours.level
    for handler in saved_handlers:
        ours.removeHandler(handler)
    configured, by_hand = _Kept(), _Kept()
    configured.set_name("vllm")  # as vLLM's dictConfig names its handler
    theirs.addHandler(configured)
    theirs.addHandler(by_hand)
    try:
        yield configured, by_hand
    finally:
        theirs.removeHandler(configured)
        theirs.removeHandler(by_hand)
        for handler in list(ours.handlers):
            ours.removeHandler(handler)
        for handler in saved_handlers:
            ours.addHandler(handler)
        ours.setLevel(saved_level)


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("not called")


def test_the_api_guard_sends_pdconnect_lines_through_vllms_handlers(vllm_handlers: tuple[_Kept, _Kept]) -> None:
    """The API server builds the middleware but never a connector: before, the guard's
    warnings reached only Python's last-resort handler (bare text, no time or level)."""
    configured, by_hand = vllm_handlers
    app: ASGIApp = _app
    TransferParamsGuard(app)
    logging.getLogger("pdconnect.connector").warning("a refused pairing, named")
    logging.getLogger("pdconnect.connector").debug("below vLLM's level")
    assert configured.lines == ["a refused pairing, named"]
    # Copied, a handler attached by hand would outlive its owner on pdconnect's logger
    # (before: every later test in the run saw each record twice in its capture).
    assert by_hand.lines == []
    assert by_hand not in logging.getLogger("pdconnect").handlers
