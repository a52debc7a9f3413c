"""Model pools: several sets of prefill and decode engines behind one router, chosen by the body's `model`.

A pool is the model names it serves and the engines it routes to. Engines stay in the
one registry (health, breakers, KV events and metrics are per engine, whatever its
pool); a pool knows its engines by the sources they were registered under: its static
URLs (source `pool:<name>`), its DNS names (`dns:<name:port>`), and, for the pool of the
top-level options, `static` and the admin API's `admin`. An engine listed in two pools
serves both.

Each pool orders its engines with policies of its own: a hash ring is built per engine
set, and one shared ring would be rebuilt whenever consecutive requests asked different
pools. `Pool.engines` hands out the same tuple while the pool's members stay the same, so
the ring is built once per membership change.

Without `pools` in the configuration the router has one pool holding every engine, and
the body's `model` is not read: exactly the single-pool router it always was (unless
`models` names what it serves, then an unknown model is a 404 there too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pdconnect.errors import ConfigError
from pdconnect.router.engines import Engine, EngineRegistry, Role
from pdconnect.router.errors import ClientError, ModelNotFound
from pdconnect.router.policy import RoutingPolicy

__all__ = [
    "TOP_LEVEL_SOURCES",
    "MissingModel",
    "Pool",
    "PoolConfig",
    "Pools",
    "build_pools",
    "check_pools",
    "pool_source",
]

# The sources of engines the top-level options (and the admin API) register.
TOP_LEVEL_SOURCES = ("static", "admin")


def pool_source(name: str) -> str:
    """The registry source of a named pool's static engines."""
    return f"pool:{name}"


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model pool (`pools`): the model names it serves and its engines, given like the
    top-level ones. On the command line: `--pool model=NAME,prefill=URL,decode=URL,...`
    (each key may repeat; also prefill-dns=, decode-dns=)."""

    models: tuple[str, ...]
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_dns: tuple[str, ...] = ()
    decode_dns: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.models[0]

    @classmethod
    def parse(cls, spec: str) -> dict[str, list[str]]:
        """`model=a,prefill=URL,decode=URL` -> the pool's options; ConfigError names the bad part."""
        values: dict[str, list[str]] = {}
        keys = {"model": "models", "prefill": "prefill", "decode": "decode"}
        keys |= {"prefill-dns": "prefill_dns", "decode-dns": "decode_dns"}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in keys or not value:
                raise ConfigError(
                    f"--pool takes model=NAME,prefill=URL,decode=URL (keys: {', '.join(keys)}), got {part!r}"
                )
            values.setdefault(keys[key], []).append(value)
        return values


def check_pools(pools: Sequence[PoolConfig], models: Sequence[str], top_level: bool, tokenizer: str | None) -> None:
    """Every pool names its models and has decode engines; no model is in two pools; the
    top-level engines name theirs when pools exist beside them. ConfigError otherwise."""
    if not pools:
        return
    if top_level and not models:
        raise ConfigError("with --pool, the top-level engines need --models (the names they serve)")
    if tokenizer is not None:
        raise ConfigError("--tokenizer is one model's: it cannot be used with several pools")
    seen: set[str] = set(models)
    for pool in pools:
        if not pool.models:
            raise ConfigError("every pool names its model (model=NAME)")
        if not (pool.decode or pool.decode_dns):
            raise ConfigError(f"pool {pool.name!r} has no decode engines (decode=URL or decode-dns=NAME:PORT)")
        for model in pool.models:
            if model in seen:
                raise ConfigError(f"model {model!r} is served by two pools")
            seen.add(model)


class MissingModel(ClientError):
    """Several pools, and the body names no model."""

    http_status = 400
    code = "missing_required_parameter"


class Pool:
    """One pool: its model names, its engines (by registry source; `sources` None: every
    engine), and its routing policies by role."""

    def __init__(
        self,
        name: str,
        models: Sequence[str],
        registry: EngineRegistry,
        sources: frozenset[str] | None,
        policies: dict[Role, RoutingPolicy],
    ) -> None:
        self.name = name
        self.models = tuple(models)
        self.policies = policies
        self._registry = registry
        self._sources = sources
        self._members: dict[Role, tuple[Engine, ...]] = dict.fromkeys(Role, ())

    def engines(self, role: Role) -> tuple[Engine, ...]:
        """The pool's engines of `role`: the same tuple object until its members change."""
        everything = self._registry.engines(role)
        sources = self._sources
        if sources is None:
            return everything
        # Filtered per request (membership can change without the registry's tuple changing:
        # an engine gains or loses a source), but the same object is handed out while equal.
        mine = tuple(engine for engine in everything if not sources.isdisjoint(engine.sources))
        if mine != self._members[role]:
            self._members[role] = mine
        return self._members[role]


class Pools:
    """The router's pools, and which one a request's `model` asks for."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        if not pools:
            raise ValueError("a router has at least one pool")
        self.pools = tuple(pools)
        self._by_model = {model: pool for pool in pools for model in pool.models}
        # With no model named anywhere, `model` is the engines' business (one pool, as before).
        self._checked = bool(self._by_model)

    def select(self, model: Any) -> Pool:
        """The pool serving `model`; ModelNotFound (404) for a name no pool serves."""
        if not self._checked:
            return self.pools[0]
        if model is None:
            if len(self.pools) == 1:
                return self.pools[0]
            raise MissingModel(
                f"this router serves several models ({', '.join(sorted(self._by_model))}): name one in `model`",
                param="model",
            )
        pool = self._by_model.get(model) if isinstance(model, str) else None
        if pool is None:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        return pool


def build_pools(
    registry: EngineRegistry,
    models: Sequence[str],
    named: Sequence[tuple[PoolConfig, Sequence[str]]],
    top_level_dns: Sequence[str],
    make_policy: Callable[[], RoutingPolicy],
) -> Pools:
    """The router's pools: the top-level engines' (when it has engines or there are no
    others), then each named pool, with its DNS sources (`dns:<target>`)."""

    def policies() -> dict[Role, RoutingPolicy]:  # each pool and role its own (a ring per engine set)
        return {role: make_policy() for role in Role}

    pools: list[Pool] = []
    if not named:
        pools.append(Pool("default", models, registry, None, policies()))
    elif models:
        pools.append(Pool(models[0], models, registry, frozenset((*TOP_LEVEL_SOURCES, *top_level_dns)), policies()))
    for config, dns in named:
        pools.append(
            Pool(config.name, config.models, registry, frozenset((pool_source(config.name), *dns)), policies())
        )
    return Pools(pools)
