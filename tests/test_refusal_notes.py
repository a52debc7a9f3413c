"""The refusal notes an engine leaves for its API server, and the error its client then reads, without engines.

The engine-level proof is tests/test_compat_engines.py (two real engines whose block
sizes differ, with `pdconnect router` in front); these pin the parts: where the notes
live and who may write there, which note a request's plan reads, that only a 500 is
replaced and only when a note exists, and the line the router takes from an engine's error.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import MutableMapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from connectors.api_guard import TransferParamsGuard
from connectors.metadata import PullSpec
from connectors.refusal_notes import RefusalNotes, notes_key
from pdconnect.router.engine_errors import error_message
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


def _post(status: int, params: dict[str, Any]) -> httpx.Response:
    guard = TransferParamsGuard(_vllm(status))
    server = SimpleNamespace(state=SimpleNamespace(vllm_config=_config("e1")))

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await guard({**scope, "app": server}, receive, send)  # Starlette puts its app in the scope

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            return await client.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": params})

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
