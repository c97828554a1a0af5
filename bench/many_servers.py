"""N simulated servers x S slots from one machine, a `genq consume --burst` each on one run: per
server its consumer's CPU, how full it kept the server against its ideal rate, the headroom.

    python bench/many_servers.py                          # 8 servers x 64 slots, ~30 s
    python bench/many_servers.py --servers 4 --slots 32 --request-s 0.2 --per-server 3000
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import _common as kit

DECODE_TPS, TTFT = 87.5, 0.5  # the simulator's defaults


def run_bench(a, work: Path) -> dict:
    n = a.servers * a.per_server
    dataset = kit.write_dataset(work / "prompts.jsonl", n)
    if a.request_s:  # every request takes request_s: 16 tokens streamed over that time
        flags = ["--time-scale", "1", "--ttft", "0", "--length-dist", "fixed:16",
                 "--decode-tps", str(16 / a.request_s)]
    else:
        flags = ["--time-scale", str(a.time_scale), "--length-dist", f"fixed:{a.tokens}"]
    flags += ["--max-running-requests", str(a.slots)]
    with kit.simulators(a.servers, *flags) as sims, kit.private_redis() as rs:
        kit.genq("produce", str(dataset), "--once", redis_url=rs.url, run="many")
        r = rs.client()
        rcpu0, (busy0, all0) = kit.redis_cpu_s(r), kit.machine_cpu()
        cmds0 = sum(kit.commandstats(r).values())
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
        redis_cpu = kit.redis_cpu_s(r) - rcpu0
        redis_cmds = sum(kit.commandstats(r).values()) - cmds0  # the sampler's own: none
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


def report(a, got: dict) -> None:
    d = a.request_s or (TTFT + a.tokens / DECODE_TPS) / a.time_scale
    ideal = a.slots / d
    rows = []
    for i, c in enumerate(got["consumers"]):
        # From its first result to its exit: start-up (imports, probes) is left out.
        wall, cpu = c["wall_s"] - c["first_s"], c["cpu_s"] - c["first_cpu_s"]
        share = cpu / wall if wall > 0 else 0.0
        occupancy = (1 - c["idle_slot_s"] / (a.slots * c["steady_s"])) if c["steady_s"] else 0
        rows.append((i, c["tasks"], f"{c['tasks'] / wall:.1f}", f"{c['tasks'] / wall / ideal:.2f}",
                     f"{100 * occupancy:.1f}", f"{c['waiting_req_s']:.1f}",
                     f"{100 * share:.1f}", f"{1000 * cpu / max(1, c['tasks']):.2f}",
                     f"{1 / share:.1f}" if share else "-",
                     f"{c['tasks'] / cpu:.0f}" if cpu > 0 else "-"))
    print(f"\n{a.servers} simulated servers x {a.slots} slots on this machine "
          f"({os.cpu_count()} cores), {a.per_server} prompts per server on one run, requests "
          f"of {d:.2f} s (ideal {ideal:.1f} req/s per server); load average before: "
          f"{a.load_before}\n")
    print("tasks/s, CPU: from the consumer's first result to its exit (start-up left out)")
    print(kit.table(rows, ("server", "tasks", "tasks/s", "of ideal", "slots busy % (steady)",
                           "waiting req-s", "consumer CPU % of a core", "CPU ms/task",
                           "servers like it per core", "tasks/s a core could take")))
    cons, sims = (sum(c[k] for c in got["consumers"]) for k in ("cpu_s", "sim_cpu_s"))
    wall, busy = got["wall_s"], got["machine_busy_s"] / got["machine_all_s"]
    share = 100 * cons / wall / (os.cpu_count() or 1)
    print(f"\nwall {wall:.1f} s; CPU seconds: consumers {cons:.1f} ({share:.1f} % of the "
          f"machine), simulators {sims:.1f}, Redis {got['redis_cpu_s']:.1f}; whole machine busy "
          f"{100 * busy:.0f} % (other sessions included); load average after: "
          f"{kit.load_average()}")
    n = got["n"]
    print(f"Redis for all {a.servers} consumers, start-up included: "
          f"{got['redis_cmds'] / n:.1f} commands and {1000 * got['redis_cpu_s'] / n:.3f} ms "
          f"CPU per task ({100 * got['redis_cpu_s'] / wall:.1f} % of a core)")


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--servers", type=int, default=8, help="simulated servers")
    p.add_argument("--slots", type=int, default=64, help="slots per server")
    p.add_argument("--per-server", type=int, default=1000, help="prompts per server")
    p.add_argument("--tokens", type=int, default=2000, help="tokens per completion")
    p.add_argument("--time-scale", type=float, default=20.0,
                   help="simulator speed-up: 1.2 s requests, ~55 req/s per server at 20")
    p.add_argument("--request-s", type=float, help="instead of --tokens and --time-scale: every "
                   "request takes this long (0.2 with --slots 32: 160 req/s per server)")
    p.add_argument("--sample", type=float, default=0.2, help="load sampling period, s")
    a = p.parse_args()
    a.load_before = kit.load_average()
    with kit.workdir() as work:
        got = run_bench(a, work)
    report(a, got)
    kit.dump_json(a.json, got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
