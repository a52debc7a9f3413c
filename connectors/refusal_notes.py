"""Why a decode engine refused a prefill engine's plans: noted by the engine for its API server's error answer.

vLLM ends a request whose KV load failed with finish reason "error", and its OpenAI
server answers that with a fixed HTTP 500 "Internal server error": a connector has no
way to put its words into the response. The refusal is decided in the engine core
(the compat verdict, `connectors.compat`) or a worker (an unequal-TP pairing that
cannot work, `pdconnect.tpmap`), while the response is written by the API server, a
process of its own. What both know is the host and the server's KV transfer
`engine_id` (the API server's; vLLM appends `_dp<rank>` on each data-parallel engine
core). So the deciding process writes the refusal, named by the plan's (prefill
engine, side channel, compat digest), into a directory private to this user and named
by that id; the API server's middleware (`connectors.api_guard`) reads the note of a
failed request's plan and answers with its words instead of vLLM's.

A note is written before the request it explains is failed, so it is there when the
500 is. Writes are atomic (a rename) and never raise: a note that cannot be written
leaves vLLM's own answer. The directory holds at most `MAX_NOTES` notes (a verdict is
one note per prefill engine and digest, not one per request).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from vllm.config import VllmConfig

__all__ = ["MAX_NOTES", "RefusalNotes", "notes_key"]

logger = logging.getLogger("pdconnect.connector")

MAX_NOTES = 4096
MAX_NOTE_BYTES = 4096


def notes_key(remote_engine_id: str, side_channel: str, compat_hash: str) -> str:
    """The file name of the note on plans of one prefill engine, side channel and compat digest."""
    named = "\0".join((remote_engine_id, side_channel, compat_hash)).encode()
    return hashlib.sha256(named).hexdigest()[:32]


def _private_root() -> Path | None:
    """`<tmp>/pdconnect-<uid>`, made if missing; None when another user owns it or may write in it."""
    root = Path(tempfile.gettempdir()) / f"pdconnect-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
    except OSError as exc:
        logger.warning("refusal notes off: %s: %s", root, exc)
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        logger.warning("refusal notes off: %s is not a directory private to this user", root)
        return None
    return root


class RefusalNotes:
    """The refusal notes of one vLLM server (all its engine cores and workers, and its API server)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory  # None: notes off

    @classmethod
    def for_server(cls, vllm_config: VllmConfig) -> RefusalNotes:
        transfer = vllm_config.kv_transfer_config
        engine_id = (transfer.engine_id if transfer is not None else None) or ""
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            engine_id = engine_id.removesuffix(f"_dp{parallel.data_parallel_rank}")
        root = _private_root() if engine_id else None
        return cls(None if root is None else root / "refusals" / engine_id.replace("/", "_"))

    def write(self, key: str, message: str) -> None:
        """Note `message` for plans of `key` (`notes_key`); logged, never raised, on failure."""
        if self.directory is None:
            return
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            target = self.directory / key
            if not target.exists() and sum(1 for _ in self.directory.iterdir()) >= MAX_NOTES:
                return
            fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".note-")
            with os.fdopen(fd, "wb") as out:
                out.write(message.encode()[:MAX_NOTE_BYTES])
            os.replace(temporary, target)
        except OSError as exc:
            logger.warning("could not note a refusal in %s: %s", self.directory, exc)

    def read(self, key: str) -> str | None:
        """The note for plans of `key`, or None."""
        if self.directory is None:
            return None
        try:
            return (self.directory / key).read_bytes()[:MAX_NOTE_BYTES].decode(errors="replace")
        except OSError:
            return None
