"""The router's modules import each other without a cycle, counting every import: at run
time, under TYPE_CHECKING or inside a function (a cycle hidden behind one of those is
still two modules that cannot be read, tested or moved apart)."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parent.parent / "pdconnect" / "router"


def _imports(package: Path, name: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its source."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        module = path.stem
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                if node.module.startswith(f"{name}."):
                    found.add(node.module.removeprefix(f"{name}.").split(".")[0])
                elif node.module == name:
                    found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(
                    alias.name.removeprefix(f"{name}.").split(".")[0]
                    for alias in node.names
                    if alias.name.startswith(f"{name}.")
                )
        graph[module] = (found & {p.stem for p in package.glob("*.py")}) - {module, "__init__"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle found by a depth-first walk (each reported once, from its first module)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return cycles


def test_the_router_modules_import_each_other_without_a_cycle() -> None:
    graph = _imports(ROUTER, "pdconnect.router")
    assert "flow" in graph and "request" in graph["flow"]  # the walk reads the package
    assert _cycles(graph) == []


def test_a_planted_cycle_is_found() -> None:
    assert _cycles({"engines": {"health"}, "health": {"engines"}, "app": {"engines"}}) == [
        ["engines", "health", "engines"]
    ]
