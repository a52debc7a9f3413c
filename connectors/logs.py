"""Where pdconnect's log records go inside a vLLM process: through vLLM's own handlers.

vLLM configures only its own logger tree (`vllm`), so a record on `pdconnect.*` would
otherwise reach Python's last-resort handler: bare text on stderr, warnings only, with no
time, level or process, or nowhere when a server configures the root logger. Both
places that run inside vLLM processes call `log_like_vllm` when vLLM builds them: the
connector (engine core and workers) and the API middleware (API server).
"""

from __future__ import annotations

import logging

__all__ = ["log_like_vllm"]


def log_like_vllm() -> None:
    """Send pdconnect's log records through vLLM's handlers, at vLLM's level, once per
    process (a no-op when `pdconnect` has handlers already or vLLM has none)."""
    ours, theirs = logging.getLogger("pdconnect"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
