"""The seed's scale end to end: 914,000 prompts through the windowed `genq produce`, several
`genq consume --burst` on fast simulators (16-token answers), default shard rotation (500
records), a `genq monitor`. Measured: wall time, consumers' CPU per task, Redis memory (used
above the empty server) at start, peak and end, `genq status` and the monitor's /api/status
latency during the run and at its end, then `genq export` under `ulimit -n 256` (wall, peak
RSS) and `genq recover` after FLUSHALL (wall, peak RSS), checked against the run.

    python bench/scale.py                          # 914,000 prompts (~15 min here)
    python bench/scale.py --total 50000 --consumers 2
    python bench/scale.py --samples 4 --profile status.prof   # 914,000 × 4 samples

--samples K: K samples a prompt, every figure per sample (task); --profile FILE: the mid-run
`genq status` once more under cProfile, its stats to FILE (`python -m pstats FILE`).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import _common as kit
from faultkit import Background
from pipeline import wait_for
from test_monitor import Monitor

from genq.common.queue.keys import RunKeys

RUN = "scale"


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--total", type=int, default=914_000)
    p.add_argument("--consumers", type=int, default=3)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--profile", help="cProfile the mid-run `genq status` into this file")
    a = p.parse_args()
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

        cpu = {pid: s for pid, (_, s) in kit.reap(procs, tick).items()}
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
