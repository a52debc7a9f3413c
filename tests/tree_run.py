"""A Python tool run over one source tree, that tree first on PYTHONPATH, for the static gates.

The venv's editable install points at another checkout (/work/main): without the tree
first on PYTHONPATH, mypy and import-linter would check that checkout instead of this one
(or of a planted copy).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["run_python_in"]


def run_python_in(root: Path, *args: str, timeout: float, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python *args` in `root` with `root` first on PYTHONPATH; its output captured, exit status unchecked."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        cwd=root,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
