"""genq's consumer against a bare aiohttp client (bench/_bare_stream.py) asking the same way
(whole answers, genq's default; --stream: both streamed) on one simulator: same interpreter, GC
settings and concurrency; whole processes measured, start-up CPU (an empty run) subtracted per
token. The seed's shape: thinking answers, lognormal lengths around 2,326 tokens, max_tokens
4,096, a chunk per token, 40 slots, real speed.

    python bench/throughput.py                  # the seed's shape (a few minutes)
    python bench/throughput.py --shape short    # 400-token answers, coarse chunks, 32 slots
    python bench/throughput.py --shape errors   # the same with 5 % answered 503
    python bench/throughput.py --shape fast     # 16-token answers as fast as it goes
    python bench/throughput.py --shape paced    # 160 requests/s: 32 slots, 0.2 s each
"""

from __future__ import annotations

import compileall
import json
import os
import sys
from pathlib import Path

import _common as kit

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


def consume(rs, sim, run: str, out: Path, stream: bool = False) -> dict:
    """One `genq consume --burst` over the run as it stands: wall, CPU, tokens written."""
    got = kit.timed(["consume", "--server", sim.url, "--burst", "--out", str(out),
                     *(["--stream"] if stream else [])], kit.genq_env(rs.url, run))
    return {**got, "tokens": sum(json.loads(line)["completion_tokens"]
                                 for p in out.glob("*.jsonl") for line in open(p, "rb"))}


def genq_round(rs, sim, dataset: Path, n: int, work: Path, stream: bool) -> dict:
    run = "seed"
    kit.genq("produce", str(dataset), "--once", "--max-tokens", "4096", redis_url=rs.url,
             run=run)
    r = rs.client()
    sim0, cmds0 = kit.proc_cpu_s(sim.proc.pid), kit.commandstats(r)
    got = consume(rs, sim, run, work / "out", stream)
    got["sim_cpu_s"] = kit.proc_cpu_s(sim.proc.pid) - sim0
    cmds1 = kit.commandstats(r)
    got["redis_cmds"] = sum(n - cmds0.get(c, 0) for c, n in cmds1.items() if c != "info")
    # Start-up alone: the same command on the run now settled (it exits at once).
    got["startup_cpu_s"] = consume(rs, sim, run, work / "empty")["cpu_s"]
    if (done := int(r.bitcount(f"genq:{run}:done"))) != n:
        raise RuntimeError(f"run {run}: {done} of {n} done")
    return got


def bare_round(sim, dataset: Path, n: int, slots: int, retry: bool, stream: bool) -> dict:
    def run(count: int) -> dict:
        return kit.timed(["--server", sim.url, "--dataset", str(dataset), "--n", str(count),
                          "--concurrency", str(slots), *(["--retry"] if retry else []),
                          *([] if stream else ["--whole"])], None,
                         script=kit.REPO / "bench" / "_bare_stream.py")

    sim0 = kit.proc_cpu_s(sim.proc.pid)
    got = run(n)
    sim_cpu, out = kit.proc_cpu_s(sim.proc.pid) - sim0, json.loads(got["stdout"])
    return {"wall_s": got["wall_s"], "cpu_s": got["cpu_s"], "tokens": out["tokens"],
            "sim_cpu_s": sim_cpu, "startup_cpu_s": run(0)["cpu_s"], "retries": out["retries"]}


def report(a, g: dict, b: dict, n: int) -> None:
    def per_token(x: dict) -> float:
        return 1e6 * (x["cpu_s"] - x["startup_cpu_s"]) / x["tokens"]

    def row(label: str, f, fmt: str, ratio: str = ".3f") -> tuple:
        return (label, format(f(g), fmt), format(f(b), fmt), format(f(g) / f(b), ratio))

    rows = [
        row("tokens/s (whole process)", lambda x: x["tokens"] / x["wall_s"], ".0f"),
        row("wall s", lambda x: x["wall_s"], ".1f"),
        row("CPU us per token, start-up subtracted", per_token, ".2f", ".2f"),
        ("CPU ms per task, whole process", f"{1000 * g['cpu_s'] / n:.3f}",
         f"{1000 * b['cpu_s'] / n:.3f}", f"{1000 * (g['cpu_s'] - b['cpu_s']) / n:+.3f} ms"),
        ("start-up CPU s", f"{g['startup_cpu_s']:.2f}", f"{b['startup_cpu_s']:.2f}", "-"),
        ("Redis commands per task", f"{g['redis_cmds'] / n:.1f}", "-", "-"),
        ("simulator CPU s", f"{g['sim_cpu_s']:.1f}", f"{b['sim_cpu_s']:.1f}", "-"),
    ]
    print(f"\nshape {a.shape}: {n} prompts, {g['tokens']:,} tokens (genq) / {b['tokens']:,} "
          f"(bare), simulator {' '.join(SHAPES[a.shape][0])}, {a.slots} slots; load average "
          f"before: {a.load_before}; answers {'streamed' if a.stream else 'whole'}, both\n")
    print(kit.table(rows, ("figure", "genq consume", "bare aiohttp", "genq/bare")))


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="seed")
    p.add_argument("--n", type=int, help="prompts (default: the shape's)")
    p.add_argument("--time-scale", type=float, help="override the shape's simulator speed")
    p.add_argument("--stream", action="store_true",
                   help="both stream their answers (default: both ask for whole answers)")
    a = p.parse_args()
    flags, a.slots, n, retry = SHAPES[a.shape]
    n = a.n or n
    if a.time_scale:
        flags = [*flags, "--time-scale", str(a.time_scale)]
    a.load_before = kit.load_average()
    # Both start from compiled bytecode, as an installed package does.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for package in ("common", "consumer", "genq", "bench"):
        compileall.compile_dir(kit.REPO / package, quiet=1)
    with kit.workdir() as work, kit.private_redis() as rs, kit.simulators(
            1, *flags, "--max-running-requests", str(a.slots)) as [sim]:
        dataset = kit.write_dataset(work / "prompts.jsonl", n)
        b = bare_round(sim, dataset, n, a.slots, retry, a.stream)
        g = genq_round(rs, sim, dataset, n, work, a.stream)
    report(a, g, b, n)
    kit.dump_json(a.json, {"shape": a.shape, "n": n, "stream": a.stream, "genq": g, "bare": b})
    return 0


if __name__ == "__main__":
    sys.exit(main())
