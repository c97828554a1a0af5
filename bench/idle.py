"""What waiting costs: the share of a core three idle `genq consume` use over one window after
their start-up: one whose run is finished, a spare waiting for a server another consumer drives,
one with nothing to claim while a frozen consumer's leases run out.

    python bench/idle.py            # a 30 s window
"""

from __future__ import annotations

import signal
import sys
import time

import _common as kit
from pipeline import wait_for

from genq.common.queue.keys import RunKeys


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--window", type=float, default=30.0)
    a = p.parse_args()
    with kit.workdir() as work, kit.private_redis() as rs, kit.simulators(
            2, "--time-scale", "1000", "--ttft", "0", "--length-dist", "fixed:16") as sims:
        r = rs.client()
        for run in ("done", "held"):
            kit.genq("produce", str(kit.write_dataset(work / f"{run}.jsonl", 50)), "--once",
                     redis_url=rs.url, run=run)
        finished = kit.consumer(rs.url, "done", "--server", sims[0].url, "--out", str(work / "a"))
        wait_for(lambda: r.bitcount(RunKeys("done").done) == 50, timeout=60, what="run done")
        spare = kit.consumer(rs.url, "done", "--server", sims[0].url, "--out", str(work / "b"))
        holder = kit.consumer(rs.url, "held", "--server", sims[1].url, "--out", str(work / "c"),
                              "--concurrency", "50", "--visibility-timeout", "600")
        wait_for(lambda: r.zcard(RunKeys("held").leases) == 50, timeout=60, what="all leased")
        holder.send_signal(signal.SIGSTOP)
        starved = kit.consumer(rs.url, "held", "--server", sims[0].url, "--share-server",
                               "--out", str(work / "d"))
        procs = {"finished run": finished, "spare": spare, "nothing to claim": starved}
        time.sleep(5)  # past every start-up
        before = {name: kit.proc_cpu_s(proc.pid) for name, proc in procs.items()}
        time.sleep(a.window)
        shares = {name: (kit.proc_cpu_s(proc.pid) - before[name]) / a.window
                  for name, proc in procs.items()}
        for proc in [*procs.values(), holder]:
            proc.kill()
            proc.wait()
    print(kit.table([(name, f"{100 * share:.2f}") for name, share in shares.items()],
                    ("waiting consumer", "% of a core")))
    kit.dump_json(a.json, {"window_s": a.window, "share_of_a_core": shares})
    return 0


if __name__ == "__main__":
    sys.exit(main())
