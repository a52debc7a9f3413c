"""The package boundaries, as import contracts (`[tool.importlinter]` in pyproject.toml), checked here.

`lint-imports` reads every import statement of `pdconnect`, `connectors` and
`benchmarks`: the product never imports the connector, vLLM or torch; the router
imports neither; the transports import nothing else of pdconnect; `pdconnect bench`
does not import the test rig; nothing installed imports `benchmarks/`. The contracts
are also shown to fail on a copy of the tree with violations planted in it, so a
configuration that checks nothing cannot pass.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.tree_run import run_python_in

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pdconnect", "connectors", "benchmarks")
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return run_python_in(root, "-c", LINT, "--no-cache", "--no-logo", timeout=120)


def test_the_import_contracts_hold() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "Contracts: 7 kept" in result.stdout, result.stdout


def test_the_contracts_catch_planted_violations(tmp_path: Path) -> None:
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    plants = {
        "pdconnect/router/usage.py": "import vllm",
        "pdconnect/transfer/ranges.py": "from pdconnect.protocol import Ack",
        "pdconnect/bench/report.py": "from pdconnect.testbed.paths import default_build_dir",
        "pdconnect/kvlayout.py": "import benchmarks",
    }
    for path, line in plants.items():
        with open(tmp_path / path, "a") as module:
            module.write(f"\n{line}  # planted by the test\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [line.rsplit(" BROKEN", 1)[0] for line in result.stdout.splitlines() if "BROKEN" in line]
    assert broken == [
        "pdconnect never imports the connector, vLLM, torch or transformers",
        "The router imports neither vLLM, torch, transformers nor the connector",
        "protocol at the bottom",  # the layers contract's name wraps in the report
        "The transports import nothing else of pdconnect",
        "pdconnect bench (the operator's tool) does not import the local test rig",
        # The connector imports kvlayout, which now imports benchmarks: a chain counts.
        "The connector uses the product's lower layers, never the router or the tools",
        "Nothing installed imports benchmarks/ (it is not packaged)",
    ], result.stdout


def test_modules_with_lazy_heavy_imports_load_none_at_import() -> None:
    """The contracts let the tiny-model generator import torch and transformers inside its
    functions; importing it (and the router, and both commands) must still load neither."""
    modules = [
        "pdconnect.testbed.tinymodel",
        "pdconnect.testbed.local_pd",
        "pdconnect.router.app",
        "pdconnect.cli",
        "pdconnect.bench.cli",
        "connectors.settings",
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(','.join(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == ""
