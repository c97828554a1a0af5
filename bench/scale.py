"""The seed's scale end to end: 914,000 prompts, the windowed producer, consumers on fast
simulators, a monitor: wall, CPU per task, Redis above the empty server (start, peak, end),
`genq status` and /api/status mid-run and at the end, `genq export` under `ulimit -n 256` and
`genq recover` after FLUSHALL, checked against the run.

--baseline TREE: instead, once --warm tasks are done, that checkout's `genq status` (its own
directory on PYTHONPATH, the same interpreter) and this tree's take turns, --rounds rounds: wall
and CPU (wait4) of each call, median and worst; then the run stops. With --fresh N: `genq
produce` of a new run on a Redis started just before, to its first task queued, N rounds a tree.

    python bench/scale.py                          # 914,000 prompts
    python bench/scale.py --samples 4 --profile status.prof   # × 4, the mid-run status profiled
    git worktree add /tmp/base 30a5a45
    python bench/scale.py --samples 4 --baseline /tmp/base --rounds 15 [--busy 4]
    python bench/scale.py --baseline /tmp/base --fresh 5
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import _common as kit
from faultkit import Background
from pipeline import wait_for
from test_monitor import Monitor

from genq.common.queue.keys import RunKeys

RUN = "scale"


def produce_start(tree: Path, data: Path, marks: Path) -> float:
    """Seconds from `genq produce` (from `tree`) of a new run on a Redis started just now to its
    first task queued."""
    run = "fresh" + uuid.uuid4().hex[:8]
    with kit.private_redis() as srv:
        r, k = srv.client(), RunKeys(run)
        env = {**kit.genq_env(srv.url, run), "PYTHONPATH": str(tree), "XDG_STATE_HOME": str(marks)}
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "genq", "produce", str(data), "--window",
                                 "64"], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: r.llen(k.rq_queue) > 0, timeout=120, interval=0.01,
                     what=f"the first task queued by {tree}")
            return time.monotonic() - start
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            r.close()


def fresh(trees: dict[str, Path], total: int, rounds: int, json_path: str | None) -> int:
    took: dict[str, list[float]] = {name: [] for name in trees}
    with kit.workdir() as work:
        data = kit.write_dataset(work / "d.jsonl", total)
        for n in range(rounds):
            order = list(trees.items()) if n % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                took[name].append(produce_start(tree, data, work / "state"))
    print(f"genq produce of {total:,} prompts on a fresh Redis, {rounds} rounds a tree; load "
          f"{kit.load_average()}")
    print(kit.table([(name, f"{statistics.median(t):.2f}", f"{min(t):.2f}", f"{max(t):.2f}")
                     for name, t in took.items()],
                    ("first task queued", "median s", "min s", "max s")))
    kit.dump_json(json_path, {name: [round(x, 3) for x in t] for name, t in took.items()})
    return 0


def status_rounds(a, trees: dict[str, Path], r, env: dict) -> int:
    """Once --warm tasks are done, the trees' `genq status` taking turns, a round at a time."""
    done, calls = RunKeys(RUN).done, {name: [] for name in trees}
    wait_for(lambda: r.bitcount(done) >= a.warm, timeout=1800, what="the warm-up")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(a.busy)]
    try:
        cpu0, done_before = kit.machine_cpu(), r.bitcount(done)
        for n in range(a.rounds):
            for name, tree in list(trees.items())[::1 if n % 2 == 0 else -1]:
                got = kit.timed(["status"], env, tree=tree)
                calls[name].append((got["wall_s"], got["cpu_s"]))
        cpu1, done_after = kit.machine_cpu(), r.bitcount(done)
    finally:
        for proc in spinners:
            proc.terminate()
    rows, med = [], {}
    for name, got in calls.items():
        walls, cpus = [w for w, _ in got], [c for _, c in got]
        med[name] = statistics.median(walls), statistics.median(cpus)
        rows.append((name, f"{med[name][0]:.3f}", f"{max(walls):.3f}", f"{med[name][1]:.3f}",
                     f"{max(cpus):.3f}"))
    rows.append(("this / baseline", f"{med['this tree'][0] / med['baseline'][0]:.2f}", "",
                 f"{med['this tree'][1] / med['baseline'][1]:.2f}", ""))
    print(f"{a.total:,} prompts × {a.samples}, {a.consumers} consumers, {a.busy} spinning; done "
          f"{done_before:,} → {done_after:,} during the rounds, the machine "
          f"{(cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]):.0%} busy")
    print(kit.table(rows, ("genq status", "wall median s", "wall max s", "CPU median s",
                           "CPU max s")))
    kit.dump_json(a.json, {name: [{"wall_s": round(w, 3), "cpu_s": round(c, 3)} for w, c in got]
                           for name, got in calls.items()})
    return 0


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--total", type=int, help="prompts (default 914,000; --fresh: 1,000,000)")
    p.add_argument("--consumers", type=int, default=3)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--profile", help="cProfile the mid-run `genq status` into this file")
    p.add_argument("--baseline", type=Path, help="instead: this checkout's `genq status` and "
                   "this tree's taking turns mid-run")
    p.add_argument("--rounds", type=int, default=15, help="--baseline: rounds of status calls")
    p.add_argument("--busy", type=int, default=0, help="--baseline: processes spinning beside")
    p.add_argument("--warm", type=int, default=50_000, help="--baseline: tasks done first")
    p.add_argument("--fresh", type=int, default=0, metavar="N", help="--baseline, instead: N "
                   "rounds a tree of produce's start on a fresh Redis (1,000,000 prompts)")
    a = p.parse_args()
    if a.baseline:
        trees = {"baseline": a.baseline.resolve(), "this tree": kit.REPO}
        if not (trees["baseline"] / "genq" / "__main__.py").exists():
            raise SystemExit(f"{a.baseline} is not a genq checkout")
        if a.fresh:
            return fresh(trees, a.total or 1_000_000, a.fresh, a.json)
    a.total = a.total or 914_000
    tasks = a.total * a.samples
    k, lat = RunKeys(RUN), {}
    with kit.workdir() as work, kit.private_redis() as srv, \
            kit.simulators(a.consumers, *kit.FAST_SIM) as sims:
        r, env = srv.client(), kit.genq_env(srv.url, RUN)
        data = kit.write_dataset(work / "d.jsonl", a.total)
        base = int(r.info("memory")["used_memory"])

        def used_mb() -> float:  # above the empty server's
            return (int(r.info("memory")["used_memory"]) - base) / 2**20

        producer = Background(srv.url, RUN, "produce", str(data), "--samples", str(a.samples))
        wait_for(lambda: r.exists(k.done), timeout=600, what="the run registered")
        start_mb = peak_mb = used_mb()
        monitor = Monitor(srv.url, RUN, work)
        outs = [work / f"out{n}" for n in range(a.consumers)]
        started, cpu0 = time.monotonic(), kit.machine_cpu()
        procs = [kit.consumer(srv.url, RUN, "--server", sim.url, "--burst", "--out", str(out))
                 for sim, out in zip(sims, outs, strict=True)]
        if a.baseline:
            try:
                return status_rounds(a, trees, r, env)
            finally:
                for proc in procs:
                    proc.terminate()
                    proc.wait(timeout=60)
                producer.stop()
                monitor.proc.terminate()
        half = False

        def tick() -> None:
            nonlocal half, peak_mb
            if not half and r.bitcount(k.done) >= tasks // 2:
                half = True
                lat["status_mid_s"] = kit.latency(lambda: kit.genq("status", redis_url=srv.url,
                                                                   run=RUN))
                lat["api_mid_s"] = kit.latency(lambda: monitor.get("/api/status"))
                print(f"mid-run ({r.bitcount(k.done):,} of {tasks:,} done, load average "
                      f"{kit.load_average()}): genq status {lat['status_mid_s']} s, /api/status "
                      f"{lat['api_mid_s']} s", file=sys.stderr, flush=True)
                if a.profile:
                    subprocess.run([sys.executable, "-m", "cProfile", "-o", a.profile, "-m",
                                    "genq", "status"], cwd=kit.REPO, env=env, check=True,
                                   stdout=subprocess.DEVNULL)
            peak_mb = max(peak_mb, used_mb())

        cpu = {pid: g[1] for pid, g in kit.reap(procs, tick).items()}
        wall, (busy, total) = time.monotonic() - started, kit.machine_cpu()
        lat["status_end_s"] = kit.latency(lambda: kit.genq("status", redis_url=srv.url, run=RUN))
        lat["api_end_s"] = kit.latency(lambda: urllib.request.urlopen(monitor.url + "/api/status"))
        producer.stop()
        monitor.proc.terminate()
        end_mb, done = used_mb(), r.bitcount(k.done)
        shards = sum(len(list(out.glob("*.jsonl"))) for out in outs)
        export = kit.timed(["export", "--out", str(work / "all.jsonl")], env, nofile=256)
        exported = sum(1 for _ in open(work / "all.jsonl", "rb"))
        r.flushall()  # what a restart without persistence leaves
        recover = kit.timed(["recover", "--shards", *map(str, outs)], env, nofile=256)
        recovered = r.bitcount(k.done)
    if not done == exported == recovered == tasks:
        raise SystemExit(f"done {done}, exported {exported}, recovered {recovered}")
    figures = {
        "prompts": a.total, "samples": a.samples, "consumers": a.consumers, "shards": shards,
        "wall_s": round(wall, 1), "tasks_per_s": round(tasks / wall),
        "machine_busy": round((busy - cpu0[0]) / (total - cpu0[1]), 2),
        "consumer_cpu_ms_per_task": round(1000 * sum(cpu.values()) / tasks, 3),
        "redis_mb_start": round(start_mb, 1), "redis_mb_peak": round(peak_mb, 1),
        "redis_mb_end": round(end_mb, 1), "redis_b_per_task": round(end_mb * 2**20 / tasks, 1),
        **lat, "export": export, "recover": recover}
    print(kit.table([(key, str(value)) for key, value in figures.items()], ("figure", "value")))
    kit.dump_json(a.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
