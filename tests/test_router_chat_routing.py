"""kv-aware routing of chat requests end to end: a router with `--tokenizer` (the tiny
generated model's directory) in front of FAKE engines, one of which reports through a
FAKE publisher (vLLM's own event classes) that it caches the chat's rendered prompt.

The ids that engine reports are transformers' `apply_chat_template` on the same
directory, not the router's own rendering. Requests the router cannot render (tools, a
template that raises) and text without a tokenizer are served by prefix affinity, and
each outcome is counted.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import pytest_asyncio
import zmq

from pdconnect.router import start_router
from pdconnect.testbed.fake_engine import FakeCluster
from pdconnect.testbed.tinymodel import TinyModelSpec, ensure_model
from tests.router_events_support import publish_until_applied
from tests.router_support import Setup, router_config_for
from tests.vllm_kv_events import encoded_batch, stored_blocks

pytest.importorskip("vllm.distributed.kv_events")
pytestmark = pytest.mark.asyncio

BS = 4
HANG = 15.0
CHAT: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 2,
    "messages": [
        {"role": "system", "content": "w1 w2 w3 w4 w5 w6 w7 w8"},
        {"role": "user", "content": "w9 w10 w11 w12 w13 w14 w15 w16"},
    ],
}


def _stored(tokens: list[int]) -> Any:
    """vLLM's BlockStored for every full block of `tokens`."""
    blocks = len(tokens) // BS
    return stored_blocks(range(blocks), tokens, block_size=BS, group=0, kind="full_attention")


@dataclass
class KvSetup(Setup):
    publishers: dict[str, Any]

    async def decode_engine(self, path: str, body: dict[str, Any]) -> str:
        async with asyncio.timeout(HANG), self.http.post(self.router.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["X-PDConnect-Decode"]

    async def publish(self, url: str, tokens: list[int]) -> None:
        """Until the router applied it: a SUB socket joins asynchronously."""
        await publish_until_applied(self.router, self.publishers[url], encoded_batch([_stored(tokens)]))


@pytest_asyncio.fixture
async def kv_router() -> AsyncIterator[Any]:
    made: list[KvSetup] = []
    context = zmq.Context()

    async def factory(**options: Any) -> KvSetup:
        fakes = await FakeCluster.start(prefill=1, decode=2)
        publishers = {url: context.socket(zmq.PUB) for url in fakes.decode_urls}
        endpoints = {
            url: [f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"] for url, sock in publishers.items()
        }
        router = await start_router(
            router_config_for(fakes, policy="kv-aware", kv_events_endpoints=endpoints, **options)
        )
        made.append(KvSetup(fakes, router, aiohttp.ClientSession(), publishers))
        return made[-1]

    yield factory
    for s in made:
        await s.close()
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return ensure_model(TinyModelSpec(kind="hybrid-llama"))


def _transformers_ids(directory: Path, messages: list[dict[str, Any]]) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    return list(ids)


@pytest.mark.parametrize("tokenized", ["inline", "worker-thread"])
async def test_chat_is_routed_to_the_engine_that_caches_its_rendered_prompt(
    kv_router, tiny_dir: Path, tokenized: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if tokenized == "worker-thread":  # as a long prompt is, off the event loop
        monkeypatch.setattr("pdconnect.router.tokenizing._INLINE_PROMPT_BYTES", 0)
    s: KvSetup = await kv_router(tokenizer=str(tiny_dir))
    by_affinity = await s.decode_engine("/v1/chat/completions", CHAT)
    assert await s.decode_engine("/v1/chat/completions", CHAT) == by_affinity
    other = next(url for url in s.fakes.decode_urls if url != by_affinity)
    await s.publish(other, _transformers_ids(tiny_dir, CHAT["messages"]))
    assert await s.decode_engine("/v1/chat/completions", CHAT) == other
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="chat", result="ok") == 3


async def test_chat_the_router_cannot_render_is_served_by_affinity_and_counted(
    kv_router, tiny_dir: Path, tmp_path: Path
) -> None:
    raising = tmp_path / "raising"
    shutil.copytree(tiny_dir, raising, ignore=shutil.ignore_patterns("*.safetensors"))
    (raising / "chat_template.jinja").write_text("{{ raise_exception('this template refuses everything') }}")
    s: KvSetup = await kv_router(tokenizer=str(raising))
    tools = {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    for body in (CHAT, tools):
        by_affinity = await s.decode_engine("/v1/chat/completions", body)
        assert await s.decode_engine("/v1/chat/completions", body) == by_affinity
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="chat", result="template_error") == 2
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="chat", result="unsupported_request") == 2
    # Both reached the engines unchanged: the engine renders (and refuses) for itself.
    decode_bodies = [seen.body for engine in s.fakes.decode for seen in engine.seen]
    assert sum("tools" in b for b in decode_bodies) == 2


async def test_without_a_tokenizer_text_and_chat_are_served_by_affinity_and_counted(kv_router) -> None:
    s: KvSetup = await kv_router()
    completion = {"model": "tiny", "prompt": "w1 w2 w3 w4 w5 w6 w7 w8", "max_tokens": 2}
    await s.decode_engine("/v1/completions", completion)
    await s.decode_engine("/v1/completions", {**completion, "prompt": list(range(10, 20))})
    await s.decode_engine("/v1/chat/completions", CHAT)
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="completions", result="no_tokenizer") == 1
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="completions", result="ok") == 1
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="chat", result="no_tokenizer") == 1


async def test_a_tokenizer_file_routes_text_and_leaves_chat_to_affinity(kv_router, tiny_dir: Path) -> None:
    s: KvSetup = await kv_router(tokenizer=str(tiny_dir / "tokenizer.json"))
    completion = {"model": "tiny", "prompt": "w1 w2 w3 w4 w5 w6 w7 w8", "max_tokens": 2}
    by_affinity = await s.decode_engine("/v1/completions", completion)
    other = next(url for url in s.fakes.decode_urls if url != by_affinity)
    from tokenizers import Tokenizer

    await s.publish(other, Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode(completion["prompt"]).ids)
    assert await s.decode_engine("/v1/completions", completion) == other
    await s.decode_engine("/v1/chat/completions", CHAT)
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="chat", result="no_chat_template") == 1
    assert json.loads(json.dumps(CHAT)) == CHAT  # the module's body was not modified by the router


# A template that does some work per message, as real ones do (tool and role checks).
_CHECKING_TEMPLATE = (
    "{% for message in messages %}{% for check in range(60) %}"
    "{% if message['role'] == 'tool' and check == loop.index %}{{ raise_exception('no tools') }}{% endif %}"
    "{% endfor %}{{ message['role'] }}: {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _readiness_timeout() -> float:
    """The deadline deploy/ gives the router's /health (its readiness probe)."""
    import yaml

    manifest = Path(__file__).resolve().parents[1] / "deploy" / "base" / "router.yaml"
    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc and doc.get("kind") == "Deployment":
            [container] = doc["spec"]["template"]["spec"]["containers"]
            return float(container["readinessProbe"]["timeoutSeconds"])
    raise AssertionError("no router Deployment in deploy/base/router.yaml")


async def test_a_chat_of_many_tiny_messages_leaves_health_answered_within_its_probe_deadline(
    kv_router, tiny_dir: Path, tmp_path: Path
) -> None:
    """Rendering scales with the messages: a body of the largest size the router takes
    (4 MiB), all tiny messages, renders for seconds. It must not keep the loop from
    answering anyone else: /health, polled meanwhile, answers within the readiness
    probe's deadline, and the chat request is still routed by its token ids."""
    checking = tmp_path / "checking"
    shutil.copytree(tiny_dir, checking, ignore=shutil.ignore_patterns("*.safetensors"))
    (checking / "chat_template.jinja").write_text(_CHECKING_TEMPLATE)
    s: KvSetup = await kv_router(tokenizer=str(checking))
    body = msgspec.json.encode(
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "w"}] * 130_000}
    )
    assert len(body) <= 4 << 20
    deadline = _readiness_timeout()
    waits: list[float] = []
    loop = asyncio.get_running_loop()

    async def chat() -> int:
        async with (
            asyncio.timeout(60),
            s.http.post(
                s.router.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            ) as resp,
        ):
            return resp.status

    request = asyncio.create_task(chat())
    async with asyncio.timeout(60):
        due = loop.time()
        while not request.done():
            # The client shares the router's loop: a stalled loop delays the probe's send
            # as much as its answer, so each wait counts from when the probe was due.
            async with s.http.get(s.router.url + "/health") as resp:
                assert resp.status == 200
            waits.append(loop.time() - due)
            due = loop.time() + 0.05
            await asyncio.sleep(0.05)
    assert await request == 200
    assert s.count("pdconnect_router_kv_aware_prompts_total", endpoint="chat", result="ok") == 1
    assert max(waits) < deadline, f"/health waited {max(waits):.1f}s (deadline {deadline}s)"


class _Counted(list[Any]):
    """A list that counts how many of its items were looked at."""

    seen = 0

    def __iter__(self) -> Any:
        for item in super().__iter__():
            _Counted.seen += 1
            yield item


def test_the_affinity_key_of_a_chat_reads_only_its_prefix_worth_of_messages_and_parts() -> None:
    """The key hashes the first `affinity_prefix_chars` of the rendered messages: however
    many messages, or content parts in one message, a body holds, only that much is read."""
    from pdconnect.router.policy import affinity_key

    for messages in (
        _Counted([{"role": "user", "content": ""}] * 1_000_000),
        [{"role": "user", "content": _Counted([{"type": "text", "text": ""}] * 1_000_000)}],
    ):
        _Counted.seen = 0
        assert affinity_key({"messages": messages}, chat=True, prefix_chars=1024, prefix_tokens=256) is not None
        assert _Counted.seen <= 1024
