"""The refusal notes an engine leaves for its API server, and the error its client then reads, without engines.

The engine-level proof is tests/test_compat_engines.py (two real engines whose block
sizes differ, with `pdconnect router` in front); these pin the parts: where the notes
live and who may write there, which note a request's plan reads, that only a 500 is
replaced and only when a note exists (a whole 500, a stream's error event, or a stream
vLLM cut with an exception), that a model's text cannot forge an error event, the line
the router takes from an engine's error, and the notes' upkeep: cleared when a deciding
process starts, capped by a count in memory, never listed on the refusal path.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from connectors import refusal_notes
from connectors.api_guard import TransferParamsGuard
from connectors.metadata import PullSpec
from connectors.refusal_notes import RefusalNotes, notes_key
from pdconnect.router.engine_errors import error_message
from pdconnect.router.responses import DIALECTS, ends_with_terminal_event
from tests.test_transfer_params import PLAN
from tests.test_worker_pulls import _worker

REFUSAL = "group 0 block_size: prefill engine 64, this decode engine 128"
KEY = notes_key("prefill-0", "tcp://10.0.0.5:5700", "c" * 16)  # PLAN's engine, side channel and digest


def _config(engine_id: str, dp_size: int = 1, dp_rank: int = 0) -> Any:
    """The two parts of a VllmConfig the notes read."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        parallel_config=SimpleNamespace(data_parallel_size=dp_size, data_parallel_rank=dp_rank),
    )


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_every_process_of_one_server_shares_its_notes_and_no_other_server_sees_them(tmp: Path) -> None:
    api_server = RefusalNotes.for_server(_config("e1", dp_size=2, dp_rank=0))
    rank1 = RefusalNotes.for_server(_config("e1_dp1", dp_size=2, dp_rank=1))  # vLLM's id on DP rank 1
    rank1.write("k", REFUSAL)
    assert api_server.read("k") == REFUSAL
    assert api_server.directory == tmp / f"pdconnect-{os.getuid()}" / "refusals" / "e1"
    assert RefusalNotes.for_server(_config("e2")).read("k") is None
    assert api_server.read("other") is None
    rank1.write("k", "newer")  # a later verdict replaces the note
    assert api_server.read("k") == "newer"


def test_notes_are_off_where_another_user_may_write(tmp: Path) -> None:
    root = tmp / f"pdconnect-{os.getuid()}"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    notes = RefusalNotes.for_server(_config("e1"))
    assert notes.directory is None
    notes.write("k", REFUSAL)  # never raises
    assert notes.read("k") is None and not (root / "refusals").exists()


def _vllm(status: int) -> Any:
    """Stands in for vLLM's app behind the guard: answers `status` with vLLM's error body."""

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        body = json.dumps({"error": {"message": "Internal server error", "type": "InternalServerError"}}).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:]})

    return app


def _post(status: int, params: dict[str, Any], vllm: Any = None, path: str = "/v1/completions") -> httpx.Response:
    guard = TransferParamsGuard(vllm or _vllm(status))
    server = SimpleNamespace(state=SimpleNamespace(vllm_config=_config("e1")))

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await guard({**scope, "app": server}, receive, send)  # Starlette puts its app in the scope

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            return await client.post(path, json={"prompt": "hi", "kv_transfer_params": params})

    return asyncio.run(go())


def test_a_500_for_a_noted_plan_names_the_refusal_and_nothing_else_changes(tmp: Path) -> None:
    assert _post(500, PLAN).json()["error"]["message"] == "Internal server error"  # no note yet
    RefusalNotes.for_server(_config("e1")).write(KEY, REFUSAL)
    response = _post(500, PLAN)
    assert response.status_code == 500
    assert response.json() == {
        "error": {"message": REFUSAL, "type": "IncompatibleEnginesError", "param": "kv_transfer_params", "code": 500}
    }
    assert _post(200, PLAN).json()["error"]["message"] == "Internal server error"  # only a 500 is replaced
    other = {**PLAN, "compat_hash": "e" * 16}  # another prefill digest: another note
    assert _post(500, other).json()["error"]["message"] == "Internal server error"


# vLLM 0.32/0.33's stream around a failed load: a first chunk, then its error event and [DONE].
CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
VLLM_ERROR_EVENT = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
    b'"code": 500}}\n\n'
)
DONE = b"data: [DONE]\n\n"


class VllmCut(Exception):
    """What vLLM 0.32/0.33 raise in a Responses stream whose request failed: their error
    event fails their own validation of Responses events (a pydantic ValidationError)."""


def _vllm_stream(bodies: list[bytes], cut: bool = False) -> Any:
    """Stands in for vLLM's app behind the guard: a 200 event stream, one body message per
    item, then its end or (`cut`) an exception."""

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for body in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        if cut:
            raise VllmCut("103 validation errors for union[ResponseCreatedEvent, ...]")
        await send({"type": "http.response.body", "body": b""})

    return app


def _stream(bodies: list[bytes], params: dict[str, Any], cut: bool = False, path: str = "/v1/completions") -> bytes:
    return _post(200, params, _vllm_stream(bodies, cut), path).content


def test_a_streams_error_event_for_a_noted_plan_names_the_refusal_and_no_other_byte_changes(tmp: Path) -> None:
    """Before, the event stayed vLLM's "Internal server error" (only whole 500s were replaced)."""
    stream = [CHUNK, VLLM_ERROR_EVENT, DONE]
    assert _stream(stream, PLAN) == b"".join(stream)  # no note yet: as vLLM wrote it
    RefusalNotes.for_server(_config("e1")).write(KEY, REFUSAL)
    named = (
        b'data: {"error":{"message":"group 0 block_size: prefill engine 64, this decode engine 128",'
        b'"type":"IncompatibleEnginesError","param":"kv_transfer_params","code":500}}\n\n'
    )
    assert _stream(stream, PLAN) == CHUNK + named + DONE
    # An event split over two body messages, or sharing one with its neighbours.
    assert _stream([CHUNK, VLLM_ERROR_EVENT[:30], VLLM_ERROR_EVENT[30:], DONE], PLAN) == CHUNK + named + DONE
    assert _stream([CHUNK + VLLM_ERROR_EVENT + DONE], PLAN) == CHUNK + named + DONE
    # An error of another code, and another plan's 500, stay vLLM's.
    bad_request = VLLM_ERROR_EVENT.replace(b'"code": 500', b'"code": 400')
    assert _stream([CHUNK, bad_request, DONE], PLAN) == CHUNK + bad_request + DONE
    assert _stream(stream, {**PLAN, "compat_hash": "e" * 16}) == b"".join(stream)


# The first events of vLLM 0.32's Responses stream (abridged), as `event: <type>` and data.
CREATED = (
    b'event: response.created\ndata: {"response":{"id":"resp_1","status":"in_progress"},'
    b'"sequence_number":0,"type":"response.created"}\n\n'
)
IN_PROGRESS = (
    b'event: response.in_progress\ndata: {"response":{"id":"resp_1","status":"in_progress"},'
    b'"sequence_number":1,"type":"response.in_progress"}\n\n'
)


def test_a_responses_stream_vllm_cut_for_a_noted_plan_ends_with_an_error_event_naming_the_refusal(tmp: Path) -> None:
    """Before, the exception went on to the server, which cut the stream with no terminal event."""
    stream = [CREATED, IN_PROGRESS]
    with pytest.raises(VllmCut):  # no note yet: vLLM's exception, as before
        _stream(stream, PLAN, cut=True, path="/v1/responses")
    RefusalNotes.for_server(_config("e1")).write(KEY, REFUSAL)
    named = (
        b'event: error\ndata: {"type":"error","code":"IncompatibleEnginesError",'
        b'"message":"group 0 block_size: prefill engine 64, this decode engine 128",'
        b'"param":"kv_transfer_params","sequence_number":2}\n\n'
    )
    assert _stream(stream, PLAN, cut=True, path="/v1/responses") == CREATED + IN_PROGRESS + named
    # A whole stream passes as vLLM wrote it; another plan's cut stream stays vLLM's exception.
    assert _stream(stream, PLAN, path="/v1/responses") == CREATED + IN_PROGRESS
    with pytest.raises(VllmCut):
        _stream(stream, {**PLAN, "compat_hash": "e" * 16}, cut=True, path="/v1/responses")


def test_a_chat_stream_cut_for_a_noted_plan_ends_with_vllms_error_event_naming_the_refusal_and_done(tmp: Path) -> None:
    RefusalNotes.for_server(_config("e1")).write(KEY, REFUSAL)
    named = (
        b'data: {"error":{"message":"group 0 block_size: prefill engine 64, this decode engine 128",'
        b'"type":"IncompatibleEnginesError","param":"kv_transfer_params","code":500}}\n\n'
    )
    assert _stream([CHUNK], PLAN, cut=True) == CHUNK + named + DONE


def test_a_models_text_cannot_forge_an_error_event_for_the_guard_or_the_router(tmp: Path) -> None:
    """A normal event whose text holds what begins an error or failure event: JSON escapes
    its quotes and newlines, so the guard passes it untouched (a note exists) and the router
    does not take the stream for a failed one."""
    RefusalNotes.for_server(_config("e1")).write(KEY, REFUSAL)
    text = 'x\n\ndata: {"error": {"code": 500}}\n\nevent: error\ndata: {}\n\nevent: response.failed\n'
    chunk = b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"
    delta = b"event: response.output_text.delta\ndata: " + json.dumps({"delta": text, "sequence_number": 2}).encode()
    delta += b"\n\n"
    assert _stream([chunk, DONE], PLAN) == chunk + DONE
    assert _stream([CREATED, delta], PLAN, path="/v1/responses") == CREATED + delta
    for label, event in (("completions", chunk), ("chat", chunk), ("responses", delta)):
        assert DIALECTS[label].failed.search(event) is None, label
    assert not ends_with_terminal_event(CREATED + delta)


def test_the_router_takes_the_engines_message_whole() -> None:
    long = "x" * 1500
    assert error_message(json.dumps({"error": {"message": long, "code": 500}}).encode()) == long
    assert error_message(b"<html>" + b"y" * 500) == "<html>" + "y" * 194
    assert error_message(b'{"error": "flat"}') == '{"error": "flat"}'


def test_a_workers_refusal_is_noted_where_its_servers_api_server_reads(tmp: Path) -> None:
    """An unequal-TP pairing that cannot work is refused in a worker (a process of its own
    at TP > 1); its note must land where the API server of the same server looks."""
    worker = _worker()
    spec = PullSpec("req-1", PLAN["remote_engine_id"], "tcp://10.0.0.5:5700", PLAN["compat_hash"])
    refused = worker._refused(spec, "group 0: 4 KV heads do not split over tp_size 3")
    assert str(refused) == "group 0: 4 KV heads do not split over tp_size 3"
    api_server = RefusalNotes.for_server(_config(worker.engine_id))
    assert api_server.read(KEY) == "group 0: 4 KV heads do not split over tp_size 3"


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _aged(path: Path, seconds: float) -> Path:
    past = time.time() - seconds
    os.utime(path, (past, past))
    return path


def test_a_deciding_process_clears_what_an_earlier_server_left_and_marks_its_directory(tmp: Path) -> None:
    """Before, notes were never removed."""
    notes = RefusalNotes.for_server(_config("e1"))
    notes.write("earlier", "an earlier server's verdict")
    assert notes.directory is not None
    _aged(notes.directory / "earlier", 10)
    (notes.directory / ".note-half").write_bytes(b"x")
    _aged(notes.directory / ".note-half", 10)
    gone = _dead_pid()
    (notes.directory / f".pid-{gone}").touch()

    deciding = RefusalNotes.for_server(_config("e1"), decides=True)  # an engine core or a worker
    assert sorted(p.name for p in notes.directory.iterdir()) == [f".pid-{os.getpid()}"]
    deciding.write(KEY, REFUSAL)
    assert notes.read(KEY) == REFUSAL and notes.read("earlier") is None


def test_other_servers_directories_go_whole_once_their_owners_are_gone(tmp: Path) -> None:
    refusals = tmp / f"pdconnect-{os.getuid()}" / "refusals"

    def server(name: str, owner: int | None, age: float) -> Path:
        directory = refusals / name
        directory.mkdir(parents=True)
        (directory / "k").write_text(REFUSAL)
        if owner is not None:
            (directory / f".pid-{owner}").touch()
        return _aged(directory, age)

    gone = _dead_pid()
    kept = {
        server("live", os.getpid(), 3600),
        server("just-made", gone, 1),  # its owner may not have marked it yet
        server("unmarked-recent", None, 3600),  # an older pdconnect's, maybe still serving
    }
    removed = {server("dead", gone, 3600), server("unmarked-old", None, 2 * 24 * 3600)}
    RefusalNotes.for_server(_config("e1"), decides=True)
    assert {p for p in refusals.iterdir() if p.name != "e1"} == kept
    assert not any(p.exists() for p in removed)


def test_the_cap_is_a_count_in_memory_and_no_write_lists_the_directory(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, each write listed the directory to count its notes."""
    notes = RefusalNotes.for_server(_config("e1"))
    monkeypatch.setattr(refusal_notes, "MAX_NOTES", 3)

    def no_listing(self: Path) -> Any:
        raise AssertionError(f"listed {self} on the refusal path")

    monkeypatch.setattr(Path, "iterdir", no_listing)
    for key in ("a", "b", "c", "d"):
        notes.write(key, REFUSAL)
    assert [notes.read(key) for key in ("a", "b", "c", "d")] == [REFUSAL, REFUSAL, REFUSAL, None]
    assert notes.directory is not None
    first = (notes.directory / "a").stat().st_ino
    notes.write("a", REFUSAL)  # a worker refuses each request of a pairing: the same words
    assert (notes.directory / "a").stat().st_ino == first, "the same words were written again"
    notes.write("a", "newer")  # a noted key's words may change past the cap
    assert notes.read("a") == "newer"
