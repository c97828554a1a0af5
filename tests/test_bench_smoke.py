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
    "throughput.py": ["--shape", "short", "--n", "40"],
    "restart.py --idle": ["--window", "1"],
    "throughput.py --servers": ["2", "--slots", "4", "--per-server", "30", "--time-scale",
                                "400", "--sample", "0.05"],
    "replay_story.py": ["--prompts", "60", "--servers", "2", "--slots", "4",
                        "--time-scale", "400", "--hand-delay", "0.2", "--around", "1",
                        "--visibility-timeout", "2", "--sample", "0.05", "--timeout", "60"],
    "scale.py --produce": ["64", "--total", "5000", "--settle", "0.5"],
    "scale.py": ["--total", "2000", "--consumers", "2"],
    "scale.py --baseline": [str(REPO), "--total", "2000", "--samples", "4",
                            "--consumers", "1", "--warm", "200", "--rounds", "2", "--busy", "1"],
    "restart.py": ["--n", "400", "--kill-at", "1.5", "--visibility-timeout", "2",
                   "--time-scale", "10"],
    "s3_shipping.py": ["--n", "300", "--shards", "2", "--outage", "1"],
    "s3_shipping.py --ages": ["0.5,1", "--shards", "2"],
    "token_ids.py": ["--records", "60"],
    "s3_dataset.py": ["--rows", "2000", "--seconds", "1"],
    "conversations.py": ["--conversations", "50", "--deadline", "60"],
    "chaos.py": ["--prompts", "80", "--faults", "2", "--fault-every", "0.5", "--servers", "1",
                 "--slots", "4", "--timeout", "120"],
}


def run_bench(name: str, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / name), *args], cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


# Runs against a real SGLang server: smoke-run in the real-server tier, below.
REAL_TIER = {"real_sglang.py"}


def test_every_bench_script_is_smoke_run() -> None:
    scripts = {p.name for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_")}
    assert scripts == {name.split()[0] for name in SCRIPTS} | REAL_TIER


@pytest.mark.real_sglang
def test_real_stream_cost_runs_against_a_real_server(tmp_path: Path) -> None:
    from sglang_servers import start_server

    server = start_server("real", "tuned")
    try:
        out = tmp_path / "figures.json"
        run_bench("real_sglang.py", "stream-cost", "--port", str(server.port), "--n", "8",
                  "--concurrency", "4", "--max-tokens", "32", "--rounds", "1",
                  "--json", str(out), timeout=600)
        figures = json.loads(out.read_text())
        assert figures["stream"][0]["tokens"] > 0 and figures["plain"][0]["tokens"] > 0
    finally:
        server.close()


@pytest.mark.real_sglang
def test_real_samples_runs_against_a_real_server(tmp_path: Path) -> None:
    from sglang_servers import start_server

    server = start_server("real", "tuned")
    try:
        out = tmp_path / "figures.json"
        run_bench("real_sglang.py", "samples", "--port", str(server.port), "--prompts", "2",
                  "--k", "2", "--max-tokens", "16", "--tries", "2", "--json", str(out),
                  timeout=600)
        figures = json.loads(out.read_text())
        assert figures["arms"] and "reproducible" in figures
    finally:
        server.close()


@pytest.mark.slow  # every bench script end to end: a soak of each
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_bench_script_runs_and_reports(name: str, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = run_bench(*name.split(), *SCRIPTS[name], "--json", str(out))
    figures = json.loads(out.read_text())
    assert "|" in proc.stdout or name == "chaos.py"  # the table (chaos prints its checks)
    CHECKS[name](figures)


def check_throughput(f: dict) -> None:
    g, b = f["genq"], f["bare"]
    assert g["tokens"] == b["tokens"] == 40 * 400  # the same answers, whole, on both sides
    assert g["redis_cmds"] > 0 and g["startup_cpu_s"] > 0 and b["startup_cpu_s"] > 0


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


def check_memory(f: dict) -> None:
    assert f["once"]["queued"] == 5000 and f["window"]["queued"] >= 64


def check_s3(f: dict) -> None:
    assert f["upload"]["shards_per_s"] > 0 and f["plain_s"] > 0 and f["shipping_s"] > 0
    assert f["outage"]["exit"] == 0


def check_conversations(f: dict) -> None:
    shape = f["dataset"]
    assert shape["rows"] == 50 and 1 <= shape["users_per_row"] <= 3
    assert shape["tool_calls_per_row"] >= shape["users_per_row"]  # a chain after each request
    for arm in f["args"]["arms"].split(","):
        got = f[arm]
        assert got["complete"] and got["generations"] >= 50 and got["consumer_cpu_s"] > 0
        assert got["redis_b_peak"] > 0 and got["export"]["wall_s"] > 0
    # Every turn made: the simulators (--tool-chains) close each chain where the row does, so
    # every conversation runs to its end, a generation for each of the rows' assistant turns.
    sys.path.insert(0, str(REPO / "bench"))
    import _conversations as data

    turns = sum(m["role"] == "assistant" for row in data.rows(50, f["args"]["seed"])
                for m in row["messages"])
    assert f["last"]["generations"] == 50 and f["all"]["stopped"] == {"complete": 50}
    assert f["all"]["generations"] == turns


CHECKS = {
    "throughput.py": check_throughput,
    "restart.py --idle": lambda f: set(f["share_of_a_core"]) == {"finished run", "spare",
                                                        "nothing to claim"} or pytest.fail(f),
    "throughput.py --servers": check_many,
    "replay_story.py": check_story,
    "scale.py --produce": check_memory,
    "scale.py": lambda f: f["shards"] >= 2 and f["redis_mb_peak"] > 0 and f["keys"]
    or pytest.fail(f),
    "scale.py --baseline": lambda f: (set(f) == {"baseline", "this tree"} and all(
        len(calls) == 2 and all(c["cpu_s"] > 0 for c in calls) for calls in f.values())
                                  ) or pytest.fail(f),
    "restart.py": lambda f: (f["killed"]["full_again_s"] > 0 and f["tasks_back_s"] > 0
                             and f["bare_full_again_s"] > 0) or pytest.fail(f),
    "s3_shipping.py": check_s3,
    "s3_dataset.py": lambda f: (f["done"] > 0 and f["consumer_peak_mb"] > 0) or pytest.fail(f),
    # Two ages: the shorter ships more requests an hour and risks fewer results.
    "s3_shipping.py --ages": lambda f: (
        [a["minutes"] for a in f["ages"]] == [0.5, 1.0]
        and f["ages"][0]["requests_per_hour"] > f["ages"][1]["requests_per_hour"] > 0
        and 0 < f["ages"][0]["at_risk_per_node"] < f["ages"][1]["at_risk_per_node"]
        or pytest.fail(f)),
    "chaos.py": lambda f: all(f["checks"].values()) or pytest.fail(f),
    "conversations.py": check_conversations,
    "token_ids.py": lambda f: (f["ids on"]["zstd_bytes"] > f["ids off"]["zstd_bytes"] > 0
                               and f["ids on"]["records"] == 60) or pytest.fail(f),
}


def test_conversation_rows_are_seeded_and_call_the_rows_first_tool() -> None:
    """bench/conversations.py's rows: the same for a seed, and shaped so that a simulator
    calling the request's first tool matches every tool turn (one call each)."""
    sys.path.insert(0, str(REPO / "bench"))
    import _conversations as data

    rows = list(data.rows(200, seed=3))
    assert rows == list(data.rows(200, seed=3)) and rows != list(data.rows(200, seed=4))
    assert data.row(3, 150) == rows[150]  # a row depends on (seed, index) alone
    for row in rows:
        first = row["tools"][0]["function"]["name"]
        messages = row["messages"]
        assert messages[0]["role"] == "system" and messages[-1]["role"] == "assistant"
        for at, m in enumerate(messages):
            if m["role"] == "user":  # a chain of 1-20 calls, then a final answer
                assert messages[at + 1].get("tool_calls")
            if m.get("tool_calls"):
                (call,) = m["tool_calls"]
                assert call["function"]["name"] == first
                assert messages[at + 1] == {"role": "tool", "tool_call_id": call["id"],
                                            "content": messages[at + 1]["content"]}
    assert 7 <= data.shape(rows)["assistant_turns_per_row"] <= 9.5
    # Each request's chain is as long as the simulator's --tool-chains makes it.
    from genq.simulator.toolcalls import chain_length

    for row in rows:
        chains: list[list[int]] = []
        for m in row["messages"][1:]:  # after the system prompt, a user request first
            if m["role"] == "user":
                chains.append([chain_length(m["content"], 3), 0])
            chains[-1][1] += bool(m.get("tool_calls"))
        assert all(want == got for want, got in chains)
