"""The seed's scale end to end: the windowed producer, consumers on fast simulators, a monitor;
`genq export` under `ulimit -n 256`, `genq recover` after FLUSHALL, checked against the run.
--baseline TREE: instead, once --warm tasks are done, that checkout's `genq status` (its directory
on PYTHONPATH) and this tree's take turns, --rounds rounds; then the run stops. --produce W:
instead, Redis memory of `produce --once` against `--window W`, each on a fresh Redis.

    python bench/scale.py [--samples 4]            # 914,000 prompts (× 4 samples)
    git worktree add /tmp/base 30a5a45
    python bench/scale.py --samples 4 --baseline /tmp/base --rounds 15 [--busy 4]
    python bench/scale.py --produce 512 --total 1000000
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import _common as kit
from faultkit import Background
from pipeline import wait_for
from test_monitor import Monitor

from genq.common.queue.keys import RunKeys

RUN, MEM = "scale", "mem"
MK = RunKeys(MEM)
SIZE = {"list": "llen", "hash": "hlen", "zset": "zcard", "set": "scard", "stream": "xlen"}


def by_pattern(r) -> list[dict]:
    """What the run leaves, a row per kind of key (rq:job:scale-123 -> rq:job:scale-N)."""
    rows: dict[str, dict] = defaultdict(lambda: {"keys": 0, "bytes": 0, "max_members": 0})
    for raw in r.scan_iter(count=1000):
        row = rows[re.sub(r"\d+", "N", raw.decode())]
        row["keys"] += 1
        row["bytes"] += int(r.memory_usage(raw, samples=0) or 0)
        if (kind := r.type(raw).decode()) in SIZE:
            row["max_members"] = max(row["max_members"], int(getattr(r, SIZE[kind])(raw)))
    return sorted(({"pattern": p, **v} for p, v in rows.items()), key=lambda x: -x["bytes"])


def status_rounds(a, trees: dict[str, Path], r, env: dict) -> int:
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


def produce_once(dataset: Path) -> dict:
    with kit.private_redis() as rs:
        r = rs.client()
        empty, t = kit.used_memory(r), time.monotonic()
        kit.produce_once(rs.url, MEM, dataset)
        took = time.monotonic() - t
        return {"bytes": kit.used_memory(r) - empty, "queued": int(r.llen(MK.rq_queue)),
                "seconds": took, "job_hash_bytes": int(r.memory_usage(MK.rq_job(0)) or 0),
                "queue_list_bytes": int(r.memory_usage(MK.rq_queue) or 0)}


def produce_window(dataset: Path, window: int, settle_s: float) -> dict:
    with kit.private_redis() as rs:
        r = rs.client()
        empty, t = kit.used_memory(r), time.monotonic()
        producer = Background(rs.url, MEM, "produce", str(dataset), "--window", str(window))
        try:
            while int(r.llen(MK.rq_queue)) < window:
                if producer.proc.poll() is not None or time.monotonic() - t > 300:
                    raise RuntimeError(f"the window never filled:\n{producer.log()[-2000:]}")
                time.sleep(0.05)
            filled = time.monotonic() - t
            time.sleep(settle_s)  # several top-up rounds: the queue must stay at the window
            got = {"bytes": kit.used_memory(r) - empty, "queued": int(r.llen(MK.rq_queue)),
                   "fill_s": filled}
            producer.stop()
        finally:
            producer.cleanup()
    return got


def memory(a) -> dict:
    with kit.workdir() as work:
        dataset = kit.write_dataset(work / "prompts.jsonl", a.total)
        got = {"total": a.total, "window": produce_window(dataset, a.produce, a.settle),
               "once": produce_once(dataset)}
    once, window, mb = got["once"], got["window"], 1e6
    print(f"\nRedis used_memory above an empty server, {a.total}-prompt data set\n")
    print(kit.table([
        (f"(a) produce --once: {once['queued']} jobs queued", f"{once['bytes'] / mb:.1f}",
         f"{once['bytes'] / max(1, once['queued']):.0f}", f"{once['bytes'] / window['bytes']:.0f}"),
        (f"(b) produce --window {a.produce}: {window['queued']} jobs queued",
         f"{window['bytes'] / mb:.2f}", f"{window['bytes'] / max(1, window['queued']):.0f}", "1")],
        ("state", "MB", "bytes/job queued", "ratio to (b)")))
    print(f"\n(a) took {once['seconds']:.1f} s; one queued rq:job hash is "
          f"{once['job_hash_bytes']} B, the queue list {once['queue_list_bytes'] / mb:.1f} MB")
    return got


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--total", type=int, default=914_000)
    p.add_argument("--consumers", type=int, default=3)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--baseline", type=Path, help="instead: this checkout's `genq status`")
    p.add_argument("--rounds", type=int, default=15, help="--baseline: rounds of status calls")
    p.add_argument("--busy", type=int, default=0, help="--baseline: processes spinning beside")
    p.add_argument("--warm", type=int, default=50_000, help="--baseline: tasks done first")
    p.add_argument("--produce", type=int, metavar="W", help="instead: produce's Redis memory")
    p.add_argument("--settle", type=float, default=3.0, help="--produce: seconds after filling")
    a = p.parse_args()
    if a.produce:
        kit.dump_json(a.json, memory(a))
        return 0
    if a.baseline:
        trees = {"baseline": a.baseline.resolve(), "this tree": kit.REPO}
        if not (trees["baseline"] / "genq" / "__main__.py").exists():
            raise SystemExit(f"{a.baseline} is not a genq checkout")
    tasks = a.total * a.samples
    k, lat = RunKeys(RUN), {}
    with kit.workdir() as work, kit.private_redis() as srv, \
            kit.simulators(a.consumers, *kit.FAST_SIM) as sims:
        r, env = srv.client(), kit.genq_env(srv.url, RUN)
        data = kit.write_dataset(work / "d.jsonl", a.total)
        base = kit.used_memory(r)

        def used_mb() -> float:  # above the empty server's
            return (kit.used_memory(r) - base) / 2**20

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
            peak_mb = max(peak_mb, used_mb())

        cpu = {pid: g[1] for pid, g in kit.reap(procs, tick).items()}
        wall, (busy, total) = time.monotonic() - started, kit.machine_cpu()
        lat["status_end_s"] = kit.latency(lambda: kit.genq("status", redis_url=srv.url, run=RUN))
        lat["api_end_s"] = kit.latency(lambda: urllib.request.urlopen(monitor.url + "/api/status"))
        producer.stop()
        monitor.proc.terminate()
        end_mb, done, keys = used_mb(), r.bitcount(k.done), by_pattern(r)
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
    print(kit.table([(x["pattern"], x["keys"], f"{x['bytes'] / 1e3:.1f}", x["max_members"])
                     for x in keys[:15]], ("key left", "keys", "KB", "most members")))
    kit.dump_json(a.json, {**figures, "keys": keys})
    return 0


if __name__ == "__main__":
    sys.exit(main())
