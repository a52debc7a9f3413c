"""The router's settings: one typed, validated object built once from a config file and argv.

Precedence: built-in defaults < config file (`--config`, JSON or TOML, keys spelled as
the long options with `_` or `-`) < command-line options. Each setting is declared once,
here, as a field of `RouterConfig` with its type, bound and default; `options` reads the
command line (and the file it names) into the mapping `load_config` checks. Everything
downstream reads the resulting `RouterConfig`; nothing reads argv or the environment
again, except the side-channel secret, which `resolve_secret` reads once at start.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from pdconnect.config_fields import AtLeastOne, Meta, Port, Seconds, check_bounds, check_values
from pdconnect.errors import ConfigError
from pdconnect.keyring import Keyring, SigningKey, TrustedKeys
from pdconnect.router.lookup import parse_groups
from pdconnect.router.pools import PoolConfig, check_pools

__all__ = [
    "RENAMED_OPTIONS",
    "ConfigError",
    "DnsTarget",
    "RouterConfig",
    "engine_origin",
    "load_config",
    "pool_dns_targets",
]

logger = logging.getLogger("pdconnect.router.config")

Policy = Literal["kv-aware", "prefix-affinity", "least-loaded", "round-robin"]

# Options renamed: new name -> the old one, still accepted as a key and as a flag (deploy
# manifests and scripts written before the rename), with a warning.
RENAMED_OPTIONS = {
    "decode_first": "decode_local",
    "decode_first_max_uncached_tokens": "decode_local_max_uncached_tokens",
    "decode_first_max_uncached_ratio": "decode_local_max_uncached_ratio",
    "decode_first_max_tokens_in_flight": "decode_local_max_tokens_in_flight",
}
_RENAMED_KEYS = {old: new for new, old in RENAMED_OPTIONS.items()}


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
    # Share of requests without a client `traceparent` whose spans are recorded (a client's
    # sampled flag decides for its own). None: OTEL_TRACES_SAMPLER_ARG, else 1.0.
    otlp_traces_sample_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
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
