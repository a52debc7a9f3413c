"""Fixtures shared by several test modules (pytest finds them here; no module imports another's).

- `rendered_dir`, `renders`, `render_of`: deploy/'s kustomizations rendered with kubectl,
  once per module (test_deploy.py, test_images.py).
- `make`: starts routers in front of fake engines (`tests/router_support.py`) and closes
  them after the test (test_router_flow.py, test_router_edge.py).
- `cluster`, `http`: a real-engine module's processes (stopped at its end) and its HTTP
  client (test_connector_engines.py, test_tp_engines.py, test_decode_first_engines.py).

Every process the tests start (vLLM engines through our plugin, spawned SimEngines) runs
the stall watch (`pdconnect.stallwatch`): a process whose Python stops running for
`STALL_WATCH_TEST_SECONDS` writes every thread's stack and CPU use to its log. A failed
test's report gets those records from the engine logs written while it ran, so a stall in
CI names what waited on what (the spawned children's stderr is already in the report).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from pdconnect.bench.scrape import engine_client
from pdconnect.stallwatch import STALL_WATCH_ENV, records_in
from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S
from pdconnect.testbed.paths import default_build_dir
from pdconnect.testbed.processes import Cluster
from tests.deploy_support import DEPLOY, TARGETS, Render, deploy_tool
from tests.router_support import Setup, start_setup


@pytest.fixture(scope="module")
def rendered_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rendered")


@pytest.fixture(scope="module")
def renders(rendered_dir: Path) -> dict[str, str | Exception]:
    """Target -> rendered YAML text, or the error kustomize gave."""
    out: dict[str, str | Exception] = {}
    for target in TARGETS:
        proc = subprocess.run(
            [deploy_tool("kubectl"), "kustomize", str(DEPLOY / target)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            out[target] = RuntimeError(proc.stderr.strip())
            continue
        out[target] = proc.stdout
        (rendered_dir / f"{target.replace('/', '__')}.yaml").write_text(proc.stdout)
    return out


@pytest.fixture(scope="module")
def render_of(renders: dict[str, str | Exception]):
    """target -> Render, parsed once. Tests must not modify what they get."""
    cache: dict[str, Render] = {}

    def get(target: str) -> Render:
        text = renders[target]
        if isinstance(text, Exception):
            pytest.fail(f"{target} does not render: {text}")
        if target not in cache:
            cache[target] = Render(target, text)
        return cache[target]

    return get


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as running:
        yield running


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with engine_client(REQUEST_TIMEOUT_S) as client:
        yield client


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Callable[..., Awaitable[Setup]]]:
    made: list[Setup] = []

    async def factory(prefill: int = 1, decode: int = 1, **options: Any) -> Setup:
        made.append(await start_setup(prefill, decode, **options))
        return made[-1]

    yield factory
    for s in made:
        await s.close()


# Long enough that a loaded 2-core host's ordinary hiccups stay quiet; the stalls that
# failed tests lasted 7-40 s. Set for the children only: nothing starts one in pytest itself.
STALL_WATCH_TEST_SECONDS = "3"
os.environ.setdefault(STALL_WATCH_ENV, STALL_WATCH_TEST_SECONDS)
# How much of one log's stall records a failed test's report carries.
_RECORD_LINES = 400


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.failed and call.when in ("setup", "call"):
        logs = default_build_dir() / "logs"
        began = call.start - 5.0  # a log written just before the call began belongs to it too
        for log in sorted(logs.glob("*.log")) if logs.is_dir() else ():
            try:
                if log.stat().st_mtime < began:
                    continue
                records = records_in(log.read_text(errors="replace"))
            except OSError:
                continue
            if records:
                report.sections.append((f"stall watch: {log.name}", "\n".join(records[-_RECORD_LINES:])))
    return report
