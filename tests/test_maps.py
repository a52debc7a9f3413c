"""The maps stay true: every package's docstring names each of its modules, and
docs/layout.md names every module of `pdconnect/` and `connectors/`, every file of
`benchmarks/`, and only paths that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pdconnect", "pdconnect/router", "pdconnect/transfer", "pdconnect/bench", "pdconnect/testbed", "connectors")
LAYOUT = REPO / "docs" / "layout.md"


def _parts(package: Path) -> list[str]:
    """A package's modules (file stems, `__init__` aside) and subpackages."""
    modules = [p.stem for p in sorted(package.glob("*.py")) if p.name != "__init__.py"]
    return modules + [p.name for p in sorted(package.iterdir()) if (p / "__init__.py").is_file()]


def _unnamed_in_docstring(package: Path) -> list[str]:
    """The parts of `package` its `__init__` docstring does not name as `part` (or `part.x`)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    return [part for part in _parts(package) if not re.search(rf"`{re.escape(part)}[`.(/]", doc)]


def _sections(text: str) -> dict[str, str]:
    """docs/layout.md's `## ` sections by the first backticked folder in their heading."""
    sections: dict[str, str] = {}
    for block in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        heading, _, body = block.partition("\n")
        folder = re.search(r"`([^`]+)/`", heading)
        if folder:
            sections[folder.group(1)] = body
    return sections


def _unlisted_in_layout(text: str) -> list[str]:
    """Every module of the packages (and file of benchmarks/) the section of its folder does not name."""
    sections = _sections(text)
    missing = []
    folders = [*PACKAGES, "benchmarks"]
    for folder in folders:
        files = sorted(p.name for p in (REPO / folder).glob("*.py") if p.name != "__init__.py")
        body = sections.get(folder, "")
        missing += [f"{folder}/{name}" for name in files if f"`{name}`" not in body]
    return missing


def _dead_paths(text: str) -> list[str]:
    """Backticked repository paths (tests/..., scripts/..., docs links) in docs/layout.md that do not exist."""
    cited = re.findall(r"`((?:tests|scripts|deploy|benchmarks|pdconnect|connectors)/[\w./-]+)`", text)
    cited += re.findall(r"\]\(([\w./-]+\.md)", text)
    return [path for path in cited if not ((REPO / path).exists() or (LAYOUT.parent / path).exists())]


def test_every_package_docstring_names_each_of_its_modules() -> None:
    unnamed = {package: _unnamed_in_docstring(REPO / package) for package in PACKAGES}
    assert {package: parts for package, parts in unnamed.items() if parts} == {}


def test_docs_layout_names_every_module_and_only_existing_paths() -> None:
    text = LAYOUT.read_text(encoding="utf-8")
    assert _unlisted_in_layout(text) == []
    assert _dead_paths(text) == []


def test_the_map_checks_fail_on_a_module_left_out(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""The map: `kept` does one thing."""\n')
    for name in ("kept", "forgotten"):
        (package / f"{name}.py").write_text('"""A module."""\n')
    assert _unnamed_in_docstring(package) == ["forgotten"]
    text = LAYOUT.read_text(encoding="utf-8")
    assert _unlisted_in_layout(text.replace("`flow.py`", "`flow`")) == ["pdconnect/router/flow.py"]
    assert _dead_paths(text + "\n`tests/test_never_written.py`\n") == ["tests/test_never_written.py"]
