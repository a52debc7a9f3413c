"""Where the connector's side-channel secret may come from, and the warning for an inline one (issue 35).

An inline `secret` in `kv_connector_extra_config` is part of the engine's command line,
which `ps` shows to every user of the machine: it is still accepted, with a warning
naming `secret_env` and `secret_file`, which keep it out of argv.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from connectors.settings import ConfigError, ConnectorSettings
from pdconnect.envelope import encode_message, open_envelope
from pdconnect.protocol import Ack
from pdconnect.testbed.keys import PEER_KEYS, SECRETS, keyring

INLINE_WARNING = "command line"


def _settings(**keys: str) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"peer_keys": PEER_KEYS, **keys})


def test_an_inline_secret_is_accepted_with_a_warning_naming_the_safer_options(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="connectors.settings"):
        _settings(secret=SECRETS["prefill"])
    warnings = [r.getMessage() for r in caplog.records if INLINE_WARNING in r.getMessage()]
    assert len(warnings) == 1
    assert "secret_env" in warnings[0] and "secret_file" in warnings[0]
    assert SECRETS["prefill"] not in warnings[0]  # the warning must not print the secret itself


def test_a_secret_file_signs_as_that_secret_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "secret"
    path.write_text(SECRETS["prefill"] + "\n")
    with caplog.at_level(logging.WARNING, logger="connectors.settings"):
        settings = _settings(secret_file=str(path))
    assert not [r for r in caplog.records if INLINE_WARNING in r.getMessage()]
    keys = settings.resolve_keys(frozenset({"prefill"}))
    assert keys is not None
    # A decode engine that trusts the prefill key believes what this one signs.
    signed = encode_message(Ack(unknown=["r"]), "prefill", keys, reply_to=bytes(16))
    assert open_envelope(signed, keyring("decode"), "reply").message == Ack(unknown=["r"])


def test_a_secret_file_that_is_missing_or_short_is_refused_by_name(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"secret_file .* cannot be read"):
        _settings(secret_file=str(tmp_path / "absent")).resolve_keys(frozenset({"prefill"}))
    short = tmp_path / "short"
    short.write_text("too short")
    with pytest.raises(ConfigError, match="fewer than 32 bytes"):
        _settings(secret_file=str(short)).resolve_keys(frozenset({"prefill"}))


def test_only_one_source_of_the_secret_may_be_set(tmp_path: Path):
    with pytest.raises(ConfigError, match="not several"):
        _settings(secret_env="PD_SECRET", secret_file=str(tmp_path / "secret"))
