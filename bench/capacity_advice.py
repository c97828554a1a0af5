"""Capacity advice, followed: a simulated server at 16 slots with a mostly free KV pool is
advised to raise --max-running-requests; the bench restarts it on the same port with the
suggested value (what a person would do) and measures genq's throughput before and after,
side by side in one run.

The simulator decodes each running request at --decode-tps whatever the batch, so the ratio
measures that genq notices the advice's premise, that the consumer follows the restarted
server's new capacity, and that it keeps the added slots full; not how a real GPU's speed per
request falls as its batch grows (the run genq is built for saw x1.75 for x2.5 the slots).

    python bench/capacity_advice.py            # ~2 min
    python bench/capacity_advice.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, RedisServer, Simulator, dump_json, env, genq, table, write_dataset

from common.report.status import read_status

SIM = ("--time-scale", "20", "--length-dist", "lognormal:2326:0.62")


def start_consumer(redis_url: str, run: str, server: str, out: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "genq", "consume", "--server", server, "--out", str(out),
            "--server-wait", "60", "--poll", "0.05"]
    with open(out.with_suffix(".log"), "ab") as log:
        return subprocess.Popen(args, cwd=REPO, env=env(redis_url, run), stdout=log,
                                stderr=subprocess.STDOUT)


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def measure(r, run: str, seconds: float) -> dict:
    """Output tok/s and req/s of done results over `seconds`, and the server's KV use."""
    first = read_status(r, run)
    usage = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        load = (read_status(r, run)["servers"] or [{}])[0].get("load") or {}
        if load.get("token_usage") is not None:
            usage.append(load["token_usage"])
    last = read_status(r, run)
    elapsed = time.monotonic() - t0
    return {"tok_per_s": (last["output_tokens_total"] - first["output_tokens_total"]) / elapsed,
            "req_per_s": (last["done"] - first["done"]) / elapsed,
            "kv_usage_mean": statistics.fmean(usage) if usage else None,
            "capacity": last["servers"][0]["capacity"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20000, help="prompts in the run")
    p.add_argument("--slots", type=int, default=16, help="the server's starting capacity")
    p.add_argument("--window", type=float, default=20.0, help="advice window, seconds")
    p.add_argument("--seconds", type=float, default=30.0, help="measuring time per phase")
    p.add_argument("--json", help="write the figures to this file")
    a = p.parse_args()
    os.environ["GENQ_ADVICE_WINDOW_S"] = str(a.window)
    tmp = Path(tempfile.mkdtemp(prefix="genq-bench-advice-"))
    run = "advice"
    with RedisServer() as redis_server:
        r = redis_server.client()
        sim = Simulator(*SIM, "--max-running-requests", str(a.slots))
        consumer = None
        try:
            genq("produce", str(write_dataset(tmp / "d.jsonl", a.n)), "--once",
                 "--max-tokens", "4096", redis_url=redis_server.url, run=run)
            consumer = start_consumer(redis_server.url, run, sim.url, tmp / "out")
            advice = wait_for(lambda: read_status(r, run)["advice"], a.window * 4, "advice")[0]
            before = measure(r, run, a.seconds)
            port = sim.port
            sim.close()
            sim = Simulator(*SIM, "--max-running-requests", str(advice["suggested"]), port=port)
            wait_for(lambda: (read_status(r, run)["servers"] or [{}])[0].get("capacity")
                     == advice["suggested"], 60, "the new capacity picked up")
            time.sleep(5)  # let the new slots fill before measuring
            after = measure(r, run, a.seconds)
        except TimeoutError:
            print((tmp / "out.log").read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            if consumer:
                consumer.terminate()
                consumer.wait(timeout=30)
            sim.close()
    rows = [(f"before ({a.slots} slots)", f"{before['tok_per_s']:,.0f}",
             f"{before['req_per_s']:.2f}", f"{before['kv_usage_mean']:.2%}", "1.00"),
            (f"after ({advice['suggested']} slots, as advised)", f"{after['tok_per_s']:,.0f}",
             f"{after['req_per_s']:.2f}", f"{after['kv_usage_mean']:.2%}",
             f"{after['tok_per_s'] / before['tok_per_s']:.2f}")]
    print(f"advice: {advice['message']}")
    print(f"evidence: {advice['evidence']}")
    print(table(rows, ("phase", "output tok/s", "req/s", "KV used (mean)", "tok/s ratio")))
    dump_json(a.json, {"advice": advice, "before": before, "after": after})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
