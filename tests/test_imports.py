"""The import graph, read from the source: no import circle anywhere in the product, the
services (producer, consumer, monitor) never import each other, and common/ imports none of
them. TYPE_CHECKING imports count: a circle hidden behind one is a circle all the same."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import REPO, genq, genq_env

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


def imported_by(*args: str, redis_url: str, run: str) -> set[str]:
    """The modules a real `genq *args` process imported (python -X importtime, on stderr)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "genq", *args],
                          env=genq_env(redis_url, run), capture_output=True, text=True,
                          timeout=60, check=True)
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("flags", [(), ("--json",)], ids=["table", "json"])
def test_status_starts_without_what_it_does_not_use(tmp_path, redis_url, run_name, flags):
    """`genq status` is a fresh interpreter each time, so what it imports is most of its time on
    a machine the consumers keep busy (bench/status_start.py): no logging framework, and with
    --json no table library either."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(orjson.dumps({"prompt": f"p {i}"}).decode() + "\n" for i in range(5)))
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    loaded = imported_by("status", *flags, redis_url=redis_url, run=run_name)
    assert "genq.common.report.status" in loaded  # it did read the run
    assert "structlog" not in loaded
    assert ("rich" in loaded) == (flags == ())
