"""`scripts/gpu_check.py` (make gpu-check) refuses cleanly on a machine without a GPU.

The check itself needs an NVIDIA GPU and vLLM 0.33 (CUDA); on these machines what can be
proved is that it says so and exits 2 (refused) rather than crashing or passing: both
the full run (with this suite's interpreter) and the preflight `make gpu-check` runs
first with the system python, before it installs the CUDA stack.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402  (a script, not a package: imported from its directory)

# The refusal cannot be observed where there is a GPU; there `make gpu-check` runs for real.
if gpu_check.find_nvidia_gpus():
    pytest.skip("an NVIDIA GPU is present: run `make gpu-check` instead", allow_module_level=True)


@pytest.mark.parametrize("args", [[], ["--preflight"], ["--part", "layouts"]], ids=["full", "preflight", "layouts"])
def test_gpu_check_refuses_without_a_gpu(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == gpu_check.EXIT_REFUSED, (proc.returncode, proc.stdout, proc.stderr)
    assert "gpu-check: refused: no NVIDIA GPU on this machine" in proc.stderr
    assert "nothing was checked" in proc.stderr
    assert "PASS" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
