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
leaves vLLM's own answer. Each deciding process writes at most `MAX_NOTES` distinct
notes (a verdict is one note per prefill engine and digest, not one per request),
counted in memory, and rewrites a note only when its words change.

Clean-up happens once, when a deciding process starts (`for_server(..., decides=True)`),
never on the refusal path: notes in its server's directory older than the process are
an earlier server's (vLLM's default `engine_id` is new at each start, an operator's may
not be), and are removed; each deciding process leaves an owner mark (`.pid-<pid>`), and
the directories of other servers of this user whose every owner is gone are removed
whole (vLLM's random ids would otherwise leave one behind per server that ever refused).
Notes are named by a digest (`notes_key`) of what the plan names, so a peer that can
only send plans cannot choose a file name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from vllm.config import VllmConfig

__all__ = ["MAX_NOTES", "RefusalNotes", "notes_key"]

logger = logging.getLogger("pdconnect.connector")

MAX_NOTES = 4096
MAX_NOTE_BYTES = 4096
_OWNER = ".pid-"  # an owner mark's prefix: `.pid-<pid>` of a deciding process
# A directory this young is left alone by other servers' clean-up: its owner may not have
# marked it yet (it makes the directory, then its mark).
_YOUNG_S = 60.0
# A directory without owner marks was left by a pdconnect that made none: its server may
# still run, so it goes only once untouched this long.
_UNMARKED_S = 24 * 3600.0


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


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists (ours or not: a reused pid keeps a directory, harmlessly)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    """The pid an owner mark names, or None for any other name."""
    digits = name.removeprefix(_OWNER)
    return int(digits) if name.startswith(_OWNER) and digits.isdigit() and int(digits) > 0 else None


def _abandoned(directory: Path, now: float) -> bool:
    """Whether another server's notes may go: every owner is gone, or, unmarked (an older
    pdconnect's), untouched for `_UNMARKED_S`."""
    age = now - directory.lstat().st_mtime
    if age < _YOUNG_S:
        return False
    owners = [pid for pid in map(_owner, (entry.name for entry in directory.iterdir())) if pid is not None]
    if not owners:
        return age > _UNMARKED_S
    return not any(map(_alive, owners))


class RefusalNotes:
    """The refusal notes of one vLLM server (all its engine cores and workers, and its API server)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory  # None: notes off
        self._written: dict[str, int] = {}  # key -> hash of the words this process wrote there

    @classmethod
    def for_server(cls, vllm_config: VllmConfig, decides: bool = False) -> RefusalNotes:
        """The notes of `vllm_config`'s server; `decides`: this process writes them (an engine
        core or a worker), and clears what earlier servers left (`start`)."""
        transfer = vllm_config.kv_transfer_config
        engine_id = (transfer.engine_id if transfer is not None else None) or ""
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            engine_id = engine_id.removesuffix(f"_dp{parallel.data_parallel_rank}")
        root = _private_root() if engine_id else None
        notes = cls(None if root is None else root / "refusals" / engine_id.replace("/", "_"))
        if decides:
            notes.start(time.time(), os.getpid())
        return notes

    def start(self, started: float, pid: int) -> None:
        """A deciding process `pid` started at `started` (epoch seconds): remove this server's
        notes older than that and other servers' directories whose owners are all gone; mark
        this directory as `pid`'s. Logged, never raised, on failure."""
        if self.directory is None:
            return
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.directory / f"{_OWNER}{pid}").touch(mode=0o600)
            for entry in self.directory.iterdir():
                owner = _owner(entry.name)
                if owner is not None and not _alive(owner):
                    entry.unlink(missing_ok=True)
                elif owner is None and entry.lstat().st_mtime < started:
                    entry.unlink(missing_ok=True)  # an earlier server's note (or half-written one)
            for other in self.directory.parent.iterdir():
                if other != self.directory and other.is_dir() and not other.is_symlink() and _abandoned(other, started):
                    shutil.rmtree(other, ignore_errors=True)
        except OSError as exc:
            logger.warning("could not clear old refusal notes in %s: %s", self.directory, exc)

    def write(self, key: str, message: str) -> None:
        """Note `message` for plans of `key` (`notes_key`); logged, never raised, on failure."""
        if self.directory is None:
            return
        words = hash(message)
        if self._written.get(key) == words:
            return  # this process said so already (a worker refuses each request of a pairing)
        if key not in self._written and len(self._written) >= MAX_NOTES:
            return
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".note-")
            with os.fdopen(fd, "wb") as out:
                out.write(message.encode()[:MAX_NOTE_BYTES])
            os.replace(temporary, self.directory / key)
            self._written[key] = words
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
