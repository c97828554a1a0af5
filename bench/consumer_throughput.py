"""Consumer throughput: one `genq consume --burst` against a simulator fast enough never to be
the bottleneck, side by side with an ideal bare client (same httpx client, bodies, concurrency
and server; no Redis, no disk). Reports tasks/s, client CPU per task, Redis commands and CPU
per task, and genq/bare ratios.

    python bench/consumer_throughput.py                 # 5000 prompts, 5 rounds each
    python bench/consumer_throughput.py --n 20000 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    REPO,
    commandstats,
    dump_json,
    genq,
    genq_env,
    load_average,
    private_redis,
    proc_cpu_s,
    redis_cpu_s,
    simulators,
    table,
    wait_rusage,
    write_dataset,
)

SIM_FLAGS = ["--time-scale", "10000", "--ttft", "0", "--length-dist", "fixed:16"]


def sim_flags(request_s: float | None) -> list[str]:
    """As fast as the simulator goes, or every request taking request_s (16 tokens streamed
    over that time): a paced server, where the question is whether genq keeps it as full as
    a bare client does."""
    if not request_s:
        return SIM_FLAGS
    return ["--time-scale", "1", "--ttft", "0", "--length-dist", "fixed:16",
            "--decode-tps", str(16 / request_s)]


def genq_round(rs, sim, dataset: Path, n: int, run: str, concurrency: int) -> dict:
    r = rs.client()
    genq("produce", str(dataset), "--once", redis_url=rs.url, run=run)
    out = Path(tempfile.mkdtemp(prefix="genq-bench-out-"))
    try:
        stats0, cmd0, rcpu0 = r.info("stats"), commandstats(r), redis_cpu_s(r)
        sim0 = proc_cpu_s(sim.proc.pid)
        flags = ["--concurrency", str(concurrency)] if concurrency else []
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "consume", "--server", sim.url, "--burst",
             "--out", str(out), *flags],
            cwd=REPO, env=genq_env(rs.url, run), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        # The first line in a shard marks the first result: up to then it is start-up (imports,
        # data set index, server probe). Watching the file keeps the bench's own Redis
        # commands out of the counts.
        t_first = c_first = None
        while proc.poll() is None:
            if any(p.stat().st_size > 0 for p in out.glob("*.jsonl")):
                t_first, c_first = time.monotonic(), proc_cpu_s(proc.pid)
                break
            time.sleep(0.002)
        rc, cpu = wait_rusage(proc, timeout=1800)
        t1 = time.monotonic()
        if rc != 0:
            raise RuntimeError(f"consume exited {rc}:\n{proc.stderr.read().decode()[-3000:]}")
        stats1, cmd1, rcpu1 = r.info("stats"), commandstats(r), redis_cpu_s(r)
        sim1 = proc_cpu_s(sim.proc.pid)
        done = int(r.bitcount(f"genq:{run}:done"))
        lines = sum(1 for p in out.glob("*.jsonl") for _ in open(p, "rb"))
        if done != n or lines != n:
            raise RuntimeError(f"run {run}: done={done} lines={lines}, expected {n}")
        cmds = {c: cmd1[c] - cmd0.get(c, 0) for c in cmd1
                if c != "info" and cmd1[c] > cmd0.get(c, 0)}  # not the bench's own INFO calls
        total = (stats1["total_commands_processed"] - stats0["total_commands_processed"]
                 - 3)  # the three INFO calls of the second snapshot
        return {"wall_s": t1 - t0, "cpu_s": cpu, "steady_wall_s": t1 - (t_first or t0),
                "steady_cpu_s": cpu - (c_first or 0.0), "redis_cmds": total,
                "redis_cmd_breakdown": cmds, "redis_cpu_s": rcpu1 - rcpu0,
                "sim_cpu_s": sim1 - sim0}
    finally:
        r.close()
        shutil.rmtree(out, ignore_errors=True)


def bare_round(sim, dataset: Path, n: int, concurrency: int) -> dict:
    sim0 = proc_cpu_s(sim.proc.pid)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "_bare_client.py"), "--server", sim.url,
         "--dataset", str(dataset), "--n", str(n), "--concurrency", str(concurrency)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    rc, cpu = wait_rusage(proc, timeout=1800)
    t1 = time.monotonic()
    if rc != 0:
        raise RuntimeError(f"bare client exited {rc}:\n{proc.stderr.read().decode()[-3000:]}")
    got = json.loads(proc.stdout.read())
    return {"wall_s": t1 - t0, "cpu_s": cpu, "steady_wall_s": got["steady_wall_s"],
            "steady_cpu_s": got["steady_cpu_s"], "loop_wall_s": got["wall_s"],
            "loop_cpu_s": got["cpu_s"], "sim_cpu_s": proc_cpu_s(sim.proc.pid) - sim0,
            "concurrency": got["concurrency"]}


def med(rounds: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5000, help="prompts per round (default 5000)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of each client, alternating; medians reported (default 5)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="simulator capacity, which is also the consumer's concurrency")
    p.add_argument("--concurrency", type=int, default=0,
                   help="override both clients' concurrency (default: the server's capacity)")
    p.add_argument("--request-s", type=float, default=None,
                   help="pace the simulator: every request takes this long (e.g. 0.2 with "
                        "--max-running-requests 32 is 160 req/s); default: as fast as it goes")
    p.add_argument("--json", help="also write every round's figures here")
    a = p.parse_args()
    a.load_before = load_average()  # other processes on a small machine move these figures
    work = Path(tempfile.mkdtemp(prefix="genq-bench-"))
    try:
        dataset = write_dataset(work / "prompts.jsonl", a.n)
        flags = [*sim_flags(a.request_s), "--max-running-requests", str(a.max_running_requests)]
        genq_rounds, bare_rounds = [], []
        with private_redis() as rs, simulators(1, *flags) as [sim]:
            for i in range(a.rounds):
                bare_rounds.append(bare_round(sim, dataset, a.n, a.concurrency))
                genq_rounds.append(genq_round(rs, sim, dataset, a.n, f"b{i}", a.concurrency))
                g, b = genq_rounds[-1], bare_rounds[-1]
                print(f"round {i + 1}: genq {a.n / g['steady_wall_s']:.0f} tasks/s, "
                      f"bare {a.n / b['steady_wall_s']:.0f} tasks/s", file=sys.stderr)
        report(a, genq_rounds, bare_rounds)
        dump_json(a.json, {"n": a.n, "genq": genq_rounds, "bare": bare_rounds})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(a: argparse.Namespace, g: list[dict], b: list[dict]) -> None:
    n = a.n
    rows = []

    def add(label: str, gv: float, bv: float | None, fmt: str) -> None:
        ratio = f"{gv / bv:.2f}" if bv else "-"
        rows.append((label, format(gv, fmt), format(bv, fmt) if bv is not None else "-", ratio))

    add("tasks/s, first result to exit", n / med(g, "steady_wall_s"),
        n / med(b, "steady_wall_s"), ".0f")
    gs = sorted(n / x["steady_wall_s"] for x in g)
    bs = sorted(n / x["steady_wall_s"] for x in b)
    rows.append(("tasks/s range over rounds", f"{gs[0]:.0f}-{gs[-1]:.0f}",
                 f"{bs[0]:.0f}-{bs[-1]:.0f}", "-"))
    add("tasks/s, process start to exit", n / med(g, "wall_s"), n / med(b, "wall_s"), ".0f")
    add("client CPU ms/task, first result to exit", 1000 * med(g, "steady_cpu_s") / n,
        1000 * med(b, "steady_cpu_s") / n, ".3f")
    add("client CPU ms/task, whole process", 1000 * med(g, "cpu_s") / n,
        1000 * med(b, "cpu_s") / n, ".3f")
    add("simulator CPU ms/task", 1000 * med(g, "sim_cpu_s") / n,
        1000 * med(b, "sim_cpu_s") / n, ".3f")
    add("Redis commands/task (incl. inside scripts)", med(g, "redis_cmds") / n, None, ".1f")
    add("Redis CPU ms/task", 1000 * med(g, "redis_cpu_s") / n, None, ".3f")
    print(f"\n{n} prompts, simulator {' '.join(sim_flags(a.request_s))} --max-running-requests "
          f"{a.max_running_requests}, concurrency {b[0]['concurrency']}, "
          f"median of {a.rounds} rounds; load average before: {a.load_before}\n")
    print(table(rows, ("figure", "genq consume", "bare client", "genq/bare")))
    mid = sorted(g, key=lambda x: x["redis_cmds"])[len(g) // 2]
    breakdown = sorted(mid["redis_cmd_breakdown"].items(), key=lambda kv: -kv[1])
    print("\nRedis commands per task by command (median round; script-internal calls count):")
    print(table([(name, f"{calls / n:.2f}", calls) for name, calls in breakdown],
                ("command", "per task", "calls")))


if __name__ == "__main__":
    sys.exit(main())
