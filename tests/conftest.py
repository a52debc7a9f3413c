"""Fixtures shared by several test modules (pytest finds them here; no module imports another's).

- `rendered_dir`, `renders`, `render_of`: deploy/'s kustomizations rendered with kubectl,
  once per module (test_deploy.py, test_images.py).
- `make`: starts routers in front of fake engines (`tests/router_support.py`) and closes
  them after the test (test_router_flow.py, test_router_edge.py).
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

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
        proc = subprocess.run([deploy_tool("kubectl"), "kustomize", str(DEPLOY / target)],
                              capture_output=True, text=True, timeout=120)
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


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Callable[..., Awaitable[Setup]]]:
    made: list[Setup] = []

    async def factory(prefill: int = 1, decode: int = 1, **options: Any) -> Setup:
        made.append(await start_setup(prefill, decode, **options))
        return made[-1]

    yield factory
    for s in made:
        await s.http.close()
        await s.router.close()
        await s.fakes.close()
