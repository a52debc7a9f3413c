"""The package boundary: `pdconnect` (router pods, tools) never pulls in vLLM or torch."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "pdconnect.cli", "connectors.settings", "pdconnect.protocol", "pdconnect.envelope", "pdconnect.sidechannel",
    "pdconnect.notifier",
    "pdconnect.kvlayout", "pdconnect.transfer", "pdconnect.router.app", "pdconnect.testbed.processes",
    "pdconnect.testbed.tinymodel",
]


def test_pdconnect_modules_import_without_vllm_or_torch():
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}: importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_only_connectors_import_vllm():
    result = subprocess.run(["git", "grep", "-l", "-E", r"^\s*(from|import) vllm", "--", "pdconnect"],
                            capture_output=True, text=True)
    assert result.stdout.strip() == ""
