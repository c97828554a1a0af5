"""The import graph, read from the source: no import circle anywhere in the product, the
services (producer, consumer, monitor) never import each other, and common/ imports none of
them. TYPE_CHECKING imports count: a circle hidden behind one is a circle all the same."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGES = ("common", "consumer", "producer", "monitor", "genq", "simulator")
SERVICES = ("producer", "consumer", "monitor")


def modules() -> dict[str, Path]:
    """Each module by its installed name: common/x.py is genq.common.x (genq/common links it)."""
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if package == "genq" and (REPO / "genq" / parts[1]).is_symlink():
                continue  # the linked folders are walked under their own names
            name = ".".join(parts if package == "genq" else ("genq", *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    deps.add(child if child in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        edges[name] = {d for d in deps if d in mods and d != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert cycles(graph()) == []


def test_the_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_services_import_common_never_each_other():
    crossing = sorted(
        f"{name} -> {dep}"
        for name, deps in graph().items()
        for dep in deps
        if dep.split(".")[1] in SERVICES
        and name.split(".")[1] in (*SERVICES, "common")
        and dep.split(".")[1] != name.split(".")[1]
    )
    assert crossing == []
