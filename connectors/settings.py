"""The connector's settings: one typed object parsed from `kv_connector_extra_config`.

vLLM hands the connector an untyped dict; everything downstream reads this object
instead, so a typo in a deployment fails at engine start with the key's name rather
than silently falling back to a default. Imports no vLLM: the deploy checks parse the
manifests' `--kv-transfer-config` with it. `ConfigError` is `pdconnect.errors`'.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Literal

import msgspec

from pdconnect.config_fields import Meta, Port, Seconds, check_bounds, check_values
from pdconnect.envelope import DEFAULT_MAX_AGE_SECONDS
from pdconnect.errors import ConfigError
from pdconnect.keyring import MIN_SECRET_BYTES, Keyring, SigningKey, TrustedKeys
from pdconnect.protocol import Role
from pdconnect.sidechannel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_HOST,
    is_loopback_host,
)

__all__ = ["ConfigError", "ConnectorSettings", "parse_kv_transfer_config", "side_channel_roles"]

logger = logging.getLogger(__name__)


class ConnectorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything an operator may set in `kv_connector_extra_config`.

    Invariants (checked in `__post_init__`): each field's own bounds, declared on its type
    (`Seconds`: positive, `Port`: 0..65535, `pdconnect.config_fields`); heartbeats are sent
    more often than the lease runs out, so a live decode engine never loses its blocks to
    expiry.
    """

    transport: Literal["mooncake", "nixl"] = "mooncake"
    # Mooncake only: "rdma" is production; "tcp" runs anywhere (tests, CPU demo).
    protocol: Literal["rdma", "tcp"] = "rdma"
    # Mooncake RDMA NIC names, comma separated (e.g. "mlx5_0,mlx5_1"); "" = auto.
    device_name: str = ""
    # Refuse to start instead of silently falling back to TCP: Mooncake with protocol
    # rdma, and NIXL where UCX cannot use RDMA (no device, or its ib modules off).
    require_rdma: bool = False
    # Address the prefill engine's side channel binds to and advertises to peers.
    side_channel_host: str = "127.0.0.1"
    # 0 binds a free port (tests); plans always carry the port actually bound.
    side_channel_port: Port = 5700
    # The address peers dial when it differs from the bind host (NAT, 0.0.0.0 binds).
    advertise_host: str | None = None
    # How long the prefill engine holds a request's blocks without news from decode.
    lease_seconds: Seconds = 60.0
    heartbeat_seconds: Seconds = 10.0
    handshake_timeout_seconds: Seconds = 5.0
    # A pull that has not completed after this long is failed (never a hang).
    transfer_timeout_seconds: Seconds = 30.0
    # Keep and send the sliding-window replay slack; false = the stock tail clip (A/B).
    replay_slack: bool = True
    # Decode: a request whose prompt shares blocks with a load in flight on this engine
    # waits for that load to be published instead of pulling the same blocks again;
    # false = every request pulls on its own (A/B). The wait is bounded.
    coalesce: bool = True
    coalesce_wait_seconds: Seconds = 10.0
    # This engine's side-channel secret (at least 32 bytes): the key its role (prefill
    # or decode) signs with, held by that role's pods only; `secret_env` names an
    # environment variable holding it (Kubernetes Secrets), `secret_file` a file (a
    # mounted Secret), so it never sits in argv; an inline `secret` does (`ps` shows it).
    secret: str | None = None
    secret_env: str | None = None
    secret_file: str | None = None
    # The public keys this engine trusts, as `role:key` tokens (`pdconnect.keyring`):
    # a prefill engine needs decode's (and router's, for releases), a decode engine
    # prefill's. Several per role while a key is rotated. Needed with a secret.
    peer_keys: str | None = None
    peer_keys_env: str | None = None
    # The largest side-channel message the prefill engine reads; zmq drops the sender's
    # connection on a bigger one before it is copied (handshakes and notices are far
    # smaller: a heartbeat carries ~100 bytes per watched request).
    side_channel_max_message_bytes: Annotated[int, Meta(gt=0)] = DEFAULT_MAX_MESSAGE_BYTES
    # With a secret, a message whose send time is further than this from the receiver's
    # clock, either way, is refused as stale (so it is also the clock skew tolerated);
    # inside it, each message is accepted once and replays are refused.
    side_channel_max_age_seconds: Seconds = DEFAULT_MAX_AGE_SECONDS
    # Connections the prefill engine's side channel holds open from one source address,
    # and from all together; one beyond either is closed before it carries a message and
    # counted (`pdconnect:side_channel_connections_over_host_limit`, `..._over_limit`).
    # A decode engine holds 2 * TP + 1 per prefill engine, the router one
    # (`pdconnect.sidechannel.MAX_CONNECTIONS_PER_HOST` says why 64 and 4096).
    side_channel_max_connections: int = MAX_CONNECTIONS
    side_channel_max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST
    # Serve the side channel on a non-loopback address without a secret, and (decode)
    # follow plans naming a non-loopback prefill engine without one. Only for an
    # isolated network: anyone who can reach the port can keep or free held blocks, and
    # anyone who can answer for a prefill engine can feed decode its bytes.
    allow_insecure_side_channel: bool = False
    # NIXL: microseconds the serving agent's progress thread sleeps between rounds (it
    # answers peers' connection wire-up; reads never wait on it). 0 is NIXL's busy loop,
    # a whole core per engine; measured on 2 cores: 200 us idles at ~2% of a core with
    # no change in transfer rate (`pdconnect.transfer.nixl.PROGRESS_THREAD_DELAY_US`).
    nixl_progress_delay_us: int = 200

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ConfigError(
                f"heartbeat_seconds ({self.heartbeat_seconds}) must be shorter than "
                f"lease_seconds ({self.lease_seconds}), or live requests lose their blocks"
            )
        if sum(value is not None for value in (self.secret, self.secret_env, self.secret_file)) > 1:
            raise ConfigError("set one of secret, secret_env and secret_file, not several")
        if self.peer_keys is not None and self.peer_keys_env is not None:
            raise ConfigError("set either peer_keys or peer_keys_env, not both")
        if (not self._keyed) != (self.peer_keys is None and self.peer_keys_env is None):
            raise ConfigError("secret (or secret_env, secret_file) and peer_keys (or peer_keys_env) go together")
        if self.secret is not None and len(self.secret.strip().encode()) < MIN_SECRET_BYTES:
            raise ConfigError(f"secret is shorter than {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)")
        if self.secret is not None:
            logger.warning(
                "kv_connector_extra_config holds the side-channel secret inline: it is on the engine's "
                "command line, where `ps` shows it to every user of the machine; use secret_env or secret_file"
            )
        if self.peer_keys is not None:
            TrustedKeys.parse(self.peer_keys)
        if not 0 < self.side_channel_max_connections_per_host <= self.side_channel_max_connections:
            raise ConfigError(
                "need 0 < side_channel_max_connections_per_host <= side_channel_max_connections, got "
                f"{self.side_channel_max_connections_per_host} and {self.side_channel_max_connections}"
            )
        if not self._keyed and not self.allow_insecure_side_channel and not is_loopback_host(self.side_channel_host):
            raise ConfigError(
                f"side_channel_host {self.side_channel_host!r} is reachable from other machines: set "
                "secret_env (or secret_file), or allow_insecure_side_channel on an isolated network"
            )

    @classmethod
    def from_extra_config(cls, extra: dict[str, object] | None) -> ConnectorSettings:
        """Parse `kv_connector_extra_config`; raises ConfigError naming the bad key."""
        try:
            check_values(cls, extra or {})  # before msgspec, whose own message names no value
            return msgspec.convert(extra or {}, cls, strict=True)
        except (ConfigError, msgspec.ValidationError) as exc:
            raise ConfigError(f"invalid kv_connector_extra_config: {exc}") from None

    @property
    def _keyed(self) -> bool:
        return self.secret is not None or self.secret_env is not None or self.secret_file is not None

    @property
    def peer_host(self) -> str:
        """The host peers should dial for this engine's side channel."""
        return self.advertise_host or self.side_channel_host

    def may_dial(self, host: str) -> bool:
        """Whether this engine may talk to a side channel on `host`: with keys anywhere,
        without them only on this machine (unless the operator opted out)."""
        return self._keyed or self.allow_insecure_side_channel or is_loopback_host(host)

    def resolve_keys(self, roles: frozenset[Role]) -> Keyring | None:
        """This engine's side-channel keys for `roles` (what its `kv_role` makes it), read
        from the environment if so configured; None without a secret. ConfigError for a
        secret shorter than a key, unreadable peer keys, or no keys for a peer role."""
        secret = _file_value(self.secret_file) if self.secret_file is not None else None
        secret = secret or _value(self.secret, self.secret_env, "secret_env")
        peer_keys = _value(self.peer_keys, self.peer_keys_env, "peer_keys_env")
        if secret is None or peer_keys is None:
            return None
        # Prefill answers decode (and the router, whose keys are optional: without them its
        # releases are refused and leases just run out); decode believes prefill only.
        needs: set[Role] = set()
        if "prefill" in roles:
            needs.add("decode")
        if "decode" in roles:
            needs.add("prefill")
        signs_as: Role = "prefill" if "prefill" in roles else "decode"
        return Keyring.checked(SigningKey(secret.encode()), TrustedKeys.parse(peer_keys), signs_as, frozenset(needs))


def side_channel_roles(is_producer: bool, is_consumer: bool) -> frozenset[Role]:
    """The side-channel roles an engine plays: a producer is prefill, a consumer decode, kv_both both."""
    roles: set[Role] = set()
    if is_producer:
        roles.add("prefill")
    if is_consumer:
        roles.add("decode")
    return frozenset(roles)


def _value(inline: str | None, env: str | None, env_key: str) -> str | None:
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise ConfigError(f"{env_key} names {env!r}, which is unset or empty")
        return value
    return inline


def _file_value(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            value = file.read().strip()
    except OSError as exc:
        raise ConfigError(f"secret_file {path!r} cannot be read: {exc.strerror}") from None
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise ConfigError(f"secret_file {path!r} holds fewer than {MIN_SECRET_BYTES} bytes")
    return value


_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str) -> tuple[str, ConnectorSettings]:
    """Check a `--kv-transfer-config` JSON string the way our connector will read it.

    Returns the role and the parsed settings. Used by deployment checks, which must
    not need vLLM to validate what an engine will be started with.
    """
    try:
        config = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"--kv-transfer-config is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError("--kv-transfer-config must be a JSON object")
    if config.get("kv_connector") != "PDConnector":
        raise ConfigError(f"kv_connector must be 'PDConnector', got {config.get('kv_connector')!r}")
    role = config.get("kv_role")
    if role not in _ROLES:
        raise ConfigError(f"kv_role must be one of {', '.join(_ROLES)}, got {role!r}")
    return role, ConnectorSettings.from_extra_config(config.get("kv_connector_extra_config"))
