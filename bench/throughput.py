"""genq's consumer against a bare aiohttp client (bench/_bare_stream.py) asking the same way
(whole answers; --stream: both streamed) on one simulator, start-up CPU subtracted per token.
--servers N: instead, N servers x --slots, a `genq consume --burst` each on one run.

    python bench/throughput.py [--shape seed|short|errors|fast|paced] [--stream] [--n N]
    python bench/throughput.py --servers 4 --slots 32 --request-s 0.2 --per-server 3000
"""

from __future__ import annotations

import compileall
import json
import os
import sys
import time
from pathlib import Path

import _common as kit

DECODE_TPS, TTFT = 87.5, 0.5  # the simulator's defaults
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
    got = kit.timed(["consume", "--server", sim.url, "--burst", "--out", str(out),
                     *(["--stream"] if stream else [])], kit.genq_env(rs.url, run))
    return {**got, "tokens": sum(json.loads(line)["completion_tokens"]
                                 for p in out.glob("*.jsonl") for line in open(p, "rb"))}


def genq_round(rs, sim, dataset: Path, n: int, work: Path, stream: bool) -> dict:
    run, r = "seed", rs.client()
    kit.produce_once(rs.url, run, dataset, "--max-tokens", "4096")
    sim0, cmds0 = kit.proc_cpu_s(sim.proc.pid), kit.redis_use(r)[1]
    got = consume(rs, sim, run, work / "out", stream)
    got["sim_cpu_s"] = kit.proc_cpu_s(sim.proc.pid) - sim0
    got["redis_cmds"] = kit.redis_use(r)[1] - cmds0
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


def servers_run(a, work: Path) -> dict:
    n = a.servers * a.per_server
    dataset = kit.write_dataset(work / "prompts.jsonl", n)
    if a.request_s:  # every request takes request_s: 16 tokens streamed over that time
        flags = ["--time-scale", "1", "--ttft", "0", "--length-dist", "fixed:16",
                 "--decode-tps", str(16 / a.request_s)]
    else:
        flags = ["--time-scale", str(a.time_scale), "--length-dist", f"fixed:{a.tokens}"]
    flags += ["--max-running-requests", str(a.slots)]
    with kit.simulators(a.servers, *flags) as sims, kit.private_redis() as rs:
        kit.produce_once(rs.url, "many", dataset)
        r = rs.client()
        use0, (busy0, all0) = kit.redis_use(r), kit.machine_cpu()
        sim0 = [kit.proc_cpu_s(s.proc.pid) for s in sims]
        t0 = time.monotonic()
        with kit.LoadSampler([s.url for s in sims], period=a.sample) as sampler:
            procs = [kit.consumer(rs.url, "many", "--server", sim.url, "--burst", "--out",
                                  str(work / f"out{i}"), "--name", f"c{i}",
                                  log=work / f"consumer{i}.log") for i, sim in enumerate(sims)]
            first: dict[int, tuple[float, float]] = {}  # the moment and CPU of a first result

            def tick() -> None:
                for i, proc in enumerate(procs):
                    if i not in first and proc.returncode is None and any(
                            f.stat().st_size for f in (work / f"out{i}").glob("*.jsonl")):
                        first[i] = (time.monotonic() - t0, kit.proc_cpu_s(proc.pid))

            got = kit.reap(procs, tick, period=0.01)
            consumers = [{"rc": rc, "cpu_s": cpu, "wall_s": at - t0, "first_s": t, "first_cpu_s": c}
                         for i, (rc, cpu, at) in enumerate(got[p.pid] for p in procs)
                         for t, c in [first.get(i, (0.0, 0.0))]]
        busy1, all1 = kit.machine_cpu()
        done = int(r.bitcount("genq:many:done"))
        redis_cpu, redis_cmds = (b - a for a, b in zip(use0[:2], kit.redis_use(r), strict=False))
        r.close()
        for i, c in enumerate(consumers):
            if c["rc"] != 0:
                log = (work / f"consumer{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"consumer {i} exited {c['rc']}:\n{log}")
            c["tasks"] = sum(1 for p in (work / f"out{i}").glob("*.jsonl") for _ in open(p, "rb"))
            c["sim_cpu_s"] = kit.proc_cpu_s(sims[i].proc.pid) - sim0[i]
            lo, hi = kit.full_window(sampler.samples[i], a.slots)
            idle, waiting = kit.slot_seconds(sampler.samples[i], a.slots, lo, hi)
            c.update(steady_s=hi - lo, idle_slot_s=idle, waiting_req_s=waiting)
    if done != n:
        raise RuntimeError(f"done={done}, expected {n}")
    return {"consumers": consumers, "redis_cpu_s": redis_cpu, "redis_cmds": redis_cmds,
            "machine_busy_s": busy1 - busy0, "machine_all_s": all1 - all0,
            "wall_s": max(c["wall_s"] for c in consumers), "n": n}


def servers_report(a, got: dict) -> None:
    d = a.request_s or (TTFT + a.tokens / DECODE_TPS) / a.time_scale
    ideal = a.slots / d
    rows = []
    for i, c in enumerate(got["consumers"]):
        wall, cpu = c["wall_s"] - c["first_s"], c["cpu_s"] - c["first_cpu_s"]
        share = cpu / wall if wall > 0 else 0.0
        occupancy = (1 - c["idle_slot_s"] / (a.slots * c["steady_s"])) if c["steady_s"] else 0
        rows.append((i, c["tasks"], f"{c['tasks'] / wall:.1f}", f"{c['tasks'] / wall / ideal:.2f}",
                     f"{100 * occupancy:.1f}", f"{c['waiting_req_s']:.1f}",
                     f"{100 * share:.1f}", f"{1000 * cpu / max(1, c['tasks']):.2f}",
                     f"{1 / share:.1f}" if share else "-",
                     f"{c['tasks'] / cpu:.0f}" if cpu > 0 else "-"))
    print(f"\n{a.servers} servers x {a.slots} slots ({os.cpu_count()} cores), {a.per_server} "
          f"prompts each, {d:.2f} s requests (ideal {ideal:.1f} req/s a server); load "
          f"{a.load_before}; tasks/s and CPU from a consumer's first result to its exit\n")
    print(kit.table(rows, ("server", "tasks", "tasks/s", "of ideal", "slots busy % (steady)",
                           "waiting req-s", "consumer CPU % of a core", "CPU ms/task",
                           "servers like it per core", "tasks/s a core could take")))
    cons, sims = (sum(c[k] for c in got["consumers"]) for k in ("cpu_s", "sim_cpu_s"))
    wall, busy = got["wall_s"], got["machine_busy_s"] / got["machine_all_s"]
    share = 100 * cons / wall / (os.cpu_count() or 1)
    n = got["n"]
    print(f"\nwall {wall:.1f} s; CPU s: consumers {cons:.1f} ({share:.1f} % of the machine), "
          f"simulators {sims:.1f}, Redis {got['redis_cpu_s']:.1f} ({got['redis_cmds'] / n:.1f} "
          f"commands, {1000 * got['redis_cpu_s'] / n:.3f} ms a task); machine {100 * busy:.0f} % "
          f"busy; load after {kit.load_average()}")


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="seed")
    p.add_argument("--n", type=int, help="prompts (default: the shape's)")
    p.add_argument("--stream", action="store_true", help="both stream their answers")
    p.add_argument("--servers", type=int, help="instead: this many servers, a consumer each")
    p.add_argument("--slots", type=int, default=64, help="--servers: slots per server")
    p.add_argument("--per-server", type=int, default=1000, help="--servers: prompts per server")
    p.add_argument("--tokens", type=int, default=2000, help="--servers: tokens per completion")
    p.add_argument("--time-scale", type=float, default=20.0, help="--servers: simulator speed-up")
    p.add_argument("--request-s", type=float, help="--servers: every request this long instead")
    p.add_argument("--sample", type=float, default=0.2, help="--servers: load sampling period, s")
    a = p.parse_args()
    a.load_before = kit.load_average()
    if a.servers:
        with kit.workdir() as work:
            got = servers_run(a, work)
        servers_report(a, got)
        kit.dump_json(a.json, got)
        return 0
    flags, a.slots, n, retry = SHAPES[a.shape]
    n = a.n or n
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
