"""Server takeover: how long a server stays undriven after its consumer is SIGKILLed while a
spare waits for it, against the lease length (a dead consumer's lease must expire before anyone
may take its server). One private Redis, one simulator, two consumers given the same
GENQ_SERVERS list (one drives, one waits as a spare); each round kills the driver and times the
spare's `server_leased` log line; the killed one is restarted as the next spare.

    python bench/server_takeover.py                  # leases 1, 2, 5 s; 3 kills each
    python bench/server_takeover.py --leases 15 --kills 2 --json out.json
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import _common as kit
from pipeline import wait_for


class Replica:
    def __init__(self, redis_url: str, run: str, server: str, lease: float, tmp: Path) -> None:
        self.log = Path(tempfile.mkstemp(dir=tmp, prefix="replica-", suffix=".log")[1])
        self.proc = kit.consumer(redis_url, run, "--out", str(tmp / "out"), "--server-lease",
                                 str(lease), "--concurrency", "4", log=self.log,
                                 env={"GENQ_SERVERS": server})

    def leased_at(self) -> float | None:
        for line in self.log.read_text(errors="replace").splitlines():
            if '"server_leased"' in line:
                stamp = json.loads(line)["timestamp"].replace("Z", "+00:00")
                return datetime.datetime.fromisoformat(stamp).timestamp()
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.unlink(missing_ok=True)


def rounds(lease: float, kills: int, tmp: Path) -> list[float]:
    with kit.private_redis() as rs, kit.simulators(1, "--time-scale", "5") as [sim]:
        run = f"bench{int(lease * 10)}"
        kit.genq("produce", str(kit.write_dataset(tmp / "d.jsonl", 100000)), "--once",
                 redis_url=rs.url, run=run)
        replicas = [Replica(rs.url, run, sim.url, lease, tmp)]
        try:
            wait_for(replicas[0].leased_at, 30, what="the first lease")
            replicas.append(Replica(rs.url, run, sim.url, lease, tmp))
            time.sleep(2)  # the spare is up and polling
            figures = []
            for _ in range(kills):
                driver, spare = replicas[-2], replicas[-1]
                os.kill(driver.proc.pid, signal.SIGKILL)
                killed = time.time()
                took = wait_for(spare.leased_at, lease * 5 + 10, what="the takeover") - killed
                figures.append(took)
                driver.close()
                replicas.append(Replica(rs.url, run, sim.url, lease, tmp))
                time.sleep(2)
            return figures
        finally:
            for c in replicas:
                c.close()


def main() -> None:
    p = kit.parser(__doc__)
    p.add_argument("--leases", type=float, nargs="+", default=[1.0, 2.0, 5.0])
    p.add_argument("--kills", type=int, default=3)
    a = p.parse_args()
    rows, raw = [], {}
    with kit.workdir() as tmp:
        for lease in a.leases:
            figures = rounds(lease, a.kills, tmp)
            raw[str(lease)] = figures
            med = statistics.median(figures)
            rows.append((f"{lease:g} s", f"{med:.2f} s", f"{min(figures):.2f}-{max(figures):.2f} s",
                         f"{med / lease:.2f}"))
    print(kit.table(rows, ("lease", "takeover (median)", "range", "takeover/lease")))
    kit.dump_json(a.json, {"takeover_s": raw})


if __name__ == "__main__":
    main()
