"""The router against FAKE engines, for the router's flow and edge tests: a `Setup`, request bodies, SSE parsing.

`start_setup` starts fake engines (`pdconnect.testbed.fake_engine`) and a router in front
of them; conftest.py's `make` fixture starts as many as a test asks for and closes them.
`router_process_with_fakes` runs both as processes of their own instead, for what must be
measured on the router alone (its memory, its event loop's answers); `start_router_process`
runs a router process before in-loop fakes (signals, several replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pdconnect.router import RouterConfig, RunningRouter, load_config, start_router
from pdconnect.testbed.fake_engine import FakeCluster, FakeEngine
from pdconnect.testbed.processes import Cluster, ManagedProcess, ProcessSpec, free_port
from pdconnect.testbed.recipes import fake_engine_server, router_argv, router_server
from tests.waiting import wait_until_async

__all__ = [
    "CHAT",
    "COMPLETION",
    "HANG",
    "ManualClock",
    "RouterProcess",
    "Setup",
    "peak_rss_bytes",
    "router_config_for",
    "router_process_with_fakes",
    "sse_events",
    "start_router_process",
    "start_setup",
]

HANG = 15.0  # seconds: far beyond any configured timeout; only a hang reaches it


@dataclass
class Setup:
    fakes: FakeCluster
    router: RunningRouter
    http: aiohttp.ClientSession

    @property
    def p(self) -> list[FakeEngine]:
        return self.fakes.prefill

    @property
    def d(self) -> list[FakeEngine]:
        return self.fakes.decode

    def count(self, name: str, **labels: str) -> float:
        value = self.router.router.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    async def post(self, path: str, body: dict[str, Any], **kw: Any) -> tuple[int, dict[str, str], bytes]:
        async with asyncio.timeout(HANG):
            async with self.http.post(self.router.url + path, json=body, **kw) as resp:
                return resp.status, dict(resp.headers), await resp.read()

    async def close(self) -> None:
        await self.http.close()
        await self.router.close()
        await self.fakes.close()


class ManualClock:
    """A clock that moves only when a test sets `now` (for breakers, buckets, windows)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router_config_for(fakes: FakeCluster, **options: Any) -> RouterConfig:
    """A router's config on 127.0.0.1 (a free port) in front of the FAKE engines, `options` over it."""
    return load_config(
        {"host": "127.0.0.1", "port": 0, "prefill": fakes.prefill_urls, "decode": fakes.decode_urls, **options}
    )


async def start_setup(prefill: int = 1, decode: int = 1, **options: Any) -> Setup:
    fakes = await FakeCluster.start(prefill, decode)
    short_timeouts = {
        "prefill_timeout": 1.0,
        "decode_first_byte_timeout": 1.0,
        "decode_timeout": 1.0,
        "stream_idle_timeout": 1.0,
        "connect_timeout": 0.5,
    }
    router = await start_router(router_config_for(fakes, **{**short_timeouts, **options}))
    return Setup(fakes, router, aiohttp.ClientSession())


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


COMPLETION = {"model": "fake-model", "prompt": "the quick brown fox jumps", "max_tokens": 4}
CHAT = {
    "model": "fake-model",
    "max_tokens": 4,
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
}


@contextlib.contextmanager
def router_process_with_fakes(
    log_dir: Path, router_args: Sequence[str] = (), fake_args: Sequence[str] = ()
) -> Iterator[ManagedProcess]:
    """`pdconnect router` in a process of its own before one FAKE prefill and one FAKE
    decode engine, each in a process of its own too; yields the router's process."""
    with Cluster(log_dir=log_dir) as cluster:

        def fake(name: str, *extra: str) -> ProcessSpec:
            return fake_engine_server(name, port=cluster.free_port(), args=(*extra, *fake_args))

        prefill, decode = cluster.launch(fake("fake-p0", "--side-channel"), fake("fake-d0"))
        [router] = cluster.launch(
            router_server(
                "router",
                port=cluster.free_port(),
                prefill=[prefill.base_url],
                decode=[decode.base_url],
                args=("--log-level", "warning", *router_args),
            )
        )
        yield router


def peak_rss_bytes(pid: int) -> int:
    """A process's peak resident memory so far (Linux: VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


@dataclass
class RouterProcess:
    """A `pdconnect router` process; the caller stops it (SIGTERM) or `kill()`s it."""

    process: asyncio.subprocess.Process
    url: str

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def start_router_process(fakes: FakeCluster, *args: str, port: int | None = None) -> RouterProcess:
    """`pdconnect router` in a process of its own before `fakes`, without health polls, once it answers /health."""
    port = port if port is not None else free_port()
    argv = router_argv(
        port=port,
        prefill=fakes.prefill_urls,
        decode=fakes.decode_urls,
        args=("--log-level", "warning", "--health-interval", "0", "--decode-first-byte-timeout", "30", *args),
        python=sys.executable,
    )
    process = await asyncio.create_subprocess_exec(*argv)
    url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        with contextlib.suppress(aiohttp.ClientError):
            async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as resp:
                return resp.status == 200
        return False

    await wait_until_async(healthy, f"router on {url} to answer /health", within=60)
    return RouterProcess(process, url)
