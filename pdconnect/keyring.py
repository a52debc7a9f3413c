"""Side-channel keys: the secret one pod signs with, and the public keys it trusts per role.

Each role (prefill, decode, router; `pdconnect.protocol.Role`) signs with an Ed25519 key
that only that role's pods hold, and every receiver holds only public keys. So a pod can
prove it is its own role and nothing else: the router's secret signs releases and
cannot sign a prefill engine's answer or a decode engine's claim, which an HMAC key
shared by all three could (docs/side-channel-trust.md has the whole argument).

The secret is text of at least `MIN_SECRET_BYTES` bytes (e.g. `openssl rand -hex 32`);
the signing key is derived from it (SHA-256 under a domain string), and
`pdconnect side-channel-key` prints the matching public key. The public keys a pod
trusts are one line of `role:key` tokens (`TrustedKeys`), the same line for every pod
if one likes: each receiver reads only the roles it accepts messages from. A role may
list several keys (the current and the next one), which is how keys are rotated
without a flag day.

A key id (8 bytes of the public key's SHA-256) travels with every signature, so the
receiver checks one key, not all of them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pdconnect.errors import ConfigError
from pdconnect.protocol import Role

__all__ = [
    "KEY_ID_BYTES",
    "MIN_SECRET_BYTES",
    "SIGNATURE_BYTES",
    "Keyring",
    "SigningKey",
    "TrustedKeys",
    "main",
    "public_key_text",
]

# A secret shorter than a key is a password: refused at start-up.
MIN_SECRET_BYTES = 32
KEY_ID_BYTES = 8
SIGNATURE_BYTES = 64
_ROLES: tuple[Role, ...] = get_args(Role)
_DERIVATION_DOMAIN = b"pdconnect side-channel signing key v1\x00"


def _key_id(public: Ed25519PublicKey) -> bytes:
    return hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).digest()[:KEY_ID_BYTES]


class SigningKey:
    """The private key derived from one secret; refuses a secret shorter than a key."""

    def __init__(self, secret: bytes) -> None:
        # Whitespace around a secret is an accident of files and Kubernetes Secrets (a
        # trailing newline), never key material: every reader drops it the same way.
        secret = secret.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the side-channel secret is {len(secret)} bytes; it must be at least {MIN_SECRET_BYTES} "
                "(e.g. `openssl rand -hex 32`)"
            )
        seed = hashlib.sha256(_DERIVATION_DOMAIN + secret).digest()
        self._private = Ed25519PrivateKey.from_private_bytes(seed)
        self.public = self._private.public_key()
        self.key_id = _key_id(self.public)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def public_key_text(secret: bytes) -> str:
    """The public key of `secret`, as `TrustedKeys` reads it (base64 of 32 bytes)."""
    raw = SigningKey(secret).public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


class TrustedKeys:
    """The public keys a receiver accepts, per role: `role:base64key` tokens, space or comma separated.

    Invariant: every key decodes to an Ed25519 public key and names a known role; a
    malformed line is a ConfigError at start-up, never a key silently left out.
    """

    def __init__(self, by_role: Mapping[Role, list[Ed25519PublicKey]]) -> None:
        self._keys: dict[tuple[Role, bytes], Ed25519PublicKey] = {
            (role, _key_id(key)): key for role, keys in by_role.items() for key in keys
        }

    @classmethod
    def parse(cls, text: str) -> TrustedKeys:
        by_role: dict[Role, list[Ed25519PublicKey]] = {}
        for token in text.replace(",", " ").split():
            role_text, sep, key_text = token.partition(":")
            role = next((r for r in _ROLES if r == role_text), None)
            if not sep or role is None:
                raise ConfigError(f"side-channel key {token[:20]!r}: expected role:key with role one of {_ROLES}")
            try:
                raw = base64.b64decode(key_text, validate=True)
                key = Ed25519PublicKey.from_public_bytes(raw)
            except (binascii.Error, ValueError):
                raise ConfigError(
                    f"side-channel key for {role}: not a base64 Ed25519 public key (see `pdconnect side-channel-key`)"
                ) from None
            by_role.setdefault(role, []).append(key)
        return cls(by_role)

    def roles(self) -> frozenset[Role]:
        return frozenset(role for role, _ in self._keys)

    def verify(self, role: Role, key_id: bytes, signature: bytes, data: bytes) -> bool:
        key = self._keys.get((role, key_id))
        if key is None:
            return False
        try:
            key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class Keyring:
    """One endpoint's keys: what it signs with (claiming role `signs_as`) and whom it believes."""

    signing: SigningKey
    trusted: TrustedKeys
    signs_as: Role

    @classmethod
    def checked(cls, signing: SigningKey, trusted: TrustedKeys, signs_as: Role, needs: frozenset[Role]) -> Keyring:
        """A keyring that holds public keys for every role in `needs`, or ConfigError (at
        start, so a pod that could not verify its peers never refuses them one by one)."""
        missing = sorted(needs - trusted.roles())
        if missing:
            raise ConfigError(
                f"a {signs_as} side channel needs the public keys of {', '.join(missing)} "
                "(peer_keys / --side-channel-peer-keys-env: role:key tokens)"
            )
        return cls(signing, trusted, signs_as)

    def acting_as(self, role: Role) -> Keyring:
        """The same keys signing as `role` (a kv_both engine is prefill and decode)."""
        return replace(self, signs_as=role)


def main(argv: list[str]) -> int:
    """`pdconnect side-channel-key [ENV]`: print the public key of the secret in ENV (or stdin)."""
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: pdconnect side-channel-key [ENV_VAR]\n\n"
            "Prints the public key (for peer_keys, as role:KEY) of the side-channel secret held in\n"
            "the environment variable ENV_VAR, or read from stdin without one."
        )
        return 0
    secret = os.environ.get(argv[0], "") if argv else sys.stdin.read()
    try:
        print(public_key_text(secret.encode()))
    except ConfigError as exc:
        print(f"pdconnect side-channel-key: {exc}", file=sys.stderr)
        return 2
    return 0
