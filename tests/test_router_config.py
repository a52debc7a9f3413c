"""Router configuration (argv, config file, validation) and the `pdconnect router` command
run as a real process in front of FAKE engines."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdconnect.router import ConfigError, main, parse_args
from pdconnect.router.config import RouterConfig
from pdconnect.router.options import parser
from pdconnect.testbed.recipes import router_argv
from tests.waiting import wait_until


def test_argv_options_become_a_typed_config() -> None:
    config = parse_args(
        [
            "--prefill",
            "http://p1:8000/",
            "http://p2:8000",
            "--decode",
            "http://d:8000",
            "--decode-dns",
            "decode.ns.svc:8000",
            "--policy",
            "least-loaded",
            "--no-fallback",
            "--prefill-timeout",
            "5",
        ]
    )
    assert config.prefill_urls == ("http://p1:8000", "http://p2:8000")
    assert config.decode_urls == ("http://d:8000",)
    assert [str(t) for t in config.dns_targets("decode")] == ["http://decode.ns.svc:8000"]
    assert config.policy == "least-loaded" and config.fallback is False and config.prefill_timeout == 5.0


@pytest.mark.parametrize(
    "suffix,text",
    [
        (".json", '{"decode": ["http://file:1"], "prefill-timeout": 7, "policy": "round-robin"}'),
        (".toml", 'decode = ["http://file:1"]\nprefill_timeout = 7\npolicy = "round-robin"\n'),
    ],
)
def test_config_file_is_read_and_argv_overrides_it(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"router{suffix}"
    path.write_text(text)
    config = parse_args(["--config", str(path), "--policy", "prefix-affinity"])
    assert config.decode_urls == ("http://file:1",)
    assert config.prefill_timeout == 7.0
    assert config.policy == "prefix-affinity"


@pytest.mark.parametrize(
    "argv,named",
    [
        ([], "no decode engines"),
        (["--decode", "d:8000"], "http://"),
        (["--decode", "http://d:1", "--decode-attempts", "0"], "decode_attempts"),
        (["--decode", "http://d:1", "--affinity-load-factor", "0.9"], "affinity_load_factor"),
        (["--decode-dns", "no-port"], "name:port"),
        # pools (--pool): each option's problem named
        (["--decode", "http://a:1", "--pool", "model=m,decode=http://b:1"], "need --models"),
        (["--decode", "http://a:1", "--models", "m", "--pool", "model=m,decode=http://b:1"], "two pools"),
        (["--pool", "model=m,prefill=http://b:1"], "no decode engines"),
        (["--pool", "model=m,decode=http://b:1,colour=red"], "--pool takes"),
        (["--pool", "model=m,decode=ftp://b:1"], "http://"),
    ],
)
def test_bad_options_are_refused_with_their_name(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_args(argv)


def test_unknown_config_file_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text('{"decode": ["http://d:1"], "prefil": ["http://typo:1"]}')
    with pytest.raises(ConfigError, match="prefil"):
        parse_args(["--config", str(path)])


def test_secrets_come_from_the_named_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_args(["--decode", "http://d:1", "--side-channel-secret-env", "PDC_TEST_SECRET"])
    with pytest.raises(ConfigError, match="PDC_TEST_SECRET"):
        config.resolve_secret()
    monkeypatch.setenv("PDC_TEST_SECRET", "xyz")
    assert config.resolve_secret() == b"xyz"


def test_main_exits_2_on_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--decode", "nope"]) == 2
    assert "http://" in capsys.readouterr().err


def test_decode_first_keeps_its_old_decode_local_names_as_deprecated_aliases(tmp_path: Path) -> None:
    """Manifests and config files written before the rename still work: --decode-local and
    the decode_local keys set the decode-first options; giving both names is refused."""
    kv = ["--decode", "http://d:1", "--policy", "kv-aware", "--kv-events-port", "5557", "--kv-cache-groups", "full:4"]
    new = parse_args([*kv, "--decode-first", "--decode-first-max-uncached-tokens", "9"])
    old = parse_args([*kv, "--decode-local", "--decode-local-max-uncached-tokens", "9"])
    assert new.decode_first and new.decode_first_max_uncached_tokens == 9
    assert old == new
    assert not parse_args([*kv, "--no-decode-local"]).decode_first
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"decode_local": True, "decode_local_max_tokens_in_flight": 7}))
    from_file = parse_args([*kv, "--config", str(path)])
    assert from_file.decode_first and from_file.decode_first_max_tokens_in_flight == 7
    with pytest.raises(ConfigError, match="deprecated name of decode_first"):
        parse_args([*kv, "--config", str(path), "--no-decode-first"])
    assert "--decode-local is its deprecated name" in " ".join(parser().format_help().split())


@pytest.mark.parametrize("make", ["missing", "empty_dir", "not_a_tokenizer"])
def test_a_bad_tokenizer_path_is_a_config_error_at_start_up(
    make: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--tokenizer` naming nothing, a directory without tokenizer.json, or a file that is no
    tokenizer: exit 2 with a line naming the path, not a traceback."""
    path = tmp_path / "model"
    if make == "empty_dir":
        path.mkdir()
    elif make == "not_a_tokenizer":
        path.write_text("{not json")
    argv = [
        "--decode",
        "http://127.0.0.1:1",
        "--policy",
        "kv-aware",
        "--kv-events-port",
        "5557",
        "--tokenizer",
        str(path),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdconnect router: ") and str(path) in err and "Traceback" not in err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_pdconnect_router_command_serves_and_stops_on_sigterm() -> None:
    fake = subprocess.Popen(
        [sys.executable, "-m", "pdconnect.testbed.fake_engine", "--side-channel"], stdout=subprocess.PIPE, text=True
    )
    router = None
    try:
        assert fake.stdout is not None
        engine = json.loads(fake.stdout.readline())["url"]
        port = free_port()
        router = subprocess.Popen(
            router_argv(port=port, prefill=[engine], decode=[engine]),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert router is not None and router.poll() is None, "router exited"
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, "the router's /health to answer 200", 60)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "a b", "max_tokens": 2}, timeout=10)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " t0 t1"
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=30) == 0
    finally:
        for proc in (router, fake):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# --- help ------------------------------------------------------------------------------------------


def test_every_cli_option_has_help_text_with_its_default() -> None:
    missing = []
    for action in parser()._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        if not action.help or "default" not in action.help:
            missing.append(action.option_strings[0])
    assert missing == []
    text = parser().format_help()
    assert f"default: {RouterConfig.__struct_defaults__[RouterConfig.__struct_fields__.index('port')]}" in text


def test_every_setting_can_be_given_on_the_command_line() -> None:
    # Settings only a config file can set are invisible in --help; the mapping files-only
    # below is the list of what is deliberately left to files.
    files_only = {"kv_events_endpoints"}
    flags = {action.dest for action in parser()._actions if action.option_strings}
    assert set(RouterConfig.__struct_fields__) - files_only - flags == set()


def test_a_flag_takes_its_fields_type_arity_and_choices() -> None:
    """A flag declares only its name and help: what it parses into comes from its field."""
    actions = {action.dest: action for action in parser()._actions}
    assert actions["host"].type is None
    assert actions["prefill_dp_size"].type is int  # AtLeastOne
    assert actions["admin_port"].type is int  # Port | None
    assert actions["affinity_load_factor"].type is float
    assert actions["prefill"].nargs == "+"
    assert isinstance(actions["pools"], argparse._AppendAction)  # one --pool a pool
    assert isinstance(actions["fallback"], argparse.BooleanOptionalAction)
    assert actions["log_format"].choices == ["text", "json"]
    config = parse_args(["--decode", "http://d:1", "http://d:2", "--prefill-dp-size", "2", "--no-fallback"])
    assert (config.decode, config.prefill_dp_size, config.fallback) == (("http://d:1", "http://d:2"), 2, False)


def test_the_router_and_the_connector_raise_one_config_error() -> None:
    """One class for every bad setting: a caller catching it need not know who complained."""
    from connectors.settings import ConnectorSettings
    from pdconnect.errors import ConfigError as SharedConfigError

    assert ConfigError is SharedConfigError
    with pytest.raises(ConfigError, match="side_channel_port"):
        ConnectorSettings(side_channel_port=70000)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("decode-timeout", 0.0, "decode_timeout must be positive, got 0.0"),
        ("max-event-bytes", 0, "max_event_bytes must be >= 1, got 0"),
        ("health-interval", -1.0, "health_interval must be >= 0, got -1.0 (0 turns active polling off)"),
        ("admin-port", 70000, "admin_port must be <= 65535, got 70000"),
    ],
)
def test_a_value_outside_its_declared_bound_is_refused_naming_field_bound_and_value(
    option: str, value: float, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_args(["--decode", "http://d:1", f"--{option}", str(value)])
    assert str(refused.value) == f"invalid router configuration: {message}"
    # Built directly (tests, the testbed), msgspec checks no bound: __post_init__ does.
    with pytest.raises(ConfigError) as refused:
        RouterConfig(decode=("http://d:1",), **{option.replace("-", "_"): value})  # type: ignore[arg-type]  # one field a case
    assert str(refused.value) == message
