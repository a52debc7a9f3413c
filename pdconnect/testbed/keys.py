"""Side-channel keys for local rigs and tests: one fixed, public secret per role, never for a deployment.

Each role gets its own secret, as in production, so a test that signs as one role
really cannot pass for another. `PEER_KEYS` is the one `role:key` line every local
engine and router can be given (each reads only the roles it believes).
"""

from __future__ import annotations

from pdconnect.keyring import Keyring, SigningKey, TrustedKeys, public_key_text
from pdconnect.protocol import Role

__all__ = ["PEER_KEYS", "SECRETS", "connector_keys", "keyring"]

# Public test values: anyone reading this file holds them.
SECRETS: dict[Role, str] = {
    "prefill": "testbed-prefill-side-channel-secret-not-for-deployments",
    "decode": "testbed-decode-side-channel-secret-not-for-deployments",
    "router": "testbed-router-side-channel-secret-not-for-deployments",
}
PEER_KEYS = " ".join(f"{role}:{public_key_text(secret.encode())}" for role, secret in SECRETS.items())


def keyring(role: Role, *, trusted: str = PEER_KEYS, secret: str | None = None) -> Keyring:
    """`role`'s keys as an engine or the router would build them (`secret` overrides its own)."""
    signing = SigningKey((SECRETS[role] if secret is None else secret).encode())
    return Keyring(signing, TrustedKeys.parse(trusted), role)


def connector_keys(kv_role: str) -> dict[str, str]:
    """The `kv_connector_extra_config` keys of an engine of `kv_role`.

    A kv_both engine signs as prefill and as decode with the prefill secret, so it also
    believes that key as decode (whoever it asks must too)."""
    if kv_role == "kv_consumer":
        return {"secret": SECRETS["decode"], "peer_keys": PEER_KEYS}
    extra = f" decode:{public_key_text(SECRETS['prefill'].encode())}" if kv_role == "kv_both" else ""
    return {"secret": SECRETS["prefill"], "peer_keys": PEER_KEYS + extra}
