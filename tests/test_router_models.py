"""`/v1/models` through the router: every engine server's models, merged by id, against FAKE engines."""

from __future__ import annotations

import pytest

from tests.router_support import Setup

pytestmark = pytest.mark.asyncio


async def _models(s: Setup, **headers: str) -> tuple[int, dict]:
    async with s.http.get(s.router.url + "/v1/models", headers=headers) as resp:
        return resp.status, await resp.json()


async def test_models_of_every_engine_are_listed_once(make) -> None:
    s: Setup = await make(prefill=1, decode=2)
    s.d[1].model = "tiny-lora"
    status, answer = await _models(s)
    assert status == 200 and answer["object"] == "list"
    assert sorted(model["id"] for model in answer["data"]) == ["fake-model", "tiny-lora"]


async def test_an_engine_that_refuses_is_left_out_while_others_list(make) -> None:
    s: Setup = await make(prefill=1, decode=2)
    s.d[1].model = "tiny-lora"
    s.d[1].api_key = "only-d1-key"  # d1 refuses a client without its key
    status, answer = await _models(s)
    assert status == 200
    assert [model["id"] for model in answer["data"]] == ["fake-model"]


async def test_when_every_engine_refuses_the_refusal_is_relayed(make) -> None:
    s: Setup = await make()
    for fake in s.p + s.d:
        fake.api_key = "engine-key"
    status, answer = await _models(s)
    assert status == 401 and "error" in answer
