"""`genq status` on a busy machine, this tree against a baseline checkout (its own directory on
PYTHONPATH, the same interpreter): a 914,000 × 4 run consumed by three consumers on fast
simulators (scale.py's settings) while the two trees' `genq status` take turns, a round at a
time; wall and CPU (wait4) of each call, median and worst.

    git worktree add /tmp/base 30a5a45
    python bench/status_start.py --baseline /tmp/base --rounds 15
    python bench/status_start.py --baseline /tmp/base --busy 4   # and 4 processes spinning
    python bench/status_start.py --baseline /tmp/base --fresh 5  # produce's start instead

--fresh N: `genq produce` of a new run (1,000,000 prompts) on a Redis started just before, from
the command to its first task queued, N rounds a tree.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _common as kit
from faultkit import Background
from pipeline import wait_for

from genq.common.queue.keys import RunKeys

RUN = "status"


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


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--baseline", required=True, type=Path, help="a checkout of the baseline")
    p.add_argument("--total", type=int, help="prompts (default 914,000; --fresh: 1,000,000)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--consumers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--fresh", type=int, default=0, metavar="N",
                   help="instead: N rounds a tree of produce's start on a fresh Redis")
    p.add_argument("--busy", type=int, default=0, help="processes spinning beside the run")
    p.add_argument("--warm", type=int, default=50_000,
                   help="samples done before the first round (default 50,000)")
    a = p.parse_args()
    trees = {"baseline": a.baseline.resolve(), "this tree": kit.REPO}
    for tree in trees.values():
        if not (tree / "genq" / "__main__.py").exists():
            raise SystemExit(f"{tree} is not a genq checkout")
    if a.fresh:
        return fresh(trees, a.total or 1_000_000, a.fresh, a.json)
    a.total = a.total or 914_000
    k, calls = RunKeys(RUN), {name: [] for name in trees}
    with kit.workdir() as work, kit.private_redis() as srv, \
            kit.simulators(a.consumers, *kit.FAST_SIM) as sims:
        r, env = srv.client(), kit.genq_env(srv.url, RUN)
        data = kit.write_dataset(work / "d.jsonl", a.total)
        producer = Background(srv.url, RUN, "produce", str(data), "--samples", str(a.samples))
        wait_for(lambda: r.exists(k.done), timeout=600, what="the run registered")
        procs = [kit.consumer(srv.url, RUN, "--server", sim.url, "--out", str(work / f"o{n}"))
                 for n, sim in enumerate(sims)]
        spinners: list[subprocess.Popen] = []
        try:
            wait_for(lambda: r.bitcount(k.done) >= a.warm, timeout=1800, what="the warm-up")
            spinners += [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                         for _ in range(a.busy)]
            cpu0, done_before = kit.machine_cpu(), r.bitcount(k.done)
            for n in range(a.rounds):
                order = list(trees.items()) if n % 2 == 0 else list(trees.items())[::-1]
                for name, tree in order:
                    got = kit.timed(["status"], env, tree=tree)
                    calls[name].append((got["wall_s"], got["cpu_s"]))
            cpu1, done_after = kit.machine_cpu(), r.bitcount(k.done)
        finally:
            for proc in [*procs, *spinners]:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
            producer.stop()
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


if __name__ == "__main__":
    sys.exit(main())
