"""Redis used_memory above an empty server, each case on a fresh one: (a) `genq produce --once`
of 1,000,000 prompts against (b) `--window 512` once filled; (c) what a real run of `--after-run
N` prompts leaves, every key grouped by pattern (MEMORY USAGE, most members), taken after CONFIG
RESETSTAT too (Redis 7 keeps ~24 KB of latency histogram per command type: not the run's data).

    python bench/redis_memory.py                        # 1M prompts, and (c) at 20,000
    python bench/redis_memory.py --only after-run --after-run 20000
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import _common as kit
import redis
from faultkit import Background

from genq.common.queue.keys import PER_INDEX_BITS, RunKeys

RUN = "mem"
K = RunKeys(RUN)
SIM_FLAGS = ["--time-scale", "10000", "--ttft", "0", "--length-dist", "fixed:16"]
SIZE = {"list": "llen", "hash": "hlen", "zset": "zcard", "set": "scard", "stream": "xlen"}
PER_INDEX = [getattr(K, name) for name in PER_INDEX_BITS]  # what stays of a run


def used(r: redis.Redis, reset: bool = False) -> int:
    if reset:  # without the per-command latency histograms (see the module doc)
        r.config_resetstat()
    return int(r.info("memory")["used_memory"])


def produce_once(dataset: Path) -> dict:
    with kit.private_redis() as rs:
        r = rs.client()
        empty, t = used(r), time.monotonic()
        kit.genq("produce", str(dataset), "--once", redis_url=rs.url, run=RUN)
        took = time.monotonic() - t
        return {"bytes": used(r) - empty, "queued": int(r.llen(K.rq_queue)), "seconds": took,
                "job_hash_bytes": int(r.memory_usage(K.rq_job(0)) or 0),
                "queue_list_bytes": int(r.memory_usage(K.rq_queue) or 0)}


def produce_window(dataset: Path, window: int, settle_s: float) -> dict:
    with kit.private_redis() as rs:
        r = rs.client()
        empty, t = used(r), time.monotonic()
        producer = Background(rs.url, RUN, "produce", str(dataset), "--window", str(window))
        try:
            while int(r.llen(K.rq_queue)) < window:
                if producer.proc.poll() is not None or time.monotonic() - t > 300:
                    raise RuntimeError(f"the window never filled:\n{producer.log()[-2000:]}")
                time.sleep(0.05)
            filled = time.monotonic() - t
            time.sleep(settle_s)  # several top-up rounds: the queue must stay at the window
            got = {"bytes": used(r) - empty, "queued": int(r.llen(K.rq_queue)), "fill_s": filled}
            producer.stop()
        finally:
            producer.cleanup()
    return got


def by_pattern(r: redis.Redis) -> list[dict]:
    """One row per kind of key (rq:job:mem-123 -> rq:job:mem-N)."""
    rows: dict[str, dict] = defaultdict(lambda: {"keys": 0, "bytes": 0, "max_members": 0})
    for raw in r.scan_iter(count=1000):
        row = rows[re.sub(r"\d+", "N", raw.decode())]
        row["keys"] += 1
        row["bytes"] += int(r.memory_usage(raw, samples=0) or 0)
        kind = r.type(raw).decode()
        if kind in SIZE:
            row["max_members"] = max(row["max_members"], int(getattr(r, SIZE[kind])(raw)))
    return sorted(({"pattern": p, **v} for p, v in rows.items()), key=lambda x: -x["bytes"])


def after_run(work: Path, n: int, consumers: int) -> dict:
    dataset = kit.write_dataset(work / "after-run.jsonl", n)
    with kit.private_redis() as rs, kit.simulators(1, *SIM_FLAGS) as [sim]:
        r = rs.client()
        empty, empty_data = used(r), used(r, reset=True)
        kit.genq("produce", str(dataset), "--once", redis_url=rs.url, run=RUN)
        t = time.monotonic()
        procs = [kit.consumer(rs.url, RUN, "--server", sim.url, "--burst", "--out",
                              str(work / f"out{i}")) for i in range(consumers)]
        if any(codes := [p.wait(timeout=1800) for p in procs]):
            raise RuntimeError(f"consumers exited {codes}")
        took, done = time.monotonic() - t, int(r.bitcount(K.done))
        mem, data = used(r) - empty, used(r, reset=True) - empty_data
        per_index = sum(int(r.memory_usage(key, samples=0) or 0) for key in PER_INDEX)
        keys = by_pattern(r)
    return {"prompts": n, "done": done, "consume_s": took, "bytes": mem, "data_bytes": data,
            "per_index_bytes": per_index, "key_bytes": sum(k["bytes"] for k in keys),
            "keys": keys}


def after_run_rows(run: dict) -> str:
    done = max(1, run["done"])
    head = (f"\n(c) after a real {run['prompts']}-prompt run ({run['done']} done), B per "
            f"finished prompt: {run['data_bytes'] / done:.1f} after CONFIG RESETSTAT, "
            f"{run['bytes'] / done:.1f} raw, {run['per_index_bytes'] / done:.1f} per-index bits\n")
    rows = [(k["pattern"], k["keys"], f"{k['bytes'] / 1e3:.1f}", k["max_members"])
            for k in run["keys"][:15]]
    return head + kit.table(rows, ("key pattern", "keys", "KB (MEMORY USAGE)", "most members"))


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--total", type=int, default=1_000_000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds the windowed producer runs after filling its window")
    p.add_argument("--after-run", type=int, default=20_000,
                   help="prompts in the real run of case (c) (0: skip it)")
    p.add_argument("--consumers", type=int, default=2, help="consumers in case (c)")
    p.add_argument("--only", choices=("after-run",), help="run only case (c)")
    a = p.parse_args()
    got: dict = {"total": a.total}
    with kit.workdir() as work:
        if a.only != "after-run":
            dataset = kit.write_dataset(work / "prompts.jsonl", a.total)
            got["window"] = produce_window(dataset, a.window, a.settle)
            got["once"] = produce_once(dataset)
        if a.after_run:
            got["after_run"] = after_run(work, a.after_run, a.consumers)
    if "once" in got:
        once, window, mb = got["once"], got["window"], 1e6
        print(f"\nRedis used_memory above an empty server, {a.total}-prompt data set\n")
        print(kit.table([
            (f"(a) produce --once: {once['queued']} jobs queued", f"{once['bytes'] / mb:.1f}",
             f"{once['bytes'] / max(1, once['queued']):.0f}",
             f"{once['bytes'] / window['bytes']:.0f}"),
            (f"(b) produce --window {a.window}: {window['queued']} jobs queued",
             f"{window['bytes'] / mb:.2f}", f"{window['bytes'] / max(1, window['queued']):.0f}",
             "1")], ("state", "MB", "bytes/job queued", "ratio to (b)")))
        print(f"\n(a) took {once['seconds']:.1f} s; one queued rq:job hash is "
              f"{once['job_hash_bytes']} B, the queue list {once['queue_list_bytes'] / mb:.1f} MB")
    if "after_run" in got:
        print(after_run_rows(got["after_run"]))
    kit.dump_json(a.json, got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
