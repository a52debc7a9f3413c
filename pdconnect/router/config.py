"""The router's settings: one typed, validated object built once from a config file and argv.

Precedence: built-in defaults < config file (`--config`, JSON or TOML, keys spelled as
the long options with `_` or `-`) < command-line options. Everything downstream reads
the resulting `RouterConfig`; nothing reads argv or the environment again, except the
side-channel secret, which `resolve_secret` reads once at start.
"""

from __future__ import annotations

import argparse
import logging
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from pdconnect.config_fields import AtLeastOne, Meta, Port, Seconds, check_bounds, check_values
from pdconnect.errors import ConfigError
from pdconnect.keyring import Keyring, SigningKey, TrustedKeys
from pdconnect.router.lookup import parse_groups
from pdconnect.router.pools import PoolConfig, check_pools

__all__ = ["ConfigError", "DnsTarget", "RouterConfig", "engine_origin", "load_config", "parse_args", "pool_dns_targets"]

logger = logging.getLogger("pdconnect.router.config")

Policy = Literal["kv-aware", "prefix-affinity", "least-loaded", "round-robin"]


class DnsTarget(msgspec.Struct, frozen=True):
    """A DNS name (e.g. a Kubernetes headless service) whose A/AAAA records are engines."""

    host: str
    port: int
    scheme: str = "http"

    @classmethod
    def parse(cls, text: str) -> DnsTarget:
        """`[http://]name:port` -> DnsTarget; ConfigError names the bad value."""
        scheme, sep, rest = text.partition("://")
        if not sep:
            scheme, rest = "http", text
        host, _, port = rest.rstrip("/").rpartition(":")
        if scheme not in ("http", "https") or not host or not port.isdigit():
            raise ConfigError(f"DNS target must look like [http://]name:port, got {text!r}")
        return cls(host=host.strip("[]"), port=int(port), scheme=scheme)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def _normalize_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def engine_origin(url: str) -> str:
    """`scheme://host:port` and nothing else (no path, query, fragment or credentials).

    An engine added at runtime receives prompts and clients' `Authorization` headers, and
    its `/v1/models` answer goes back to clients: a URL with a path or query would let an
    admin-API caller point the router at an arbitrary internal page.
    """
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"engine URL {url!r} is malformed: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
    if not parts.hostname or port is None:
        raise ConfigError(f"engine URL needs a host and a port, got {url!r}")
    if (
        parts.username is not None
        or parts.password is not None
        or parts.query
        or parts.fragment
        or parts.path not in ("", "/")
        or "?" in url
        or "#" in url
    ):
        raise ConfigError(f"engine URL must be scheme://host:port only, got {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every router option. Each field's own bounds are declared on its type (`Seconds`:
    positive, `AtLeastOne`, `Port`: `pdconnect.config_fields`); `__post_init__` checks
    them, and what involves several fields: at least one decode source, decode-first's
    needs."""

    host: str = "0.0.0.0"
    port: Port = 8000
    # Static engines, and DNS names re-resolved every `dns_interval` seconds.
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_dns: tuple[str, ...] = ()
    decode_dns: tuple[str, ...] = ()
    dns_interval: Seconds = 10.0
    # Data-parallel engines (`vllm serve --data-parallel-size N`: one API server, N engine
    # cores, each with its own KV cache): every engine of the role has this many ranks,
    # each routed to as a cache of its own and pinned with `X-data-parallel-rank`; its KV
    # events come from the event and replay ports offset by the rank, as vLLM binds them.
    prefill_dp_size: AtLeastOne = 1
    decode_dp_size: AtLeastOne = 1

    policy: Policy = "prefix-affinity"
    # The affinity key is a hash of the prompt's leading chunk: this many characters of
    # text (completions) or rendered messages (chat), or this many token ids.
    affinity_prefix_chars: AtLeastOne = 1024
    affinity_prefix_tokens: AtLeastOne = 256
    # Bounded-load consistent hashing: no engine takes more than this factor times the
    # mean in-flight load before its keys spill to the next engine on the ring. Lower
    # balances tighter and splits more sibling groups (64 groups, 4 engines, 32 in
    # flight: 1.25 keeps 72% of siblings together, 1.5 90%, 2.0 99%); a decode engine's
    # cache miss costs a full KV transfer, so the default leans to togetherness.
    affinity_load_factor: Annotated[float, Meta(ge=1, description="below 1 no assignment could satisfy the bound")] = (
        1.5
    )
    # ... but no engine counts as loaded below this many requests in flight: a decode
    # engine batches a burst of siblings for about the cost of one sequence, and each
    # sibling split off pays a full KV pull elsewhere (policy.LoadBound).
    affinity_min_load: AtLeastOne = 8
    affinity_vnodes: AtLeastOne = 160
    # kv-aware: engines publish vLLM KV events (--kv-events-config) on this port of their
    # own address, with a replay socket on the second port; or explicitly per engine URL
    # (config file: {"http://p0:8000": ["tcp://p0:5557", "tcp://p0:5558"]}).
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_endpoints: dict[str, list[str]] = {}
    # kv-aware: each engine's index holds at most this many blocks, all KV cache groups
    # together (about 260 bytes each, oldest evicted first), and no event frame may exceed this size.
    kv_index_max_blocks: AtLeastOne = 1 << 19
    kv_events_max_message_bytes: AtLeastOne = 8 << 20
    # kv-aware needs a request's token ids: the model's directory (tokenizer.json,
    # tokenizer_config.json, its chat template) for text and chat prompts, or a bare
    # tokenizer.json for text only; without it only token-id prompts route by real hits.
    tokenizer: str | None = None
    # Decode-first routing (kv-aware only, `decider.py`): a request whose decode engine
    # would compute at most this many of its prompt tokens itself (and at most this
    # share of the prompt) skips the prefill leg; local prefills in flight per decode
    # engine stay under the token bound. The engines' connectors describe their KV cache
    # groups in their KV events (`pdconnect.kvdescribe`); `kv_cache_groups` (`lookup.py`
    # syntax) is an optional override they must match, or their requests go P/D.
    decode_first: bool = False
    kv_cache_groups: str | None = None
    decode_first_max_uncached_tokens: int = 256
    decode_first_max_uncached_ratio: float = 1.0
    decode_first_max_tokens_in_flight: int = 512

    connect_timeout: Seconds = 2.0
    # Idle pooled connections to engines are closed after this many seconds: below the
    # engines' own keep-alive (vLLM's uvicorn closes after VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
    # 5 s by default), so a request is never sent on a connection the engine is closing.
    upstream_keepalive: Seconds = 4.0
    prefill_timeout: Seconds = 60.0
    # Streaming: until the decode engine's first chunk (includes its KV pull).
    decode_first_byte_timeout: Seconds = 60.0
    # Non-streaming: the whole decode; a timeout here is not retried.
    decode_timeout: Seconds = 600.0
    # Streaming: the longest silence between two chunks before the stream is cut.
    stream_idle_timeout: Seconds = 120.0
    prefill_attempts: AtLeastOne = 2
    decode_attempts: AtLeastOne = 2
    # After every prefill attempt failed: let a decode engine prefill locally.
    fallback: bool = True

    health_interval: Annotated[float, Meta(ge=0, description="0 turns active polling off")] = 5.0
    health_timeout: Seconds = 2.0
    # Consecutive failed polls before an engine counts as down.
    health_failures: AtLeastOne = 2
    # Consecutive failed requests that open an engine's circuit breaker, and how long
    # it stays open before one trial request may go through.
    breaker_failures: AtLeastOne = 3
    breaker_cooldown: Seconds = 10.0

    side_channel_secret_env: str | None = None
    # The prefill engines' public side-channel keys (`prefill:KEY` tokens), to check their answers.
    side_channel_peer_keys_env: str | None = None
    release_timeout: Seconds = 2.0
    # The client's body: at most this many bytes on the wire and once inflated (gzip,
    # deflate), all of it within this many seconds.
    max_body_bytes: AtLeastOne = 4 * 1024 * 1024
    body_read_timeout: Seconds = 30.0
    # What the router reads from engines: the prefill answer (it needs only its
    # kv_transfer_params and usage), a whole non-streaming decode answer (relayed), one
    # streamed event. Anything over its limit is dropped unread.
    max_prefill_answer_bytes: AtLeastOne = 16 * 1024 * 1024
    max_answer_bytes: AtLeastOne = 256 * 1024 * 1024
    max_event_bytes: AtLeastOne = 16 * 1024 * 1024
    # Each write to a client must complete within this many seconds: a client that
    # stops reading is dropped instead of holding its answer (and its engine) forever.
    client_write_timeout: Seconds = 30.0
    # A request's head (request line and headers) must arrive whole within this many
    # seconds of its first byte, on every request of a connection: a client trickling
    # header bytes would otherwise hold a connection (and a file descriptor) forever.
    # The wait for a request's first byte is the keep-alive below.
    header_read_timeout: Seconds = 10.0
    # A client connection idle this many seconds between requests is closed (aiohttp's
    # own default is an hour: idle clients would hold descriptors until the limit).
    client_keepalive: Seconds = 75.0
    # After SIGTERM the router stops accepting connections and lets requests in flight
    # finish for up to this many seconds; what is still running then is cut, and its
    # prefill hold released. The default matches the decode engines' --shutdown-timeout
    # (deploy/), so a rolling restart of the router cuts no stream decode would finish.
    drain_timeout: Seconds = 300.0
    # Admin endpoints (/admin/engines) exist only with a token, or when explicitly open;
    # with `admin_port` they are served only there (on `admin_host`, loopback by default).
    admin_token_env: str | None = None
    admin_open: bool = False
    admin_host: str = "127.0.0.1"
    admin_port: Port | None = None
    # /metrics only on this port (on `metrics_host`; None: the client address `host`), so
    # monitoring needs no access to the client port and clients none to the metrics.
    # None: /metrics is served on the client port.
    metrics_port: Port | None = None
    metrics_host: str | None = None
    # Name the chosen engines in response headers (x-pdconnect-prefill/-decode).
    route_headers: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # JSON lines carry the request and trace ids as fields; text puts the request id in
    # brackets (`pdconnect.router.logs`).
    log_format: Literal["text", "json"] = "text"
    # One line per request at its end: endpoint, status, outcome, route, engines, TTFT.
    access_log: bool = True
    # OTLP/HTTP endpoint for the router's spans (e.g. http://collector:4318/v1/traces);
    # needs the `otel` extra. None: no spans (the trace context is forwarded anyway).
    otlp_traces_endpoint: str | None = None
    # Several replicas over the same engines (`replicas.py`): the routers' URLs (each
    # replica's own among them), static or from a DNS name (their headless Service, on the
    # replica port). Each keeps 1/N of the engines' load floor and decode-first budget;
    # one that cannot count its peers counts `max_replicas`. The replica port takes the
    # peers' breaker notices. None of these: one router, whole bounds.
    replica_peers: tuple[str, ...] = ()
    replicas_dns: str | None = None
    max_replicas: Annotated[
        int, Meta(ge=1, description="what a replica counts while it cannot see its peers: the most it shares with")
    ] = 4
    replica_port: Port | None = None
    # The secret replicas sign breaker notices with (`replicas.NoticeSigner`), from a file or
    # an environment variable: needed, and shared by all, whenever replicas are configured.
    replica_secret_file: str | None = None
    replica_secret_env: str | None = None

    # Several model pools behind one router, chosen by the body's `model` (`pools.py`);
    # `models`: the names the top-level engines serve (with pools, or to refuse unknown
    # names with one pool). Neither: one pool, `model` left to the engines.
    models: tuple[str, ...] = ()
    pools: tuple[PoolConfig, ...] = ()
    # Client API keys checked by the router, each with its rates (`apikeys.py`): a JSON or
    # TOML document in a file, or JSON in an environment variable. None: no keys checked.
    api_keys_file: str | None = None
    api_keys_env: str | None = None
    # With client keys on: the key sent to the engines (`vllm serve --api-key`) instead of
    # the client's, from this environment variable.
    engine_api_key_env: str | None = None

    def __post_init__(self) -> None:
        check_bounds(self)
        top_level = bool(self.prefill or self.decode or self.prefill_dns or self.decode_dns)
        check_pools(self.pools, self.models, top_level, self.tokenizer)
        if self.policy == "kv-aware" and self.kv_events_port is None and not self.kv_events_endpoints:
            raise ConfigError("the kv-aware policy needs --kv-events-port (or kv_events_endpoints)")
        self._check_rank_ports()
        if self.decode_first:
            if self.policy != "kv-aware":
                raise ConfigError("decode_first needs the kv-aware policy (it reads the engines' KV events)")
            if self.decode_first_max_uncached_tokens < 1 or self.decode_first_max_tokens_in_flight < 1:
                raise ConfigError("decode_first token bounds must be >= 1")
            if not 0 < self.decode_first_max_uncached_ratio <= 1:
                raise ConfigError("decode_first_max_uncached_ratio must be in (0, 1]")
        if self.kv_cache_groups is not None:
            parse_groups(self.kv_cache_groups)
        if not (self.decode or self.decode_dns or self.pools):
            raise ConfigError("no decode engines: give --decode URL or --decode-dns NAME:PORT")
        for url in self.prefill + self.decode + tuple(u for pool in self.pools for u in pool.prefill + pool.decode):
            _normalize_url(url)
        for target in (
            self.prefill_dns
            + self.decode_dns
            + tuple(t for pool in self.pools for t in pool.prefill_dns + pool.decode_dns)
        ):
            DnsTarget.parse(target)
        if self.api_keys_file is not None and self.api_keys_env is not None:
            raise ConfigError("give --api-keys-file or --api-keys-env, not both")
        for url in self.replica_peers:
            engine_origin(url)  # scheme://host:port: notices go to /replicas/breaker there
        if self.replicas_dns is not None:
            DnsTarget.parse(self.replicas_dns)
        if (self.replica_peers or self.replicas_dns or self.replica_port) and (
            (self.replica_secret_file is None) == (self.replica_secret_env is None)
        ):
            raise ConfigError(
                "router replicas sign breaker notices: give --replica-secret-file or --replica-secret-env"
            )

    def _check_rank_ports(self) -> None:
        """A data-parallel engine's rank r publishes on `kv_events_port + r` and replays on
        `kv_events_replay_port + r` (vLLM's `offset_endpoint_port`): the two ranges must not meet."""
        ranks = max(self.prefill_dp_size, self.decode_dp_size)
        events, replay = self.kv_events_port, self.kv_events_replay_port
        if ranks > 1 and events is not None and replay is not None and abs(events - replay) < ranks:
            raise ConfigError(
                f"with {ranks} data-parallel ranks the KV events ports {events}.. and replay ports "
                f"{replay}.. overlap (rank r uses port + r): keep them at least {ranks} apart"
            )

    def dp_size(self, role: str) -> int:
        """Data-parallel ranks of every engine of `role` ("prefill" or "decode")."""
        return self.prefill_dp_size if role == "prefill" else self.decode_dp_size

    @property
    def prefill_urls(self) -> tuple[str, ...]:
        return tuple(_normalize_url(u) for u in self.prefill)

    @property
    def decode_urls(self) -> tuple[str, ...]:
        return tuple(_normalize_url(u) for u in self.decode)

    def dns_targets(self, role: str, pools: bool = False) -> tuple[DnsTarget, ...]:
        """The top-level DNS names of `role`'s engines (and every pool's, with `pools`), each once."""
        names = self.prefill_dns if role == "prefill" else self.decode_dns
        if pools:
            names += tuple(
                n for pool in self.pools for n in (pool.prefill_dns if role == "prefill" else pool.decode_dns)
            )
        return tuple(DnsTarget.parse(n) for n in dict.fromkeys(names))

    @property
    def replicas_target(self) -> DnsTarget | None:
        return DnsTarget.parse(self.replicas_dns) if self.replicas_dns is not None else None

    def resolve_secret(self) -> bytes | None:
        """The side-channel secret from the environment, read once at start."""
        return _read_env(self.side_channel_secret_env)

    def resolve_side_channel_keys(self) -> Keyring | None:
        """The router's side-channel keys (it signs as "router", believes "prefill"), read once
        at start; None without a secret. ConfigError for a short secret or missing peer keys."""
        secret = self.resolve_secret()
        peer_keys = _read_env(self.side_channel_peer_keys_env)
        if (secret is None) != (peer_keys is None):
            raise ConfigError("--side-channel-secret-env and --side-channel-peer-keys-env go together")
        if secret is None or peer_keys is None:
            return None
        return Keyring.checked(
            SigningKey(secret), TrustedKeys.parse(peer_keys.decode()), "router", frozenset({"prefill"})
        )

    def resolve_admin_token(self) -> str | None:
        value = _read_env(self.admin_token_env)
        return value.decode() if value is not None else None


def pool_dns_targets(pool: PoolConfig) -> tuple[DnsTarget, ...]:
    """A pool's DNS names, both roles."""
    return tuple(DnsTarget.parse(n) for n in pool.prefill_dns + pool.decode_dns)


def _read_env(name: str | None) -> bytes | None:
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"environment variable {name!r} is unset or empty")
    return value.encode()


def load_config(values: dict[str, Any]) -> RouterConfig:
    """Validate a mapping of options (file or argv); ConfigError names the bad key."""
    options: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        new = _RENAMED_KEYS.get(name)
        if new is not None:
            if new in values or new.replace("_", "-") in values:
                raise ConfigError(f"{name} is the deprecated name of {new}: give only {new}")
            logger.warning("router option %s is deprecated: it is now %s", name, new)
            name = new
        options[name] = value
    if "pools" in options and isinstance(options["pools"], list | tuple):
        # Given as --pool specs on the command line, as tables in a file.
        options["pools"] = [PoolConfig.parse(p) if isinstance(p, str) else p for p in options["pools"]]
    try:
        check_values(RouterConfig, options)  # before msgspec, whose own message names no value
        return msgspec.convert(options, RouterConfig)
    except (ConfigError, msgspec.ValidationError) as exc:
        raise ConfigError(f"invalid router configuration: {exc}") from None


def _read_file(path: str) -> dict[str, Any]:
    text = Path(path).read_bytes()
    try:
        data = tomllib.loads(text.decode()) if path.endswith(".toml") else msgspec.json.decode(text)
    except (tomllib.TOMLDecodeError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold an object of options")
    return data


def _default(name: str) -> Any:
    fields, defaults = RouterConfig.__struct_fields__, RouterConfig.__struct_defaults__
    return defaults[fields.index(name) - (len(fields) - len(defaults))]


# Options renamed: new flag -> the old one, still accepted (deploy manifests and scripts
# written before the rename). In a config file the old key is accepted the same way.
_RENAMED_FLAGS = {
    "decode-first": "decode-local",
    "decode-first-max-uncached-tokens": "decode-local-max-uncached-tokens",
    "decode-first-max-uncached-ratio": "decode-local-max-uncached-ratio",
    "decode-first-max-tokens-in-flight": "decode-local-max-tokens-in-flight",
}
_RENAMED_KEYS = {old.replace("-", "_"): new.replace("-", "_") for new, old in _RENAMED_FLAGS.items()}


def _add(group: Any, name: str, help: str, dest_name: str | None = None, **kw: Any) -> None:
    """One option whose help ends with its default, taken from RouterConfig (one source)."""
    dest = dest_name or name.replace("-", "_")
    default = _default(dest)
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif default in ((), None):
        shown = "none"
    else:
        shown = str(default)
    names = [f"--{name}"]
    old = _RENAMED_FLAGS.get(name)
    if old is not None:
        names.append(f"--{old}")
        help = f"{help}; --{old} is its deprecated name"
    group.add_argument(*names, dest=dest, help=f"{help} (default: {shown})", **kw)


def _parser() -> argparse.ArgumentParser:
    # SUPPRESS everywhere: only options actually given override the config file.
    p = argparse.ArgumentParser(
        prog="pdconnect router",
        argument_default=argparse.SUPPRESS,
        description="OpenAI-compatible prefill/decode router.",
    )
    p.add_argument(
        "--config",
        help="JSON or TOML file with any of the options below (keys spelled as the "
        "long options); options given here override it",
    )
    _add(p, "host", "address to serve on")
    _add(p, "port", "port to serve on", type=int)
    seconds: dict[str, Any] = {"type": float, "metavar": "SECONDS"}
    engines = p.add_argument_group("engines")
    _add(engines, "prefill", "prefill engine URLs", nargs="+", action="extend", metavar="URL")
    _add(engines, "decode", "decode engine URLs", nargs="+", action="extend", metavar="URL")
    _add(
        engines,
        "prefill-dns",
        "DNS names (headless service) of prefill engines, re-resolved every --dns-interval",
        nargs="+",
        action="extend",
        metavar="NAME:PORT",
    )
    _add(engines, "decode-dns", "DNS names of decode engines", nargs="+", action="extend", metavar="NAME:PORT")
    _add(engines, "dns-interval", "seconds between DNS re-resolutions", **seconds)
    _add(
        engines,
        "prefill-dp-size",
        "data-parallel ranks of every prefill engine (vllm --data-parallel-size); each is pinned by header",
        type=int,
    )
    _add(engines, "decode-dp-size", "data-parallel ranks of every decode engine", type=int)
    _add(
        engines,
        "models",
        "model names the engines above serve: a request naming another is refused (404), unless a --pool serves it",
        nargs="+",
        action="extend",
        metavar="NAME",
    )
    _add(
        engines,
        "pool",
        "another model pool, routed by the body's model: model=NAME,prefill=URL,decode=URL "
        "(keys repeat; also prefill-dns=, decode-dns=)",
        dest_name="pools",
        action="append",
        metavar="SPEC",
    )
    routing = p.add_argument_group("routing")
    _add(
        routing,
        "policy",
        "how a request's engines are chosen",
        choices=["kv-aware", "prefix-affinity", "least-loaded", "round-robin"],
    )
    _add(routing, "kv-events-port", "kv-aware: port of every engine's vLLM KV events publisher", type=int)
    _add(routing, "kv-events-replay-port", "kv-aware: port of every engine's KV events replay socket", type=int)
    _add(
        routing,
        "kv-index-max-blocks",
        "kv-aware: blocks each engine's index keeps, all KV cache groups together",
        type=int,
    )
    _add(routing, "kv-events-max-message-bytes", "kv-aware: largest KV event frame accepted", type=int)
    _add(
        routing,
        "tokenizer",
        "kv-aware: the model's directory (tokenizer.json, tokenizer_config.json, chat "
        "template) to turn text and chat prompts into the engine's token ids; a bare tokenizer.json serves "
        "text only; without it such prompts are placed by prefix affinity",
        metavar="PATH",
    )
    _add(
        routing,
        "decode-first",
        "kv-aware: a request whose decode engine already caches all but a few prompt tokens "
        "skips the prefill leg (decode prefills them itself)",
        action=argparse.BooleanOptionalAction,
    )
    _add(
        routing,
        "kv-cache-groups",
        "decode-first: the engines' KV cache groups, e.g. full:128:eagle,sliding:128:64:eagle "
        "(:eagle on the groups that take the EAGLE/MTP drop: every group under EAGLE, the "
        "drafter's group under MTP)",
        metavar="SPEC",
    )
    _add(
        routing,
        "decode-first-max-uncached-tokens",
        "decode-first: most prompt tokens a decode engine may compute itself for one request",
        type=int,
    )
    _add(
        routing,
        "decode-first-max-uncached-ratio",
        "decode-first: most share of a prompt a decode engine may compute itself",
        type=float,
    )
    _add(
        routing,
        "decode-first-max-tokens-in-flight",
        "decode-first: most local-prefill tokens in flight per decode engine; beyond it, P/D",
        type=int,
    )
    _add(routing, "affinity-prefix-chars", "characters of prompt text hashed for the affinity key", type=int)
    _add(routing, "affinity-prefix-tokens", "token ids hashed for the affinity key", type=int)
    _add(routing, "affinity-load-factor", "no engine takes more than this times the mean load", type=float)
    _add(
        routing,
        "affinity-min-load",
        "in-flight requests below which no engine counts as loaded (a burst of "
        "siblings stays on the engine that caches their prefix)",
        type=int,
    )
    _add(routing, "affinity-vnodes", "points per engine on the hash ring", type=int)
    flow = p.add_argument_group("request flow")
    _add(flow, "connect-timeout", "seconds to connect to an engine", **seconds)
    _add(
        flow,
        "upstream-keepalive",
        "seconds an idle engine connection is kept for reuse; below the engines' own keep-alive (vLLM: 5 s)",
        **seconds,
    )
    _add(flow, "prefill-timeout", "seconds for a whole prefill answer", **seconds)
    _add(flow, "decode-first-byte-timeout", "streams: seconds until decode's first chunk", **seconds)
    _add(flow, "decode-timeout", "non-streaming: seconds for the whole decode (not retried)", **seconds)
    _add(flow, "stream-idle-timeout", "streams: longest silence between chunks", **seconds)
    _add(flow, "release-timeout", "seconds for a side-channel release notice", **seconds)
    _add(flow, "prefill-attempts", "prefill engines tried per request", type=int)
    _add(flow, "decode-attempts", "decode engines tried per request", type=int)
    _add(
        flow, "fallback", "decode-only fallback when every prefill attempt fails", action=argparse.BooleanOptionalAction
    )
    _add(flow, "side-channel-secret-env", "environment variable holding the side-channel secret", metavar="NAME")
    _add(
        flow,
        "side-channel-peer-keys-env",
        "environment variable holding the prefill engines' public side-channel keys (prefill:KEY ...)",
        metavar="NAME",
    )
    _add(flow, "max-body-bytes", "largest request body, as sent and once inflated", type=int, metavar="BYTES")
    _add(flow, "body-read-timeout", "seconds to receive a whole request body", **seconds)
    _add(
        flow,
        "header-read-timeout",
        "seconds to receive a request's whole head (request line and headers) "
        "from its first byte, on every request of a connection; the connection is closed after a 408",
        **seconds,
    )
    _add(flow, "client-keepalive", "seconds a client connection may sit idle between requests", **seconds)
    _add(
        flow,
        "drain-timeout",
        "after SIGTERM: seconds requests in flight may take to finish before they are cut",
        **seconds,
    )
    _add(
        flow,
        "max-prefill-answer-bytes",
        "largest prefill answer read (only its kv_transfer_params and usage are kept)",
        type=int,
        metavar="BYTES",
    )
    _add(flow, "max-answer-bytes", "largest non-streaming decode answer relayed", type=int, metavar="BYTES")
    _add(flow, "max-event-bytes", "largest single streamed event relayed", type=int, metavar="BYTES")
    _add(
        flow,
        "client-write-timeout",
        "seconds one write to a client may take; a client that stops reading is dropped",
        **seconds,
    )
    health = p.add_argument_group("health")
    _add(health, "health-interval", "seconds between /health polls; 0 = off", **seconds)
    _add(health, "health-timeout", "seconds per /health poll", **seconds)
    _add(health, "health-failures", "failed polls in a row before an engine counts as down", type=int)
    _add(health, "breaker-failures", "engine faults in a row that open its circuit breaker", type=int)
    _add(health, "breaker-cooldown", "seconds an open breaker waits before one trial", **seconds)
    admin = p.add_argument_group("admin and output")
    _add(
        admin,
        "admin-token-env",
        "environment variable holding the admin bearer token; /admin/engines exists only with it or --admin-open",
        metavar="NAME",
    )
    _add(
        admin,
        "admin-open",
        "serve /admin/engines without a token (trusted networks only)",
        action=argparse.BooleanOptionalAction,
    )
    _add(admin, "admin-host", "address of the separate admin listener (with --admin-port)")
    _add(admin, "admin-port", "serve /admin/engines only on this separate port", type=int)
    _add(admin, "metrics-port", "serve /metrics only on this separate port", type=int)
    _add(admin, "metrics-host", "address of the metrics listener (default: --host)")
    _add(
        admin,
        "route-headers",
        "name the chosen engines in x-pdconnect-prefill/-decode response headers",
        action=argparse.BooleanOptionalAction,
    )
    _add(admin, "log-level", "log verbosity", choices=["debug", "info", "warning", "error"])
    _add(admin, "log-format", "log lines as text or JSON (request and trace ids as fields)", choices=["text", "json"])
    _add(
        admin,
        "otlp-traces-endpoint",
        "send the router's spans to this OTLP/HTTP endpoint (http://collector:4318/v1/traces; extra `otel`)",
        metavar="URL",
    )
    _add(
        admin,
        "api-keys-file",
        "client API keys (JSON, or TOML ending .toml), each with its rates; /v1/ then needs one",
        metavar="PATH",
    )
    _add(admin, "api-keys-env", "environment variable holding the client API keys document (JSON)", metavar="NAME")
    _add(
        admin,
        "engine-api-key-env",
        "with client keys: environment variable holding the key sent to the engines instead of the client's",
        metavar="NAME",
    )
    _add(
        admin,
        "access-log",
        "log one line per request: status, outcome, route, engines, TTFT, duration",
        action=argparse.BooleanOptionalAction,
    )
    replicas = p.add_argument_group("replicas")
    _add(
        replicas,
        "replica-peers",
        "URLs (replica port) of every router replica over the same engines, this one's too",
        nargs="+",
        action="extend",
        metavar="URL",
    )
    _add(
        replicas,
        "replicas-dns",
        "DNS name (the routers' headless Service, replica port) listing every router replica; "
        "each keeps 1/N of the load floor and decode-first budget",
        metavar="NAME:PORT",
    )
    _add(
        replicas,
        "max-replicas",
        "replicas counted while the peers cannot be counted (no DNS answer): the most the deployment runs",
        type=int,
    )
    _add(replicas, "replica-port", "serve peer replicas' breaker notices on this port", type=int)
    _add(replicas, "replica-secret-file", "file holding the secret every replica signs notices with", metavar="PATH")
    _add(replicas, "replica-secret-env", "environment variable holding that secret instead", metavar="NAME")
    return p


def parse_args(argv: list[str]) -> RouterConfig:
    """argv (without the program name) -> RouterConfig; ConfigError on bad input."""
    given = vars(_parser().parse_args(argv))
    path = given.pop("config", None)
    values = _read_file(path) if path else {}
    values.pop("config", None)
    return load_config({**values, **given})
