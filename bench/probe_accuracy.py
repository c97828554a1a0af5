"""`genq requeue --probe` against what the redo then measures, at the issue's size: a run with
~18 % of answers cut at max_tokens 4096, `--probe 200 --set max_tokens=8192`, then the pivot
committed (`--redo truncated`). Reports the probe's prediction, the redo's measured truncation
rate, whether it lies inside the probe's interval, and how many probe answers were reused.

    python bench/probe_accuracy.py            # ~1-2 min
    python bench/probe_accuracy.py --n 4000 --probe 200 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import REPO, RedisServer, Simulator, dump_json, env, genq, table, write_dataset

from common.queue.keys import RunKeys


def settled(r, k: RunKeys, total: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (r.bitcount(k.done) == total and not r.zcard(k.leases)
                and not r.llen(k.rq_queue)):
            return
        time.sleep(0.2)
    raise TimeoutError("the run did not settle")


def one(n: int, probe: int, seed: int, tmp: Path) -> dict:
    with RedisServer() as rs, Simulator("--time-scale", "1000", "--seed", str(seed)) as sim:
        r, run, k = rs.client(), "probe", RunKeys("probe")
        genq("produce", str(write_dataset(tmp / f"d{seed}.jsonl", n)), "--once",
             "--max-tokens", "4096", redis_url=rs.url, run=run)
        args = [sys.executable, "-m", "genq", "consume", "--server", sim.url, "--out",
                str(tmp / f"out{seed}"), "--poll", "0.05"]
        consumer = subprocess.Popen(args, cwd=REPO, env=env(rs.url, run),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            settled(r, k, n)
            cut = int(r.bitcount(k.truncated))
            before = httpx.get(sim.url + "/_sim/stats").json()["completed"]
            t0 = time.monotonic()
            rep = json.loads(genq("requeue", "--probe", str(probe), "--set", "max_tokens=8192",
                                  "--json", redis_url=rs.url, run=run).stdout)
            probe_s = time.monotonic() - t0
            genq("requeue", "--set", "max_tokens=8192", "--redo", "truncated",
                 redis_url=rs.url, run=run)
            settled(r, k, n)
            after = httpx.get(sim.url + "/_sim/stats").json()["completed"]
            measured = int(r.bitcount(k.truncated)) / cut if cut else 0.0
        finally:
            consumer.terminate()
            consumer.wait(timeout=30)
    low, high = rep["truncation_ci"]
    return {"seed": seed, "cut_at_4096": cut, "cut_share": cut / n, "probe": rep,
            "probe_s": probe_s, "measured_rate": measured, "inside": low <= measured <= high,
            "generated_for_redo": after - before - rep["probe_n"],
            "reused": cut - (after - before - rep["probe_n"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--probe", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--json")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="genq-bench-probe-"))
    results = [one(a.n, a.probe, seed, tmp) for seed in a.seeds]
    rows = [(x["seed"], f"{x['cut_at_4096']} ({x['cut_share']:.1%})",
             f"{x['probe']['truncation_rate']:.1%}",
             "{:.1%} - {:.1%}".format(*x["probe"]["truncation_ci"]),
             f"{x['measured_rate']:.1%}", "yes" if x["inside"] else "NO",
             f"{x['probe']['length_p50']:,} / {x['probe']['length_p90']:,}",
             f"{x['probe']['extra_tokens']:,}", x["reused"], f"{x['probe_s']:.1f}")
            for x in results]
    print(table(rows, ("seed", "cut at 4096", "probe rate", "probe 95% CI", "redo measured",
                       "inside", "p50 / p90", "extra tokens", "reused", "probe s")))
    dump_json(a.json, {"runs": results})
    return 0 if all(x["inside"] for x in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
