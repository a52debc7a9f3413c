"""Client API keys and per-key rates, checked by the router against FAKE engines: 401
`invalid_api_key` without a known key, 429 with `Retry-After` over a key's request or token
rate (other keys unaffected), the engines' own keys still reaching them, keys never logged;
and the token bucket's arithmetic on a clock the test moves."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pdconnect.router import ConfigError
from pdconnect.router.apikeys import ApiKeys
from pdconnect.router.errors import BadRequest, RateLimited
from pdconnect.router.ratelimit import KeyLimits, TokenBucket
from tests.router_support import CHAT, COMPLETION, ManualClock, Setup

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"
ENGINE_KEY = "engine-secret-key"


def _keys_file(tmp_path: Path, **limits: Any) -> str:
    path = tmp_path / "keys.json"
    keys = [{"name": "team-a", "key": KEY_A, **limits}, {"name": "team-b", "key": KEY_B}]
    path.write_text(json.dumps({"keys": keys}))
    return str(path)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.asyncio
@pytest.mark.parametrize("authorization", [None, "Bearer sk-not-a-key-0123456789", f"Basic {KEY_A}", "Bearer "])
async def test_a_request_without_a_known_key_is_a_401_invalid_api_key_FAKE(
    make, tmp_path: Path, authorization: str | None
) -> None:
    s: Setup = await make(api_keys_file=_keys_file(tmp_path))
    headers = {"Authorization": authorization} if authorization else {}
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        status, _, raw = await s.post(path, body, headers=headers)
        assert status == 401
        error = json.loads(raw)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    async with s.http.get(s.router.url + "/v1/models", headers=headers) as resp:
        assert resp.status == 401
    assert s.p[0].seen == [] and s.d[0].seen == []
    assert s.count("pdconnect_router_requests_total", endpoint="chat", outcome="unauthorized") == 1
    async with s.http.get(s.router.url + "/health") as resp:
        assert resp.status == 200  # probes carry no key


@pytest.mark.asyncio
async def test_a_known_key_is_served_and_the_engines_get_the_clients_header_FAKE(make, tmp_path: Path) -> None:
    s: Setup = await make(api_keys_file=_keys_file(tmp_path))
    status, _, _ = await s.post("/v1/completions", COMPLETION, headers=_bearer(KEY_B))
    assert status == 200
    async with s.http.get(s.router.url + "/v1/models", headers=_bearer(KEY_A)) as resp:
        assert resp.status == 200


@pytest.mark.asyncio
async def test_engines_started_with_their_own_key_get_it_instead_of_the_clients_FAKE(
    make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCONNECT_TEST_ENGINE_KEY", ENGINE_KEY)
    s: Setup = await make(api_keys_file=_keys_file(tmp_path), engine_api_key_env="PDCONNECT_TEST_ENGINE_KEY")
    for fake in s.p + s.d:
        fake.api_key = ENGINE_KEY  # `vllm serve --api-key`: 401 for anything else
    status, _, raw = await s.post("/v1/responses", {"model": "fake-model", "input": "hi there"}, headers=_bearer(KEY_A))
    assert status == 200, raw
    async with s.http.get(s.router.url + "/v1/models", headers=_bearer(KEY_A)) as resp:
        assert resp.status == 200
    assert len(s.p[0].seen) == len(s.d[0].seen) == 1


@pytest.mark.asyncio
async def test_a_key_over_its_request_rate_gets_429_with_retry_after_and_others_do_not_FAKE(
    make, tmp_path: Path
) -> None:
    s: Setup = await make(api_keys_file=_keys_file(tmp_path, requests_per_minute=2))
    for _ in range(2):
        assert (await s.post("/v1/completions", COMPLETION, headers=_bearer(KEY_A)))[0] == 200
    status, headers, raw = await s.post("/v1/completions", COMPLETION, headers=_bearer(KEY_A))
    assert status == 429
    # Two a minute: the next one is about 30 s away (less the moments this test took).
    assert 1 <= int(headers["Retry-After"]) <= 30
    error = json.loads(raw)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert (await s.post("/v1/completions", COMPLETION, headers=_bearer(KEY_B)))[0] == 200
    assert len(s.d[0].seen) == 3
    assert s.count("pdconnect_router_requests_total", endpoint="completions", outcome="rate_limited") == 1


@pytest.mark.asyncio
async def test_a_key_over_its_token_rate_gets_429_and_a_request_past_its_bucket_a_400_FAKE(
    make, tmp_path: Path
) -> None:
    s: Setup = await make(api_keys_file=_keys_file(tmp_path, tokens_per_minute=100))
    # Cost = the prompt's 10 token ids + max_tokens 60 = 70 of the 100 a minute.
    body = {"model": "fake-model", "prompt": list(range(10)), "max_tokens": 60}
    assert (await s.post("/v1/completions", body, headers=_bearer(KEY_A)))[0] == 200
    status, headers, raw = await s.post("/v1/completions", body, headers=_bearer(KEY_A))
    assert status == 429 and json.loads(raw)["error"]["type"] == "tokens"
    # 30 left, 70 needed, 100 a minute: 24 s.
    assert 1 <= int(headers["Retry-After"]) <= 24
    status, _, raw = await s.post("/v1/completions", {**body, "max_tokens": 500}, headers=_bearer(KEY_A))
    assert status == 400 and "tokens per minute" in json.loads(raw)["error"]["message"]
    assert len(s.d[0].seen) == 1


@pytest.mark.asyncio
async def test_keys_are_never_logged_FAKE(make, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    # pdconnect's own level too: a vLLM module imported earlier in the run may have set it.
    caplog.set_level(logging.DEBUG, logger="pdconnect")
    s: Setup = await make(api_keys_file=_keys_file(tmp_path, requests_per_minute=1))
    for key in (KEY_A, KEY_A, "sk-wrong-0123456789abcdef"):
        await s.post("/v1/chat/completions", CHAT, headers=_bearer(key))
    assert caplog.records  # the access log wrote lines
    assert not any(secret in caplog.text for secret in (KEY_A, KEY_B, "sk-wrong"))


def test_a_malformed_keys_document_is_refused_without_quoting_a_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'[[keys]]\nname = "a"\nkey = "{KEY_A}\n')  # unterminated string
    with pytest.raises(ConfigError) as refused:
        ApiKeys.load(str(path), None)
    assert KEY_A not in str(refused.value)
    with pytest.raises(ConfigError, match="exactly one of"):
        ApiKeys.parse(b'{"keys": [{"name": "a"}]}', False, "test")
    with pytest.raises(ConfigError, match="same key"):
        ApiKeys.parse(
            json.dumps({"keys": [{"name": "a", "key": KEY_A}, {"name": "b", "key": KEY_A}]}).encode(), False, "t"
        )


def test_a_key_given_as_its_sha256_is_accepted() -> None:
    import hashlib

    digest = hashlib.sha256(KEY_A.encode()).hexdigest()
    keys = ApiKeys.parse(json.dumps({"keys": [{"name": "a", "sha256": digest}]}).encode(), False, "test")
    assert keys.identify(_bearer(KEY_A)).name == "a"


def test_a_token_bucket_refills_at_its_rate_up_to_one_minutes_worth() -> None:
    clock = ManualClock()
    bucket = TokenBucket(60, clock)  # one a second
    assert bucket.take(60) == 0
    assert bucket.take(1) == pytest.approx(1.0)  # refused: a second away, nothing taken
    clock.now += 10
    assert bucket.take(10) == 0 and bucket.take(5) == pytest.approx(5.0)
    clock.now += 3600
    assert bucket.take(60) == 0 and bucket.take(1) > 0  # an hour idle still holds one minute


def test_retry_after_is_whole_seconds_rounded_up_and_a_refusal_takes_nothing() -> None:
    clock = ManualClock()
    limits = KeyLimits(requests_per_minute=None, tokens_per_minute=120, clock=clock)  # 2 a second
    limits.admit_tokens(119)
    with pytest.raises(RateLimited) as refused:
        limits.admit_tokens(4)  # 1 held, 3 short: 1.5 s
    assert refused.value.headers == {"Retry-After": "2"}
    clock.now += 1.5
    limits.admit_tokens(4)  # the refusal took nothing
    with pytest.raises(BadRequest):
        limits.admit_tokens(121)
