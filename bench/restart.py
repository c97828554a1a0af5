"""How long a server idles when its consumer is killed: kill -9 and relaunch (against a plain
client, _bare_stream.py); a consumer killed for good, until all its tasks are back. --idle:
instead, the CPU of waiting consumers (one has nothing to claim: a frozen one holds the leases)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import _common as kit
import httpx
from pipeline import wait_for

from genq.common.queue.keys import RunKeys

SIM = ["--length-dist", "fixed:256", "--max-running-requests", "32", "--ttft", "0.5"]


def full_again(url: str, since: float) -> float:
    wait_for(lambda: httpx.get(url + "/_sim/stats", timeout=5).json()["running"] >= 32, 60,
             interval=0.05, what="the server full again")
    return time.monotonic() - since


def relaunched(start, url: str, kill_at: float | None) -> tuple[float | None, object]:
    proc = start()
    if kill_at is None:
        return None, proc
    time.sleep(kill_at)
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    proc = start()
    return full_again(url, killed), proc


def genq_run(tmp: Path, n: int, kill_at: float | None) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    with kit.private_redis() as rs, kit.simulators(1, *SIM) as [sim]:
        kit.produce_once(rs.url, "r", kit.write_dataset(tmp / "d.jsonl", n))
        t0 = time.monotonic()
        full_s, proc = relaunched(lambda: kit.consumer(rs.url, "r", "--server", sim.url,
                                                       "--burst", "--out", str(tmp / "out")),
                                  sim.url, kill_at)
        proc.wait(timeout=600)
        return {"full_again_s": full_s, "wall_s": time.monotonic() - t0}


def bare_full_again(tmp: Path, n: int, kill_at: float) -> float:
    with kit.simulators(1, *SIM) as [sim]:
        args = [sys.executable, str(kit.REPO / "bench" / "_bare_stream.py"), "--server",
                sim.url, "--dataset", str(kit.write_dataset(tmp / "b.jsonl", n)), "--n", str(n),
                "--concurrency", "32"]
        full_s, proc = relaunched(lambda: subprocess.Popen(args, stdout=subprocess.DEVNULL),
                                  sim.url, kill_at)
        proc.kill()
        return full_s or 0.0


def tasks_back(tmp: Path, vt: float) -> float:
    with kit.private_redis() as rs, kit.simulators(2, *SIM) as sims:
        r = rs.client()
        kit.produce_once(rs.url, "v", kit.write_dataset(tmp / "v.jsonl", 2000))
        procs = [kit.consumer(rs.url, "v", "--server", s.url, "--out", str(tmp / f"o{i}"),
                              "--visibility-timeout", str(vt)) for i, s in enumerate(sims)]

        def leases_on_first() -> int:
            return sum(sims[0].url in o.decode() for o in r.hvals("genq:v:lease_owner"))
        try:
            wait_for(lambda: leases_on_first() >= 32, 60, what="the first consumer busy")
            procs[0].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            wait_for(lambda: leases_on_first() == 0, 120, interval=0.05, what="tasks back")
            return time.monotonic() - killed
        finally:
            for proc in procs:
                proc.kill()


def idle(a) -> None:
    with kit.workdir() as work, kit.private_redis() as rs, kit.simulators(
            2, "--time-scale", "1000", "--ttft", "0", "--length-dist", "fixed:16") as sims:
        r = rs.client()
        for run in ("done", "held"):
            kit.produce_once(rs.url, run, kit.write_dataset(work / f"{run}.jsonl", 50))
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


def main() -> None:
    p = kit.parser(__doc__)
    p.add_argument("--n", type=int, default=400, help="prompts of 256 tokens, 32 slots")
    p.add_argument("--kill-at", type=float, default=15.0)
    p.add_argument("--visibility-timeout", type=float, default=6.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--idle", action="store_true", help="instead: waiting consumers' CPU")
    p.add_argument("--window", type=float, default=30.0, help="--idle: seconds measured")
    a = p.parse_args()
    if a.idle:
        return idle(a)
    SIM.extend(["--time-scale", str(a.time_scale)])
    with kit.workdir() as tmp:
        calm, killed = genq_run(tmp / "calm", a.n, None), genq_run(tmp / "kill", a.n, a.kill_at)
        bare, back = bare_full_again(tmp, a.n, a.kill_at), tasks_back(tmp, a.visibility_timeout)
    print(kit.table([
        ("server full again, kill -9 and relaunch", f"{killed['full_again_s']:.1f} s",
         f"{bare:.1f} s"),
        ("run end, killed against undisturbed",
         f"+{killed['wall_s'] - calm['wall_s']:.1f} s of {calm['wall_s']:.1f}", "-"),
        (f"tasks back, --visibility-timeout {a.visibility_timeout:g}", f"{back:.1f} s", "-")],
        ("figure", "genq", "plain client")))
    kit.dump_json(a.json, {"calm": calm, "killed": killed, "bare_full_again_s": bare,
                           "tasks_back_s": back})


if __name__ == "__main__":
    main()
