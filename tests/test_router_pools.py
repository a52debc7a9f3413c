"""Several model pools behind one router, chosen by the body's `model`, against FAKE engines:
each request reaches only its pool's engines, an unknown model is a 404 `model_not_found`,
`/v1/models` lists every pool's models, and one pool stays the router it always was."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from pdconnect.router import RunningRouter, load_config, parse_args, start_router
from pdconnect.testbed.fake_engine import FakeCluster
from tests.router_support import CHAT, COMPLETION, Setup


@dataclass
class TwoPools:
    a: FakeCluster  # serves "model-a" (the top-level engines)
    b: FakeCluster  # serves "model-b" and "model-b-lora" (a --pool)
    router: RunningRouter
    http: aiohttp.ClientSession

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with self.http.post(self.router.url + path, json=body) as resp:
            return resp.status, json.loads(await resp.read())

    async def close(self) -> None:
        await self.http.close()
        await self.router.close()
        await self.a.close()
        await self.b.close()


@pytest_asyncio.fixture
async def two_pools() -> AsyncIterator[Callable[..., Awaitable[TwoPools]]]:
    made: list[TwoPools] = []

    async def start(**options: Any) -> TwoPools:
        a, b = await FakeCluster.start(1, 1), await FakeCluster.start(1, 2)
        for fake in a.prefill + a.decode:
            fake.model = "model-a"
        for fake in b.prefill + b.decode:
            fake.model = "model-b"
        pool = f"model=model-b,model=model-b-lora,prefill={b.prefill_urls[0]}"
        pool += "".join(f",decode={url}" for url in b.decode_urls)
        argv = ["--host", "127.0.0.1", "--port", "0", "--prefill", *a.prefill_urls, "--decode", *a.decode_urls]
        config = parse_args([*argv, "--models", "model-a", "--pool", pool])
        router = await start_router(load_config({**_fields(config), **options}))
        made.append(TwoPools(a, b, router, aiohttp.ClientSession()))
        return made[-1]

    yield start
    for setup in made:
        await setup.close()


def _fields(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__struct_fields__}


def _served(cluster: FakeCluster) -> int:
    return sum(len(fake.seen) for fake in cluster.prefill + cluster.decode)


@pytest.mark.asyncio
async def test_each_model_is_served_by_its_own_pools_engines_only_FAKE(two_pools) -> None:
    s: TwoPools = await two_pools()
    for _ in range(3):
        assert (await s.post("/v1/completions", {**COMPLETION, "model": "model-b"}))[0] == 200
    assert (await s.post("/v1/chat/completions", {**CHAT, "model": "model-b-lora"}))[0] == 200
    assert _served(s.a) == 0 and len(s.b.prefill[0].seen) == 4  # P/D in pool b: prefill then decode
    assert sum(len(fake.seen) for fake in s.b.decode) == 4
    assert (await s.post("/v1/completions", {**COMPLETION, "model": "model-a"}))[0] == 200
    assert len(s.a.prefill[0].seen) == len(s.a.decode[0].seen) == 1 and _served(s.b) == 8


@pytest.mark.asyncio
async def test_a_model_no_pool_serves_is_a_404_model_not_found_FAKE(two_pools) -> None:
    s: TwoPools = await two_pools()
    status, answer = await s.post("/v1/completions", {**COMPLETION, "model": "gpt-4o"})
    assert status == 404
    assert answer["error"] == {
        "message": "The model `gpt-4o` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert _served(s.a) == _served(s.b) == 0


@pytest.mark.asyncio
async def test_without_a_model_several_pools_cannot_choose_FAKE(two_pools) -> None:
    s: TwoPools = await two_pools()
    body = {key: value for key, value in COMPLETION.items() if key != "model"}
    status, answer = await s.post("/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "model"
    assert answer["error"]["code"] == "missing_required_parameter"


@pytest.mark.asyncio
async def test_models_lists_every_pools_models_FAKE(two_pools) -> None:
    s: TwoPools = await two_pools()
    async with s.http.get(s.router.url + "/v1/models") as resp:
        listed = sorted(model["id"] for model in (await resp.json())["data"])
    assert listed == ["model-a", "model-b"]


@pytest.mark.asyncio
async def test_one_pool_leaves_the_model_to_the_engines_unless_it_names_its_models_FAKE(make) -> None:
    unnamed: Setup = await make()
    status, _, _ = await unnamed.post("/v1/completions", {**COMPLETION, "model": "anything"})
    assert status == 200 and unnamed.d[0].seen[0].body["model"] == "anything"  # as before pools
    named: Setup = await make(models=["fake-model"])
    assert (await named.post("/v1/completions", COMPLETION))[0] == 200
    status, _, raw = await named.post("/v1/completions", {**COMPLETION, "model": "other"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


def test_pools_from_a_config_file_equal_the_command_line(tmp_path: Any) -> None:
    path = tmp_path / "router.toml"
    path.write_text('[[pools]]\nmodels = ["m"]\nprefill = ["http://p:1"]\ndecode = ["http://d:1"]\n')
    from_file = parse_args(["--config", str(path)])
    assert from_file.pools == parse_args(["--pool", "model=m,prefill=http://p:1,decode=http://d:1"]).pools


@pytest.mark.asyncio
async def test_a_pool_found_through_dns_serves_its_model_only_FAKE() -> None:
    a, b = await FakeCluster.start(1, 1), await FakeCluster.start(1, 1)
    names = {"b-prefill.test": b.prefill[0].url, "b-decode.test": b.decode[0].url}

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"] if names[host].endswith(f":{port}") else []

    port = {host: url.rpartition(":")[2] for host, url in names.items()}
    pool = f"model=model-b,prefill-dns=b-prefill.test:{port['b-prefill.test']}"
    pool += f",decode-dns=b-decode.test:{port['b-decode.test']}"
    argv = ["--host", "127.0.0.1", "--port", "0", "--prefill", *a.prefill_urls, "--decode", *a.decode_urls]
    router = await start_router(parse_args([*argv, "--models", "model-a", "--pool", pool]), resolver=resolver)
    try:
        async with aiohttp.ClientSession() as http:
            for model in ("model-b", "model-b", "model-a"):
                async with http.post(router.url + "/v1/completions", json={**COMPLETION, "model": model}) as resp:
                    assert resp.status == 200, await resp.text()
        assert len(b.prefill[0].seen) == len(b.decode[0].seen) == 2
        assert len(a.prefill[0].seen) == len(a.decode[0].seen) == 1
    finally:
        await router.close()
        await a.close()
        await b.close()
