"""`scripts/gpu_check.py` (make gpu-check): a clean refusal without a GPU, and its unequal-TP
check's CPU-runnable part.

The check itself needs an NVIDIA GPU and vLLM 0.33 (CUDA); on these machines what can be
proved is that it says so and exits 2 (refused) rather than crashing or passing: both
the full run (with this suite's interpreter) and the preflight `make gpu-check` runs
first with the system python, before it installs the CUDA stack.

The unequal-TP part (each decode rank's head slice of vLLM's KV tensors, P TP1 -> D TP2
and P TP2 -> D TP1) runs here on CPU tensors from the same vLLM allocator: it must pass
with the connector's head map, and fail when the map reads the wrong heads or a head
twice, so the day a GPU is lent it can tell a wrong CUDA layout from a right one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from pdconnect.tpmap import HeadRead

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402  (a script, not a package: imported from its directory)

# The refusal cannot be observed where there is a GPU; there `make gpu-check` runs for real.
without_a_gpu = pytest.mark.skipif(
    bool(gpu_check.find_nvidia_gpus()), reason="an NVIDIA GPU is present: run `make gpu-check` instead"
)
# The layouts vLLM's CUDA backends use: NHD (tokens outside heads) and HND, plus the
# layer-interleaved one, where a head's run of a block sits between other layers'.
LAYOUTS = [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BHLNC]


@without_a_gpu
@pytest.mark.parametrize("args", [[], ["--preflight"], ["--part", "layouts"]], ids=["full", "preflight", "layouts"])
def test_gpu_check_refuses_without_a_gpu(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == gpu_check.EXIT_REFUSED, (proc.returncode, proc.stdout, proc.stderr)
    assert "gpu-check: refused: no CUDA device: no NVIDIA GPU on this machine" in proc.stderr
    assert "nothing was checked" in proc.stderr
    assert "PASS" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_each_decode_rank_reads_its_heads_of_vllms_kv_tensors_as_torch_slices_them_cuda_layouts_on_cpu_tensor():
    assert gpu_check.check_unequal_tp(torch, "cpu", layouts=LAYOUTS) == []


def _wrong_heads(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[Any]:
    """Every decode rank of TP2 reads the prefill's first two heads (rank 1 should read 2-3)."""
    if (prefill_tp, decode_tp) == (1, 2):
        return [HeadRead(prefill_rank=0, remote_start=0, local_start=0, count=2)]
    return gpu_check._tpmap_reads(prefill_tp, decode_tp, decode_rank)


def _a_head_twice(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[Any]:
    """P TP2 -> D TP1: the right reads, then prefill rank 0's heads read again into the same place."""
    reads = gpu_check._tpmap_reads(prefill_tp, decode_tp, decode_rank)
    if (prefill_tp, decode_tp) == (2, 1):
        reads = [*reads, HeadRead(prefill_rank=0, remote_start=0, local_start=0, count=2)]
    return reads


def test_the_check_fails_when_a_decode_rank_reads_the_wrong_heads():
    failures = gpu_check.check_unequal_tp(torch, "cpu", reads=_wrong_heads, layouts=[KVCacheLayout.LBNHC])
    assert failures, "a wrong head map passed the check"
    assert all("P TP1 -> D TP2: rank 1" in f for f in failures), failures


def test_the_check_fails_when_a_head_is_read_twice():
    failures = gpu_check.check_unequal_tp(torch, "cpu", reads=_a_head_twice, layouts=[KVCacheLayout.LBHNC])
    # 5 pairs x 3 layers x 4 heads x 4096 bytes are needed; 2 heads more were read.
    assert failures == ["LBHNC P TP2 -> D TP1: decode rank 0 read 368640 bytes, needs 245760"]
