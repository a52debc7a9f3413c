"""`pdconnect router`'s command line: each option's flag and help, and the file `--config` names.

A flag is declared by its name and help alone (`_FLAGS`): its type, arity, choices and
the default its help ends with are read off the `RouterConfig` field it sets, so the
setting and its flag cannot drift apart, and its bounds are checked once, by
`config.load_config`, whichever way it was given.
"""

from __future__ import annotations

import argparse
import re
import tomllib
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec

from pdconnect.errors import ConfigError
from pdconnect.router.config import RENAMED_OPTIONS, RouterConfig, load_config

__all__ = ["parse_args", "parser"]

# Every flag in --help order, under its group's title: `--flag [METAVAR]: help`, a long
# help going on over indented lines. Its type, arity, choices and default are its field's.
_FLAGS = """
--host: address to serve on
--port: port to serve on
[engines]
--prefill URL: prefill engine URLs
--decode URL: decode engine URLs
--prefill-dns NAME:PORT: DNS names (headless service) of prefill engines, re-resolved every --dns-interval
--decode-dns NAME:PORT: DNS names of decode engines
--dns-interval SECONDS: seconds between DNS re-resolutions
--prefill-dp-size: data-parallel ranks of every prefill engine (vllm --data-parallel-size); each is pinned
    by header
--decode-dp-size: data-parallel ranks of every decode engine
--models NAME: model names the engines above serve: a request naming another is refused (404), unless a
    --pool serves it
--pool SPEC: another model pool, routed by the body's model: model=NAME,prefill=URL,decode=URL (keys repeat;
    also prefill-dns=, decode-dns=)
[routing]
--policy: how a request's engines are chosen
--kv-events-port: kv-aware: port of every engine's vLLM KV events publisher
--kv-events-replay-port: kv-aware: port of every engine's KV events replay socket
--kv-index-max-blocks: kv-aware: blocks each engine's index keeps, all KV cache groups together
--kv-events-max-message-bytes: kv-aware: largest KV event frame accepted
--tokenizer PATH: kv-aware: the model's directory (tokenizer.json, tokenizer_config.json, chat template) to
    turn text and chat prompts into the engine's token ids; a bare tokenizer.json serves text only; without
    it such prompts are placed by prefix affinity
--decode-first: kv-aware: a request whose decode engine already caches all but a few prompt tokens skips the
    prefill leg (decode prefills them itself)
--kv-cache-groups SPEC: decode-first: the engines' KV cache groups, e.g. full:128:eagle,sliding:128:64:eagle
    (:eagle on the groups that take the EAGLE/MTP drop: every group under EAGLE, the drafter's group under
    MTP)
--decode-first-max-uncached-tokens: decode-first: most prompt tokens a decode engine may compute itself for
    one request
--decode-first-max-uncached-ratio: decode-first: most share of a prompt a decode engine may compute itself
--decode-first-max-tokens-in-flight: decode-first: most local-prefill tokens in flight per decode engine;
    beyond it, P/D
--affinity-prefix-chars: characters of prompt text hashed for the affinity key
--affinity-prefix-tokens: token ids hashed for the affinity key
--affinity-load-factor: no engine takes more than this times the mean load
--affinity-min-load: in-flight requests below which no engine counts as loaded (a burst of siblings stays on
    the engine that caches their prefix)
--affinity-vnodes: points per engine on the hash ring
[request flow]
--connect-timeout SECONDS: seconds to connect to an engine
--upstream-keepalive SECONDS: seconds an idle engine connection is kept for reuse; below the engines' own
    keep-alive (vLLM: 5 s)
--prefill-timeout SECONDS: seconds for a whole prefill answer
--decode-first-byte-timeout SECONDS: streams: seconds until decode's first chunk
--decode-timeout SECONDS: non-streaming: seconds for the whole decode (not retried)
--stream-idle-timeout SECONDS: streams: longest silence between chunks
--release-timeout SECONDS: seconds for a side-channel release notice
--prefill-attempts: prefill engines tried per request
--decode-attempts: decode engines tried per request
--fallback: decode-only fallback when every prefill attempt fails
--side-channel-secret-env NAME: environment variable holding the side-channel secret
--side-channel-peer-keys-env NAME: environment variable holding the prefill engines' public side-channel
    keys (prefill:KEY ...)
--max-body-bytes BYTES: largest request body, as sent and once inflated
--body-read-timeout SECONDS: seconds to receive a whole request body
--header-read-timeout SECONDS: seconds to receive a request's whole head (request line and headers) from its
    first byte, on every request of a connection; the connection is closed after a 408
--client-keepalive SECONDS: seconds a client connection may sit idle between requests
--drain-timeout SECONDS: after SIGTERM: seconds requests in flight may take to finish before they are cut
--max-prefill-answer-bytes BYTES: largest prefill answer read (only its kv_transfer_params and usage are
    kept)
--max-answer-bytes BYTES: largest non-streaming decode answer relayed
--max-event-bytes BYTES: largest single streamed event relayed
--client-write-timeout SECONDS: seconds one write to a client may take; a client that stops reading is
    dropped
[health]
--health-interval SECONDS: seconds between /health polls; 0 = off
--health-timeout SECONDS: seconds per /health poll
--health-failures: failed polls in a row before an engine counts as down
--breaker-failures: engine faults in a row that open its circuit breaker
--breaker-cooldown SECONDS: seconds an open breaker waits before one trial
[admin and output]
--admin-token-env NAME: environment variable holding the admin bearer token; /admin/engines exists only with
    it or --admin-open
--admin-open: serve /admin/engines without a token (trusted networks only)
--admin-host: address of the separate admin listener (with --admin-port)
--admin-port: serve /admin/engines only on this separate port
--metrics-port: serve /metrics only on this separate port
--metrics-host: address of the metrics listener (default: --host)
--route-headers: name the chosen engines in x-pdconnect-prefill/-decode response headers
--log-level: log verbosity
--log-format: log lines as text or JSON (request and trace ids as fields)
--otlp-traces-endpoint URL: send the router's spans to this OTLP/HTTP endpoint
    (http://collector:4318/v1/traces; extra `otel`)
--otlp-traces-sample-ratio RATIO: share of requests without a client traceparent whose spans are recorded
    (else OTEL_TRACES_SAMPLER_ARG, 1.0)
--api-keys-file PATH: client API keys (JSON, or TOML ending .toml), each with its rates; /v1/ then needs one
--api-keys-env NAME: environment variable holding the client API keys document (JSON)
--engine-api-key-env NAME: with client keys: environment variable holding the key sent to the engines
    instead of the client's
--access-log: log one line per request: status, outcome, route, engines, TTFT, duration
[replicas]
--replica-peers URL: URLs (replica port) of every router replica over the same engines, this one's too
--replicas-dns NAME:PORT: DNS name (the routers' headless Service, replica port) listing every router
    replica; each keeps 1/N of the load floor and decode-first budget
--max-replicas: replicas counted while the peers cannot be counted (no DNS answer): the most the deployment
    runs
--replica-port: serve peer replicas' breaker notices on this port
--replica-secret-file PATH: file holding the secret every replica signs notices with
--replica-secret-env NAME: environment variable holding that secret instead
"""
_FLAG = re.compile(r"--(?P<flag>[a-z-]+)(?: (?P<metavar>\S+))?: (?P<help>.+)")
# Flags named otherwise than their field: one --pool a pool.
_FIELDS = {"pool": "pools"}


def _field_kind(hint: Any) -> dict[str, Any]:
    """argparse's view of a field's type: bool -> --x/--no-x; a tuple of strings -> any
    number of values, added up; a tuple of other things -> one per flag; a Literal ->
    its choices; an int or a float (bounded, or optional) -> converted."""
    while get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
        return _field_kind(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(hint) is tuple:
        return {"nargs": "+", "action": "extend"} if get_args(hint)[0] is str else {"action": "append"}
    if get_origin(hint) is Literal:
        return {"choices": list(get_args(hint))}
    if hint in (int, float):
        return {"type": hint}
    return {}


def _flags() -> list[tuple[str | None, str, str | None, str]]:
    """(the title of the group it opens or None, flag, metavar or None, help) of each flag of `_FLAGS`."""
    flags: list[tuple[str | None, str, str | None, str]] = []
    title: str | None = None
    for line in _FLAGS.strip().splitlines():
        if line.startswith("["):
            title = line.strip("[]")
        elif line.startswith(" "):
            opened, flag, metavar, text = flags[-1]
            flags[-1] = (opened, flag, metavar, f"{text} {line.strip()}")
        else:
            match = _FLAG.fullmatch(line)
            assert match is not None, line
            flags.append((title, match["flag"], match["metavar"], match["help"]))
            title = None
    return flags


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if default in ((), None):
        return "none"
    return str(default)


def parser() -> argparse.ArgumentParser:
    """Every flag, each with the default `RouterConfig` gives its field at the end of its help."""
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
    hints = get_type_hints(RouterConfig, include_extras=True)
    fields, defaults = RouterConfig.__struct_fields__, RouterConfig.__struct_defaults__
    default_of = dict(zip(fields[len(fields) - len(defaults) :], defaults, strict=True))
    group: argparse._ActionsContainer = p
    for title, flag, metavar, text in _flags():
        if title is not None:
            group = p.add_argument_group(title)
        dest = _FIELDS.get(flag, flag.replace("-", "_"))
        names = [f"--{flag}"]
        old = RENAMED_OPTIONS.get(dest)
        if old is not None:
            names.append(f"--{old.replace('_', '-')}")
        renamed = f"; {names[1]} is its deprecated name" if old is not None else ""
        kind = _field_kind(hints[dest]) | ({"metavar": metavar} if metavar else {})
        shown = f"{text}{renamed} (default: {_shown(default_of[dest])})"
        group.add_argument(*names, dest=dest, help=shown, **kind)
    return p


def _read_file(path: str) -> dict[str, Any]:
    text = Path(path).read_bytes()
    try:
        data = tomllib.loads(text.decode()) if path.endswith(".toml") else msgspec.json.decode(text)
    except (tomllib.TOMLDecodeError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold an object of options")
    return data


def parse_args(argv: list[str]) -> RouterConfig:
    """argv (without the program name) -> RouterConfig; ConfigError on bad input."""
    given = vars(parser().parse_args(argv))
    path = given.pop("config", None)
    values = _read_file(path) if path else {}
    values.pop("config", None)
    return load_config({**values, **given})
