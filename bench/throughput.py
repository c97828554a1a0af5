"""genq's consumer against a bare streaming aiohttp client (bench/_bare_stream.py), side by
side on one simulator, at the shape users have: thinking answers split by a reasoning parser,
lognormal lengths around 2,326 tokens, max_tokens 4,096, one SSE chunk per token, 40 slots,
near real speed. Both get the same interpreter and GC settings, server and concurrency; whole
processes are measured, and each one's start-up CPU (an empty run) is reported apart and
subtracted per token. Redis commands are counted for genq (those inside scripts included).

    python bench/throughput.py                  # the seed's shape (a few minutes)
    python bench/throughput.py --shape short    # 400-token answers, coarse chunks, 32 slots
    python bench/throughput.py --shape errors   # the same with 5 % of requests answered 503
    python bench/throughput.py --shape fast     # 16-token answers as fast as the simulator goes
    python bench/throughput.py --shape paced    # 160 requests/s: 32 slots, 0.2 s each
"""

from __future__ import annotations

import argparse
import json
import shutil
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
    simulators,
    table,
    wait_rusage,
    write_dataset,
)

SHORT = ["--length-dist", "fixed:400", "--stream-interval", "16", "--time-scale", "10",
         "--ttft", "0"]
SHAPES = {  # name: (simulator flags, slots, prompts, the bare client retries refusals)
    "seed": (["--reasoning-parser", "qwen3", "--length-dist", "lognormal:2326:0.62",
              "--stream-interval", "1", "--time-scale", "1"], 40, 120, False),
    "short": (SHORT, 32, 3000, False),
    "errors": ([*SHORT, "--error-rate", "0.05"], 32, 3000, True),
    "fast": (["--length-dist", "fixed:16", "--stream-interval", "16", "--time-scale", "10000",
              "--ttft", "0"], 64, 20000, False),
    "paced": (["--length-dist", "fixed:16", "--stream-interval", "1", "--decode-tps", "80",
               "--ttft", "0"], 32, 3000, False),
}


def timed(args: list[str], env: dict | None = None) -> tuple[float, float, bytes]:
    """Run a process to its end: (wall s, CPU s, its stdout)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    rc, cpu = wait_rusage(proc, timeout=3600)
    if rc != 0:
        raise RuntimeError(f"{args[1:4]} exited {rc}:\n{proc.stderr.read().decode()[-3000:]}")
    return time.monotonic() - t0, cpu, proc.stdout.read()


def consume(rs, sim, run: str, out: Path) -> dict:
    """One `genq consume --burst` over the run as it stands: wall, CPU, tokens written."""
    wall, cpu, _ = timed([sys.executable, "-m", "genq", "consume", "--server", sim.url,
                          "--burst", "--out", str(out)], genq_env(rs.url, run))
    tokens = sum(json.loads(line)["completion_tokens"]
                 for p in out.glob("*.jsonl") for line in open(p, "rb"))
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens}


def genq_round(rs, sim, dataset: Path, n: int, run: str) -> dict:
    genq("produce", str(dataset), "--once", "--max-tokens", "4096", redis_url=rs.url, run=run)
    out = Path(tempfile.mkdtemp(prefix="genq-bench-out-"))
    r = rs.client()
    try:
        sim0, cmds0 = proc_cpu_s(sim.proc.pid), commandstats(r)
        got = consume(rs, sim, run, out)
        got["sim_cpu_s"] = proc_cpu_s(sim.proc.pid) - sim0
        cmds1 = commandstats(r)
        got["redis_cmds"] = sum(n - cmds0.get(c, 0) for c, n in cmds1.items() if c != "info")
        # Start-up alone: the same command on the run now settled (it exits at once).
        got["startup_cpu_s"] = consume(rs, sim, run, Path(tempfile.mkdtemp()))["cpu_s"]
        done = int(r.bitcount(f"genq:{run}:done"))
        if done != n:
            raise RuntimeError(f"run {run}: {done} of {n} done")
        return got
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bare_round(sim, dataset: Path, n: int, slots: int, retry: bool) -> dict:
    def run(count: int) -> tuple[float, float, bytes]:
        return timed([sys.executable, str(REPO / "bench" / "_bare_stream.py"), "--server",
                      sim.url, "--dataset", str(dataset), "--n", str(count), "--concurrency",
                      str(slots), *(["--retry"] if retry else [])])

    sim0 = proc_cpu_s(sim.proc.pid)
    wall, cpu, out = run(n)
    sim_cpu, got = proc_cpu_s(sim.proc.pid) - sim0, json.loads(out)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": got["tokens"], "sim_cpu_s": sim_cpu,
            "startup_cpu_s": run(0)[1], "retries": got["retries"]}


def report(a: argparse.Namespace, g: dict, b: dict, n: int) -> None:
    def per_token(x: dict) -> float:
        return 1e6 * (x["cpu_s"] - x["startup_cpu_s"]) / x["tokens"]

    rows = [
        ("tokens/s (whole process)", f"{g['tokens'] / g['wall_s']:.0f}",
         f"{b['tokens'] / b['wall_s']:.0f}",
         f"{(g['tokens'] / g['wall_s']) / (b['tokens'] / b['wall_s']):.3f}"),
        ("wall s", f"{g['wall_s']:.1f}", f"{b['wall_s']:.1f}", f"{g['wall_s'] / b['wall_s']:.3f}"),
        ("CPU us per streamed token, start-up subtracted", f"{per_token(g):.2f}",
         f"{per_token(b):.2f}", f"{per_token(g) / per_token(b):.2f}"),
        ("CPU ms per task, whole process", f"{1000 * g['cpu_s'] / n:.3f}",
         f"{1000 * b['cpu_s'] / n:.3f}",
         f"{1000 * (g['cpu_s'] - b['cpu_s']) / n:+.3f} ms"),
        ("start-up CPU s", f"{g['startup_cpu_s']:.2f}", f"{b['startup_cpu_s']:.2f}", "-"),
        ("Redis commands per task", f"{g['redis_cmds'] / n:.1f}", "-", "-"),
        ("simulator CPU s", f"{g['sim_cpu_s']:.1f}", f"{b['sim_cpu_s']:.1f}", "-"),
    ]
    print(f"\nshape {a.shape}: {n} prompts, {g['tokens']:,} tokens (genq) / {b['tokens']:,} "
          f"(bare), simulator {' '.join(SHAPES[a.shape][0])}, {a.slots} slots; load average "
          f"before: {a.load_before}\n")
    print(table(rows, ("figure", "genq consume", "bare aiohttp", "genq/bare")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="seed")
    p.add_argument("--n", type=int, help="prompts (default: the shape's)")
    p.add_argument("--time-scale", type=float, help="override the shape's simulator speed")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args()
    flags, a.slots, n, retry = SHAPES[a.shape]
    n = a.n or n
    if a.time_scale:
        flags = [*flags, "--time-scale", str(a.time_scale)]
    a.load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="genq-bench-"))
    try:
        dataset = write_dataset(work / "prompts.jsonl", n)
        with private_redis() as rs, simulators(
                1, *flags, "--max-running-requests", str(a.slots)) as [sim]:
            b = bare_round(sim, dataset, n, a.slots, retry)
            g = genq_round(rs, sim, dataset, n, "seed")
        report(a, g, b, n)
        dump_json(a.json, {"shape": a.shape, "n": n, "genq": g, "bare": b})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
