"""Case (d) of redis_memory.py: what a real run leaves in Redis. N prompts are produced with
`genq produce --once`, consumed by real `genq consume --burst` processes against the simulator,
and then every key left is measured (MEMORY USAGE) and grouped by pattern, with the number of
members of each collection, so a key that grows by one member per task stands out.

used_memory is taken twice: raw, and after CONFIG RESETSTAT on both servers. Redis 7 keeps a
latency histogram (~24 KB) for every command type it has served, ~0.8 MB for the few dozen a
run uses, whatever its size and even after FLUSHALL: server statistics, not the run's data."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import redis
from _common import REPO, RedisServer, Simulator, env, genq, table, write_dataset

RUN = "mem"
SIM_FLAGS = ["--time-scale", "10000", "--ttft", "0", "--length-dist", "fixed:16"]
SIZE = {"list": "llen", "hash": "hlen", "zset": "zcard", "set": "scard", "stream": "xlen"}


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def data_used(r: redis.Redis) -> int:
    """used_memory without the per-command latency histograms (see the module doc)."""
    r.config_resetstat()
    return used(r)


def pattern(key: str) -> str:
    """rq:job:mem-123 -> rq:job:mem-N: one row per kind of key, however many there are."""
    return re.sub(r"\d+", "N", key)


def by_pattern(r: redis.Redis) -> list[dict]:
    rows: dict[str, dict] = defaultdict(lambda: {"keys": 0, "bytes": 0, "max_members": 0})
    for raw in r.scan_iter(count=1000):
        key = raw.decode()
        row = rows[pattern(key)]
        row["keys"] += 1
        row["bytes"] += int(r.memory_usage(raw, samples=0) or 0)
        kind = r.type(raw).decode()
        if kind in SIZE:
            row["max_members"] = max(row["max_members"], int(getattr(r, SIZE[kind])(raw)))
    return sorted(({"pattern": p, **v} for p, v in rows.items()), key=lambda x: -x["bytes"])


def after_run(work: Path, n: int, consumers: int) -> dict:
    dataset = write_dataset(work / "after-run.jsonl", n)
    with RedisServer() as rs, Simulator(*SIM_FLAGS) as sim:
        r = rs.client()
        empty, empty_data = used(r), data_used(r)
        genq("produce", str(dataset), "--once", redis_url=rs.url, run=RUN, timeout=600)
        t = time.monotonic()
        procs = [subprocess.Popen(
            [sys.executable, "-m", "genq", "consume", "--server", sim.url, "--burst",
             "--out", str(work / f"out{i}")],
            cwd=REPO, env=env(rs.url, RUN), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL) for i in range(consumers)]
        codes = [p.wait(timeout=1800) for p in procs]
        took = time.monotonic() - t
        if any(codes):
            raise RuntimeError(f"consumers exited {codes}")
        done = int(r.bitcount(f"genq:{RUN}:done"))
        mem = used(r) - empty
        data = data_used(r) - empty_data
        keys = by_pattern(r)
        r.close()
    print(f"after-run: {done} of {n} done by {consumers} consumers in {took:.1f} s",
          file=sys.stderr)
    return {"prompts": n, "done": done, "bytes": mem, "bytes_per_prompt": mem / max(1, done),
            "data_bytes": data, "data_per_prompt": data / max(1, done), "consume_s": took,
            "key_bytes": sum(k["bytes"] for k in keys), "keys": keys}


def after_run_rows(run: dict) -> str:
    head = (f"\n(d) right after a real {run['prompts']}-prompt run ({run['done']} done), "
            "used_memory above an empty server:\n"
            f"    run data (after CONFIG RESETSTAT): {run['data_bytes'] / 1e6:.3f} MB = "
            f"{run['data_per_prompt']:.1f} B per finished prompt\n"
            f"    raw (with Redis's per-command latency histograms): {run['bytes'] / 1e6:.3f} MB "
            f"= {run['bytes_per_prompt']:.1f} B per finished prompt\n"
            f"    every key's MEMORY USAGE summed: {run['key_bytes'] / 1e6:.3f} MB\n")
    rows = [(k["pattern"], k["keys"], f"{k['bytes'] / 1e3:.1f}", k["max_members"])
            for k in run["keys"][:15]]
    return head + table(rows, ("key pattern", "keys", "KB (MEMORY USAGE)", "most members"))
