"""Every bench script still runs: each one end to end with tiny arguments, its --json output
checked for the figures it reports. No timing is asserted (benchmarks are not tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SCRIPTS = {
    "consumer_throughput.py": ["--n", "60", "--rounds", "1"],
    "many_servers.py": ["--servers", "2", "--slots", "4", "--per-server", "30",
                        "--time-scale", "400", "--sample", "0.05"],
    "replay_story.py": ["--prompts", "60", "--servers", "2", "--slots", "4",
                        "--time-scale", "400", "--hand-delay", "0.2", "--around", "1",
                        "--visibility-timeout", "2", "--sample", "0.05", "--timeout", "60"],
    "redis_memory.py": ["--total", "5000", "--window", "64", "--settle", "0.5"],
}


def run_bench(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / name), *args], cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_bench_script_runs_and_reports(name: str, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = run_bench(name, *SCRIPTS[name], "--json", str(out))
    figures = json.loads(out.read_text())
    assert "|" in proc.stdout  # the table
    check = CHECKS[name]
    check(figures)


def check_throughput(f: dict) -> None:
    [(label, rounds)] = f["rounds"].items()
    assert label == "this"
    g, b = rounds["genq"][0], rounds["bare"][0]
    assert g["redis_cmds"] > 0 and g["steady_cpu_s"] > 0 and b["steady_wall_s"] > 0


def check_many(f: dict) -> None:
    assert f["n"] == 60 and len(f["consumers"]) == 2
    assert sum(c["tasks"] for c in f["consumers"]) == 60
    assert all(c["rc"] == 0 and c["cpu_s"] > 0 for c in f["consumers"])
    assert all(c["steady_s"] > 0 for c in f["consumers"])  # the servers' loads were sampled


def check_story(f: dict) -> None:
    for way in ("genq", "hand"):
        got = f[way]
        # Every prompt ends up in the data set; the truncated ones were redone at 8192.
        assert got["v2"] > 0 and got["tokens_kept"] > 0 and got["wall_s"] > 0
        assert got["tokens_completed"] >= got["tokens_kept"]
        assert "gpu_idle_s_around_pivot" in got and "aborted" in got
        assert got["tokens_busy_estimate"] > 0  # the servers' loads were sampled
    assert f["genq"]["tokens_kept"] == f["hand"]["tokens_kept"]  # same prompts, same lengths


CHECKS = {
    "consumer_throughput.py": check_throughput,
    "many_servers.py": check_many,
    "replay_story.py": check_story,
    "redis_memory.py": lambda f: {"once", "window"} <= set(f) or pytest.fail(f),
}
