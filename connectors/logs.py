"""Where pdconnect's log records go inside a vLLM process: through vLLM's own handlers.

vLLM configures only its own logger tree (`vllm`), so a record on `pdconnect.*` would
otherwise reach Python's last-resort handler: bare text on stderr, warnings only, with no
time, level or process, or nowhere when a server configures the root logger. Both
places that run inside vLLM processes call `log_like_vllm` when vLLM builds them: the
connector (engine core and workers) and the API middleware (API server).

Only vLLM's configured handlers are taken: those `logging.config.dictConfig` built from
vLLM's logging config (its default or `VLLM_LOGGING_CONFIG_PATH`), which all carry the
name the config gave them. A handler attached to vLLM's logger by hand for a while (a
test runner capturing a test's records) has no name and is left alone: copied, it would
stay on pdconnect's logger after its owner removed it from vLLM's, and see every record
twice from then on.
"""

from __future__ import annotations

import logging

__all__ = ["log_like_vllm"]


def log_like_vllm() -> None:
    """Send pdconnect's log records through vLLM's configured handlers, at vLLM's level,
    once per process (a no-op when `pdconnect` has handlers already or vLLM has none)."""
    ours, theirs = logging.getLogger("pdconnect"), logging.getLogger("vllm")
    configured = [handler for handler in theirs.handlers if handler.get_name()]
    if not ours.handlers and configured:
        for handler in configured:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
