#!/usr/bin/env python3
"""Check pdconnect on a real NVIDIA GPU with vLLM 0.33 (CUDA): what the CPU machines cannot show.

    make gpu-check                         # installs build/venv-gpu, then runs this
    python scripts/gpu_check.py [--part layouts|engines] [--transports nixl mooncake]
                                [--backends FLASH_ATTN FLASHINFER]
    python scripts/gpu_check.py --preflight    # only: is there a GPU? (no torch import)

Two parts, both must pass (exit 0; 1 = a check failed; 2 = refused: no GPU, no CUDA
torch, or not vLLM 0.33):

1. **layouts** — `pdconnect.kvlayout` on real CUDA KV tensors. vLLM 0.33 allocates every
   attention backend's KV cache with one allocator (`allocate_kv_cache`) in one of the
   `KVCacheLayout`s (FlashAttention and FlashInfer take any; the engine resolves one):
   for every layout, two caches are allocated on the GPU by vLLM's own allocator, each
   layer's view is described with `TensorLayout.of` exactly as the connector's worker
   does, blocks are copied with `pull_ranges_for_layers` as device byte copies, and the
   copied blocks must equal their sources element for element (others stay untouched).
   Then unequal tensor parallelism, heads split on those CUDA tensors: for every layout,
   P TP1 -> D TP2 and P TP2 -> D TP1 with 4 KV heads (2 per rank at TP2), each rank's
   cache allocated by vLLM, each layout derived as the worker derives it (block dim,
   heads dim asked of vLLM: `connectors.vllm_adapter.locate_kv_head_dim`), each decode
   rank's reads from `pdconnect.tpmap`, copied through `TensorLayout.head_slice` ranges.
   The oracle is torch's own slicing: the heads dim is the one dim whose size differs
   between a TP1 and a TP2 rank's tensor, and every head of every copied block must equal
   the prefill rank's head it came from (values, compared as raw bits), the bytes read
   must be pairs x layers x heads per rank x block bytes per head, nothing else written.
2. **engines** — for each transport (NIXL, Mooncake) and attention backend
   (FLASH_ATTN, FLASHINFER): a prefill and a decode engine with `PDConnector` and one
   colocated engine, all on the one GPU, the tiny hybrid Llama with its EAGLE3 draft
   (`pdconnect.testbed.tinymodel`). `x+a` then the sibling `x+b` go prefill-then-decode;
   the same two prompts go to the colocated engine. Decode must pull all of `x+a`, hit
   locally on `x+b` exactly what the colocated engine hits there (and more than
   nothing), and generate the colocated engine's tokens.

The engines are started and driven with the CPU suite's own rig (`pdconnect.testbed`:
the tiny-engine recipe, `Cluster`, the request helpers of `engine_calls`), so the GPU
run checks what the CPU tests check, on CUDA.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Refused (no GPU, wrong stack), as opposed to 1: a check ran and failed.
EXIT_REFUSED = 2
TRANSPORTS = ("nixl", "mooncake")
BACKENDS = ("FLASH_ATTN", "FLASHINFER")
VLLM_SERIES = "0.33."


class Refused(Exception):
    """The machine cannot run the check; the message says why and what to do."""


# --------------------------------------------------------------------------- preflight


def find_nvidia_gpus() -> list[str]:
    """The NVIDIA GPUs the driver reports, without importing torch (empty when none)."""
    gpus_dir = Path("/proc/driver/nvidia/gpus")
    found = sorted(p.name for p in gpus_dir.iterdir()) if gpus_dir.is_dir() else []
    smi = shutil.which("nvidia-smi")
    if not found and smi:
        proc = subprocess.run([smi, "-L"], check=False, capture_output=True, text=True, timeout=30)
        found = [line for line in proc.stdout.splitlines() if line.startswith("GPU ")]
    return found


def preflight() -> list[str]:
    gpus = find_nvidia_gpus()
    if not gpus:
        raise Refused(
            "no CUDA device: no NVIDIA GPU on this machine (no /proc/driver/nvidia/gpus, and nvidia-smi "
            f"{'lists none' if shutil.which('nvidia-smi') else 'is not installed'}): nothing was checked. "
            "Run `make gpu-check` on a machine with an NVIDIA GPU and its driver."
        )
    return gpus


def cuda_stack() -> tuple[Any, str]:
    """(torch, vLLM version) once CUDA torch and vLLM 0.33 are importable."""
    try:
        import torch
    except ImportError as exc:
        raise Refused(
            f"torch is not importable ({exc}): run through `make gpu-check`, which "
            "installs the CUDA stack into build/venv-gpu"
        ) from None
    if not torch.cuda.is_available():
        raise Refused(
            f"torch {torch.__version__} sees no CUDA device (CUDA build: "
            f"{torch.version.cuda or 'no'}): nothing was checked"
        )
    try:
        import vllm
    except ImportError as exc:
        raise Refused(f"vLLM is not importable ({exc}): `make gpu-check` installs vllm==0.33.0") from None
    if not vllm.__version__.startswith(VLLM_SERIES):
        raise Refused(f"this check is written against vLLM {VLLM_SERIES}x's allocator; found {vllm.__version__}")
    return torch, vllm.__version__


# ------------------------------------------------------------------------------ layouts

# Small and distinct: the block count must equal no other dim (heads 2, tokens 16,
# bytes per token-head 256), as `locate_block_dim` requires.
NUM_BLOCKS = 37
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
# (local block, remote block): out of order, including block 0 and the last block.
BLOCK_PAIRS = [(0, 5), (7, 0), (36, 17), (3, 36), (20, 21)]


def check_layouts(torch: Any, device: str) -> list[str]:
    """Failures (empty: all passed) of kvlayout on vLLM 0.33's own KV allocations."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from pdconnect.kvlayout import TensorLayout, locate_block_dim, pull_ranges_for_layers

    failures: list[str] = []
    for layout in KVCacheLayout:
        try:
            _, local = _allocate(torch, device, layout, 2)
            _, remote = _allocate(torch, device, layout, 2)
            remote_bytes = _storage_bytes(torch, remote[LAYERS[0]])
            remote_bytes.random_(0, 256)
            local_bytes = _storage_bytes(torch, local[LAYERS[0]])

            def describe(view: Any) -> TensorLayout:
                # What connectors/worker.py does with each registered tensor.
                return TensorLayout.of(view, block_dim=locate_block_dim(tuple(view.shape), NUM_BLOCKS))

            ranges = pull_ranges_for_layers(
                [describe(local[n]) for n in LAYERS], [describe(remote[n]) for n in LAYERS], BLOCK_PAIRS
            )
            local_base, remote_base = local_bytes.data_ptr(), remote_bytes.data_ptr()
            for local_addr, remote_addr, length in ranges:
                lo, ro = local_addr - local_base, remote_addr - remote_base
                local_bytes[lo : lo + length].copy_(remote_bytes[ro : ro + length])
            if device == "cuda":
                torch.cuda.synchronize()
            copied = {lb for lb, _ in BLOCK_PAIRS}
            before = len(failures)
            for name in LAYERS:
                # Compared as bytes: random bytes are NaNs in bf16, and NaN != NaN.
                mine, theirs = local[name].view(torch.uint8), remote[name].view(torch.uint8)
                for lb, rb in BLOCK_PAIRS:
                    if not torch.equal(mine[lb], theirs[rb]):
                        failures.append(f"{layout.name}: {name} block {lb} != remote block {rb}")
                untouched = [b for b in range(NUM_BLOCKS) if b not in copied]
                if int(mine[untouched].count_nonzero()) != 0:
                    failures.append(f"{layout.name}: {name}: a block outside the pairs was written")
            verdict = "blocks equal" if len(failures) == before else f"{len(failures) - before} mismatches"
            print(
                f"  layout {layout.name:6} view {tuple(local[LAYERS[0]].shape)} strides "
                f"{tuple(local[LAYERS[0]].stride())}: {len(ranges)} ranges, "
                f"{sum(n for _, _, n in ranges)} bytes, {verdict}",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - every layout is reported, not just the first
            failures.append(f"{layout.name}: {type(exc).__name__}: {exc}")
    return failures


# Unequal TP: model-wide KV heads (2 per rank at TP2) and the pairings checked.
UNEQUAL_HEADS = 4
UNEQUAL_PAIRINGS = ((1, 2), (2, 1))  # (prefill TP, decode TP)


def _allocate(torch: Any, device: str, layout: Any, kv_heads: int) -> tuple[Any, dict[str, Any]]:
    """One rank's KV cache (`kv_heads` heads per layer) from vLLM's own allocator, in `layout`."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=16, num_kv_heads=kv_heads, head_size=64, dtype=torch.bfloat16)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, len(LAYERS), layout)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=len(LAYERS) * NUM_BLOCKS * spec.page_size_bytes,
                layers=list(LAYERS),
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    return spec, allocate_kv_cache(config, torch.device(device), layout)


def _worker_layout(view: Any, spec: Any) -> Any:
    """What connectors/worker.py registers for a KV view: block dim, heads dim asked of vLLM."""
    from connectors.vllm_adapter import locate_kv_head_dim
    from pdconnect.kvlayout import TensorLayout, locate_block_dim

    block_dim = locate_block_dim(tuple(view.shape), NUM_BLOCKS)
    return TensorLayout.of(view, block_dim=block_dim, head_dim=locate_kv_head_dim(spec, tuple(view.shape), block_dim))


def _tpmap_reads(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[Any]:
    from pdconnect.tpmap import GroupHeads, group_reads

    return group_reads(prefill_tp, decode_tp, GroupHeads(UNEQUAL_HEADS), decode_rank)


def _oracle_heads_dim(narrow: Any, wide: Any) -> int:
    """The heads dim as torch shows it: the one dim whose size differs between a rank's
    tensor with fewer heads and one with more (everything else is the same spec)."""
    differing = [d for d, (a, b) in enumerate(zip(narrow.shape, wide.shape)) if a != b]
    if len(differing) != 1:
        raise AssertionError(f"shapes {tuple(narrow.shape)} and {tuple(wide.shape)} differ in dims {differing}")
    return differing[0]


def check_unequal_tp(torch: Any, device: str, reads: Any = _tpmap_reads, layouts: Any = None) -> list[str]:
    """Failures (empty: all passed) of head-split pulls between unequal TP ranks' caches.

    `reads(prefill_tp, decode_tp, decode_rank)` -> `HeadRead`s (the connector's map by
    default; tests hand in a wrong one to see the check fail). `layouts`: the
    `KVCacheLayout`s to try (default: all).
    """
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from pdconnect.kvlayout import pull_ranges_for_layers

    failures: list[str] = []
    for layout in KVCacheLayout if layouts is None else layouts:
        for prefill_tp, decode_tp in UNEQUAL_PAIRINGS:
            name = f"{layout.name} P TP{prefill_tp} -> D TP{decode_tp}"
            try:
                failures += _check_pairing(torch, device, layout, prefill_tp, decode_tp, reads, pull_ranges_for_layers)
            except Exception as exc:  # noqa: BLE001 - every pairing and layout is reported
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return failures


def _check_pairing(
    torch: Any, device: str, layout: Any, prefill_tp: int, decode_tp: int, reads: Any, pull_ranges_for_layers: Any
) -> list[str]:
    name = f"{layout.name} P TP{prefill_tp} -> D TP{decode_tp}"
    prefill = [_allocate(torch, device, layout, UNEQUAL_HEADS // prefill_tp) for _ in range(prefill_tp)]
    decode = [_allocate(torch, device, layout, UNEQUAL_HEADS // decode_tp) for _ in range(decode_tp)]
    for _, views in prefill:
        _storage_bytes(torch, views[LAYERS[0]]).random_(0, 256)
    by_tp = {prefill_tp: prefill[0][1][LAYERS[0]], decode_tp: decode[0][1][LAYERS[0]]}
    heads_dim = _oracle_heads_dim(by_tp[max(by_tp)], by_tp[min(by_tp)])
    block_dim = _worker_layout(decode[0][1][LAYERS[0]], decode[0][0]).block_dim
    per_prefill, per_decode = UNEQUAL_HEADS // prefill_tp, UNEQUAL_HEADS // decode_tp
    # Bytes of one head of one block of one layer, K and V: tokens x 2 x head_size x 2 bytes.
    head_block_bytes = 16 * 2 * 64 * 2
    failures: list[str] = []
    for rank, (spec, views) in enumerate(decode):
        local_bytes = _storage_bytes(torch, views[LAYERS[0]])
        moved = 0
        for read in reads(prefill_tp, decode_tp, rank):
            source_spec, source_views = prefill[read.prefill_rank]
            mine = [_worker_layout(views[n], spec).head_slice(read.local_start, read.count) for n in LAYERS]
            theirs = [
                _worker_layout(source_views[n], source_spec).head_slice(read.remote_start, read.count) for n in LAYERS
            ]
            remote_bytes = _storage_bytes(torch, source_views[LAYERS[0]])
            local_base, remote_base = local_bytes.data_ptr(), remote_bytes.data_ptr()
            for local_addr, remote_addr, length in pull_ranges_for_layers(mine, theirs, BLOCK_PAIRS):
                lo, ro = local_addr - local_base, remote_addr - remote_base
                local_bytes[lo : lo + length].copy_(remote_bytes[ro : ro + length])
                moved += length
        if device == "cuda":
            torch.cuda.synchronize()
        want = len(BLOCK_PAIRS) * len(LAYERS) * per_decode * head_block_bytes
        if moved != want:
            failures.append(f"{name}: decode rank {rank} read {moved} bytes, needs {want}")
        # torch's slicing: model-wide head h is decode rank h // per_decode's head
        # h % per_decode, and prefill rank h // per_prefill's head h % per_prefill.
        for layer in LAYERS:
            for lb, rb in BLOCK_PAIRS:
                for local_head in range(per_decode):
                    head = rank * per_decode + local_head
                    source = prefill[head // per_prefill][1][layer]
                    got = views[layer].narrow(heads_dim, local_head, 1).select(block_dim, lb)
                    expected = source.narrow(heads_dim, head % per_prefill, 1).select(block_dim, rb)
                    # Compared as raw bits: random bytes are NaNs in bf16, and NaN != NaN.
                    if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
                        failures.append(f"{name}: rank {rank} {layer} block {lb} head {head} != prefill block {rb}")
        untouched = [b for b in range(NUM_BLOCKS) if b not in {lb for lb, _ in BLOCK_PAIRS}]
        outside = torch.tensor(untouched, device=device)
        failures += [
            f"{name}: rank {rank} {layer}: a block outside the pairs was written"
            for layer in LAYERS
            if int(views[layer].index_select(block_dim, outside).count_nonzero())
        ]
    view = decode[0][1][LAYERS[0]]
    print(
        f"  {name:22} view {tuple(view.shape)} strides {tuple(view.stride())} heads dim {heads_dim}: "
        f"{'heads equal torch slicing' if not failures else f'{len(failures)} mismatches'}",
        flush=True,
    )
    return failures


def _storage_bytes(torch: Any, view: Any) -> Any:
    """The whole backing allocation of a KV view as one flat uint8 tensor on its device."""
    flat = torch.empty(0, dtype=torch.uint8, device=view.device)
    flat.set_(view.untyped_storage())
    return flat


# ------------------------------------------------------------------------------ engines

PREFIX, SUFFIX, OUTPUT = 1024, 64, 16


@dataclass(frozen=True)
class EngineRun:
    transport: str
    backend: str
    failures: tuple[str, ...]
    summary: str


def _gpu_args(draft: Path, kv_transfer: dict[str, Any] | None, backend: str) -> list[str]:
    """The CPU suite's engine flags, with a GPU dtype (FlashAttention takes no float32),
    the backend asked for, and a share of the one GPU for each of the three engines."""
    from pdconnect.testbed.recipes import engine_args

    args = engine_args(draft, kv_transfer)
    args[args.index("--dtype") + 1] = "bfloat16"
    return [*args, "--attention-backend", backend, "--gpu-memory-utilization", "0.25"]


def check_engines(transport: str, backend: str) -> EngineRun:
    import httpx

    from pdconnect.bench.scrape import PrefixCacheCounters
    from pdconnect.testbed.engine_calls import REQUEST_TIMEOUT_S, completed, completion, prompt_ids, serve_pd, token_ids
    from pdconnect.testbed.processes import Cluster
    from pdconnect.testbed.recipes import MODEL_NAME, SPEC, pd_kv_transfer, vllm_server, warm_up
    from pdconnect.testbed.tinymodel import ensure_target_and_draft

    target, draft = ensure_target_and_draft(SPEC)
    # Mooncake's TCP lanes reject batches of thousands of small blocks by default; raised as the connector raises them.
    env = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}
    failures: list[str] = []
    with Cluster() as cluster, httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        engines = {}
        # One after the other: each engine sizes its KV cache from the memory still free.
        for role, kv in (
            ("colocated", None),
            ("prefill", pd_kv_transfer("kv_producer", transport)),
            ("decode", pd_kv_transfer("kv_consumer", transport)),
        ):
            proc = cluster.start(
                vllm_server(
                    f"gpu-{transport}-{backend}-{role}",
                    target,
                    port=cluster.free_port(),
                    served_model_name=MODEL_NAME,
                    args=_gpu_args(draft, kv, backend),
                    env=env,
                    startup_timeout_s=900.0,
                )
            )
            cluster.wait_healthy([proc])
            warm_up(proc.base_url, MODEL_NAME)
            engines[role] = proc.base_url
        x = prompt_ids(7001, PREFIX)
        xa, xb = x + prompt_ids(7002, SUFFIX), x + prompt_ids(7003, SUFFIX)
        first = serve_pd(client, engines["prefill"], engines["decode"], xa, OUTPUT)
        second = serve_pd(client, engines["prefill"], engines["decode"], xb, OUTPUT)
        colocated_tokens, colocated_hits = [], []
        for prompt in (xa, xb):
            before = PrefixCacheCounters.scrape(engines["colocated"], client)
            body = completed(completion(client, engines["colocated"], prompt, OUTPUT))
            colocated_hits.append((PrefixCacheCounters.scrape(engines["colocated"], client) - before).hits)
            colocated_tokens.append(token_ids(body))
    if first.decode.external_hits != len(xa):
        failures.append(f"x+a: decode pulled {first.decode.external_hits:.0f} tokens, expected all {len(xa)}")
    if second.decode.hits != colocated_hits[1] or colocated_hits[1] <= 0:
        failures.append(f"x+b: decode-local hit {second.decode.hits:.0f}, colocated engine {colocated_hits[1]:.0f}")
    for name, pd, colo in (("x+a", first.tokens, colocated_tokens[0]), ("x+b", second.tokens, colocated_tokens[1])):
        if pd != colo:
            failures.append(f"{name}: P/D tokens {pd} differ from the colocated engine's {colo}")
    summary = (
        f"x+a pulled {first.decode.external_hits:.0f}/{len(xa)}; x+b decode-local {second.decode.hits:.0f}"
        f" vs colocated {colocated_hits[1]:.0f}, pulled {second.decode.external_hits:.0f}"
    )
    return EngineRun(transport, backend, tuple(failures), summary)


# --------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--preflight", action="store_true", help="only check that an NVIDIA GPU is present (no torch/vLLM import)"
    )
    parser.add_argument("--part", choices=("all", "layouts", "engines"), default="all")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument(
        "--layouts-on-cpu",
        action="store_true",
        help="not a GPU check: part 1 only, on CPU tensors from the same vLLM 0.33 "
        "allocator (for working on this script or kvlayout without a GPU)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.layouts_on_cpu:
        import torch

        print("gpu-check --layouts-on-cpu: vLLM's allocate_kv_cache on CPU tensors (NOT a GPU check):")
        layout_failures = check_layouts(torch, "cpu")
        print("unequal TP, heads split (CPU tensors):")
        layout_failures += check_unequal_tp(torch, "cpu")
        print(*layout_failures, sep="\n  ", file=sys.stderr) if layout_failures else print("layouts: PASS (on CPU)")
        return 1 if layout_failures else 0
    try:
        gpus = preflight()
        if args.preflight:
            print(f"gpu-check: preflight ok: {len(gpus)} NVIDIA GPU(s)")
            return 0
        torch, vllm_version = cuda_stack()
    except Refused as exc:
        print(f"gpu-check: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(
        f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"vLLM {vllm_version}",
        flush=True,
    )
    failures: list[str] = []
    started = time.monotonic()
    if args.part in ("all", "layouts"):
        print("[layouts] vLLM's allocate_kv_cache on CUDA, every KVCacheLayout:", flush=True)
        failures += [f"layouts: {f}" for f in check_layouts(torch, "cuda")]
        print(
            "[layouts] unequal TP: each decode rank's heads of real CUDA KV tensors, every KVCacheLayout:", flush=True
        )
        failures += [f"unequal TP: {f}" for f in check_unequal_tp(torch, "cuda")]
    if args.part in ("all", "engines"):
        for transport in args.transports:
            for backend in args.backends:
                print(f"[engines] {transport} / {backend}: colocated, prefill, decode on one GPU", flush=True)
                try:
                    run = check_engines(transport, backend)
                except Exception as exc:  # noqa: BLE001 - report and go on to the next pair
                    failures.append(f"engines {transport}/{backend}: {type(exc).__name__}: {exc}")
                    continue
                print(f"  {run.summary}: {'ok' if not run.failures else 'FAILED'}", flush=True)
                failures += [f"engines {transport}/{backend}: {f}" for f in run.failures]
    elapsed = time.monotonic() - started
    if failures:
        print(f"gpu-check: FAILED ({len(failures)}) in {elapsed:.0f}s:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"gpu-check: PASS in {elapsed:.0f}s")
    return 0


if __name__ == "__main__":  # vLLM's CPU/CUDA workers may use spawn: keep the main guard
    sys.exit(main())
