"""The static gates over all the Python we write, so `make test` runs them (`make lint` too).

`ruff check` (the rule set in `[tool.ruff.lint]`), `ruff format --check` and `mypy`
(`[tool.mypy]`: strict on the installed packages pdconnect/ and connectors/, its defaults on
tests/, benchmarks/ and scripts/), each with the versions pinned in the `test` extra. Each
test also checks that its tool looked at every module of those trees and nothing else, and
that a planted violation is reported, so a configuration that checks nothing fails.

mypy keeps its cache in build/mypy-cache: ~25 s from nothing, ~12 s after.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

from tests.tree_run import run_python_in

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pdconnect", "connectors")  # installed, and checked strictly
CHECKED = (*PACKAGES, "tests", "benchmarks", "scripts")


def _modules(trees: tuple[str, ...] = CHECKED) -> set[str]:
    return {
        str(path.relative_to(REPO))
        for name in trees
        for path in (REPO / name).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_python_in(REPO, "-m", *args, stdin=stdin, timeout=300)


def test_ruff_check() -> None:
    result = _run("ruff", "check", "--no-fix", "--output-format", "concise")
    assert result.returncode == 0, result.stdout + result.stderr
    listed = _run("ruff", "check", "--show-files")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert {str(Path(line).relative_to(REPO)) for line in listed.stdout.split()} == _modules()
    for tree in CHECKED:
        planted = _run("ruff", "check", "--no-fix", "--stdin-filename", f"{tree}/planted.py", "-", stdin="import os\n")
        assert planted.returncode == 1 and "F401" in planted.stdout, tree + planted.stdout + planted.stderr


def test_ruff_format() -> None:
    result = _run("ruff", "format", "--check")
    assert result.returncode == 0, (
        result.stdout + result.stderr + "\n(`ruff format` rewrites these files; the diff is the formatting)"
    )
    assert result.stdout.strip() == f"{len(_modules())} files already formatted", result.stdout
    planted = _run("ruff", "format", "--check", "--stdin-filename", "pdconnect/planted.py", "-", stdin="x = ( 1 )\n")
    assert planted.returncode == 1, planted.stdout + planted.stderr


def test_mypy() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"no issues found in {len(_modules())} source files" in result.stdout, result.stdout


def test_mypy_follows_every_vllm_module_imported() -> None:
    """mypy reads only the vLLM modules listed in pyproject (the rest are Any): a module
    the installed code starts importing must join the list, or its use goes unchecked.
    (What tests/ imports from vLLM beyond the list is Any: tests exercise it, they do not
    type it.)"""
    imported: set[str] = set()
    for module in _modules(PACKAGES):
        for node in ast.walk(ast.parse((REPO / module).read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and not node.level
                else []
            )
            imported.update(name for name in names if re.match(r"vllm(\.|$)", name))
    overrides = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    followed = {module for o in overrides if o.get("follow_imports") == "silent" for module in o["module"]}
    assert imported == followed
