"""Client API keys the router checks itself, each with its own request and token rates.

Off unless `--api-keys-file PATH` or `--api-keys-env NAME` gives a keys document (JSON,
or TOML for a file ending in .toml):

    {"keys": [{"name": "team-a", "key": "sk-...", "requests_per_minute": 600,
               "tokens_per_minute": 200000, "default_max_tokens": 1024},
              {"name": "batch", "sha256": "<hex sha256 of the key>"}]}

`name` is what logs and errors show; the key itself (or only its SHA-256, so the
document need not hold the secret) is never logged. With keys on, every `/v1/` request
needs `Authorization: Bearer <key>`; otherwise 401 `invalid_api_key`. The presented key
is hashed and compared with every key's hash in constant time (`hmac.compare_digest`,
no early exit), so how long a refusal takes says nothing about the keys.

The engines keep their own keys (`vllm serve --api-key`): without keys here, the
client's `Authorization` goes on to them as always; with keys here, the client's key is
the router's, so the engines get `--engine-api-key-env`'s key when it is set (and the
client's header otherwise).
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from hmac import compare_digest
from pathlib import Path
from typing import Annotated

import msgspec

from pdconnect.errors import ConfigError
from pdconnect.router.errors import InvalidApiKey
from pdconnect.router.ratelimit import KeyLimits, request_cost
from pdconnect.router.request import Call

__all__ = ["ApiKeys", "ClientKey"]

_PositiveRate = Annotated[float, msgspec.Meta(gt=0)]


class _KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    key: Annotated[str, msgspec.Meta(min_length=16)] | None = None
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-fA-F]{64}$")] | None = None
    requests_per_minute: _PositiveRate | None = None
    tokens_per_minute: _PositiveRate | None = None
    default_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 1024


class _KeysDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keys: list[_KeyEntry]


@dataclass(frozen=True, eq=False)
class ClientKey:
    """One accepted key: its name, its limits, and the output a request without a limit counts."""

    name: str
    digest: bytes
    limits: KeyLimits
    default_max_tokens: int

    def charge(self, call: Call) -> None:
        """Take the request's tokens (`ratelimit.request_cost`); RateLimited (429) when over the rate."""
        self.limits.admit_tokens(request_cost(call, self.default_max_tokens))


class ApiKeys:
    """The accepted keys, and which one a request carries."""

    def __init__(self, keys: list[ClientKey]) -> None:
        if not keys:
            raise ConfigError("the API keys document holds no keys")
        self._keys = tuple(keys)
        # What the engines get instead of the client's Authorization (None: the client's).
        self.engine_authorization: str | None = None

    @classmethod
    def parse(
        cls,
        text: bytes,
        toml: bool,
        where: str,
        clock: Callable[[], float] | None = None,
        replicas: Callable[[], int] | None = None,
    ) -> ApiKeys:
        """Keys from a document; ConfigError names what is wrong, never a key. `replicas`: the
        router replicas counted (each keeps that share of every key's rates; `ratelimit`)."""
        try:
            data = tomllib.loads(text.decode()) if toml else msgspec.json.decode(text)
            document = msgspec.convert(data, _KeysDocument)
        except (tomllib.TOMLDecodeError, msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            # msgspec's messages name the field, not its value.
            raise ConfigError(f"API keys in {where}: {type(exc).__name__}: {_no_values(exc)}") from None
        keys: list[ClientKey] = []
        names: set[str] = set()
        for entry in document.keys:
            if (entry.key is None) == (entry.sha256 is None):
                raise ConfigError(f"API key {entry.name!r} in {where}: give exactly one of `key` and `sha256`")
            if entry.name in names:
                raise ConfigError(f"API key name {entry.name!r} appears twice in {where}")
            names.add(entry.name)
            digest = (
                hashlib.sha256(entry.key.encode()).digest()
                if entry.key is not None
                else bytes.fromhex(entry.sha256 or "")
            )
            limits = KeyLimits(entry.requests_per_minute, entry.tokens_per_minute, clock, replicas)
            keys.append(ClientKey(entry.name, digest, limits, entry.default_max_tokens))
        if len({key.digest for key in keys}) != len(keys):
            raise ConfigError(f"two API keys in {where} are the same key")
        return cls(keys)

    @classmethod
    def load(
        cls,
        path: str | None,
        env: str | None,
        engine_key_env: str | None = None,
        replicas: Callable[[], int] | None = None,
    ) -> ApiKeys | None:
        """The keys from `path` or from environment variable `env` (and the engines' key from
        `engine_key_env`), read once at start; None when neither is given. `replicas`: as in `parse`."""
        if path is not None and env is not None:
            raise ConfigError("give --api-keys-file or --api-keys-env, not both")
        if path is not None:
            try:
                text = Path(path).read_bytes()
            except OSError as exc:
                raise ConfigError(f"cannot read the API keys file {path}: {exc.strerror}") from None
            keys = cls.parse(text, path.endswith(".toml"), path, replicas=replicas)
        elif env is not None:
            keys = cls.parse(_env(env).encode(), False, f"${env}", replicas=replicas)
        else:
            if engine_key_env is not None:
                raise ConfigError("--engine-api-key-env goes with client keys (--api-keys-file or --api-keys-env)")
            return None
        if engine_key_env is not None:
            keys.engine_authorization = f"Bearer {_env(engine_key_env)}"
        return keys

    def admit(self, headers: Mapping[str, str]) -> ClientKey:
        """The request's key, one request taken from its rate: InvalidApiKey (401), RateLimited (429)."""
        key = self.identify(headers)
        key.limits.admit_request()
        return key

    def charge(self, key: ClientKey, call: Call) -> None:
        """Take the request's tokens from `key` (RateLimited, 429), and give the engines their
        own key (`--engine-api-key-env`) instead of the client's."""
        key.charge(call)
        if self.engine_authorization is not None:
            call.headers["Authorization"] = self.engine_authorization

    def identify(self, headers: Mapping[str, str]) -> ClientKey:
        """The key the request carries; InvalidApiKey (401) for none or an unknown one."""
        scheme, _, given = headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise InvalidApiKey("You didn't provide an API key: send 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(given.strip().encode("utf-8", "surrogateescape")).digest()
        found: ClientKey | None = None
        for key in self._keys:  # every key, no early exit: constant time in the match
            if compare_digest(digest, key.digest):
                found = key
        if found is None:
            raise InvalidApiKey("Incorrect API key provided.")
        return found


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"environment variable {name!r} is unset or empty")
    return value


def _no_values(exc: Exception) -> str:
    """An error's message without quoted values (a parse error may quote the line with a key)."""
    message = str(exc)
    return message.split(": ", 1)[0] if isinstance(exc, tomllib.TOMLDecodeError | msgspec.DecodeError) else message
