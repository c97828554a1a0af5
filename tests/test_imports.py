"""The import graph, read from the source: floors that only go down (common/ is the ground and
imports nothing above it; the services stand on common/ and never import each other; genq/'s
command line stands on them all), and no import circle anywhere in the product. TYPE_CHECKING
and in-function imports count: a circle hidden behind one is a circle all the same."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import REPO, genq, genq_env

# Every top-level folder genq/ links in, so a new one cannot escape the floors unseen.
PACKAGES = tuple(sorted({p.name for p in (REPO / "genq").iterdir() if p.is_symlink()} | {"genq"}))
SERVICES = ("producer", "consumer", "monitor")
# Which floor each top-level folder stands on: a module imports only its own floor or lower.
# The simulator is a tool around the product and stands on common/ like a service.
FLOORS = {"common": 0, "producer": 1, "consumer": 1, "monitor": 1, "simulator": 1, "genq": 2}


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


def folder(module: str) -> str:
    """genq.common.x is common/; genq.cli (genq/'s own modules) is genq/."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or parts[1] in FLOORS else "genq"


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Each import of a module on a higher floor than the importer's, or of another service."""
    return sorted(
        f"{name} -> {dep}" for name, deps in edges.items() for dep in deps
        if FLOORS[folder(dep)] > FLOORS[folder(name)]
        or (FLOORS[folder(dep)] == FLOORS[folder(name)] == 1 and folder(dep) != folder(name)))


def test_every_folder_has_a_floor():
    assert set(PACKAGES) <= set(FLOORS)


def test_no_import_circle():
    assert cycles(graph()) == []


def test_floors_only_go_down():
    assert upward(graph()) == []


def test_the_conversation_domain_stands_on_the_ground():
    """common/turns/ (what a turn's prompt is, what follows it, where a conversation stands)
    reads only queue/ and common/'s loose modules, so data/, store/ and report/ read
    conversations as they read answers, and the consumer's turn loop stands above it."""
    ground = {"genq.common.turns", "genq.common.queue"}
    loose = {p.stem for p in (REPO / "common").glob("*.py")}
    above = sorted(f"{name} -> {dep}" for name, deps in graph().items()
                   if name.startswith("genq.common.turns") for dep in deps
                   if ".".join(dep.split(".")[:3]) not in ground
                   and not (dep.count(".") == 2 and dep.split(".")[2] in loose))
    assert above == []


def test_the_finder_sees_an_upward_import():
    edges = {"genq.common.x": {"genq.consumer.y"}, "genq.consumer.y": {"genq.common.z"},
             "genq.producer.p": {"genq.monitor.m"}, "genq.cli": {"genq.consumer.y"}}
    assert upward(edges) == ["genq.common.x -> genq.consumer.y",
                             "genq.producer.p -> genq.monitor.m"]


def test_the_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
    a machine the consumers keep busy (bench/scale.py --baseline): no logging framework, and with
    --json no table library either."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(orjson.dumps({"prompt": f"p {i}"}).decode() + "\n" for i in range(5)))
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    loaded = imported_by("status", *flags, redis_url=redis_url, run=run_name)
    assert "genq.common.report.status" in loaded  # it did read the run
    assert "structlog" not in loaded
    assert ("rich" in loaded) == (flags == ())
