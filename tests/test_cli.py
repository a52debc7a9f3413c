"""The `pdconnect` command's own surface: `--version`, and help that shows each option's default."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.deploy_support import REPO


def _pdconnect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdconnect.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_version_prints_the_projects_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = _pdconnect("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pdconnect {version}"


def test_metrics_proxy_help_shows_the_defaults() -> None:
    result = _pdconnect("metrics-proxy", "--help")
    assert result.returncode == 0, result.stderr
    # Each option's block: its line in the help and the lines indented under it.
    blocks = {
        m.group(1): " ".join(m.group(2).split())
        for m in re.finditer(r"^  (--[\w-]+)(.*?)(?=^  -|\Z)", result.stdout, flags=re.MULTILINE | re.DOTALL)
    }
    for flag, default in (
        ("--listen", "0.0.0.0:9400"),
        ("--timeout", None),
        ("--max-bytes", None),
        ("--max-concurrent", None),
        ("--log-level", "info"),
    ):
        described = re.search(r"\(default: ([^)]+)\)", blocks[flag])
        assert described, f"{flag}: no default shown in {blocks[flag]!r}"
        if default is not None:
            assert described.group(1) == default, flag
