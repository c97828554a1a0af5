"""Redis used_memory above an empty server, each case on a fresh one: (a) `genq produce --once`
of 1,000,000 prompts against (b) `--window 512` once filled. What a finished run leaves, key by
key: scale.py.

    python bench/redis_memory.py [--total 1000000] [--window 512]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import _common as kit
import redis
from faultkit import Background

from genq.common.queue.keys import RunKeys

RUN = "mem"
K = RunKeys(RUN)


def used(r: redis.Redis) -> int:
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


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--total", type=int, default=1_000_000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds the windowed producer runs after filling its window")
    a = p.parse_args()
    got: dict = {"total": a.total}
    with kit.workdir() as work:
        dataset = kit.write_dataset(work / "prompts.jsonl", a.total)
        got["window"] = produce_window(dataset, a.window, a.settle)
        got["once"] = produce_once(dataset)
    once, window, mb = got["once"], got["window"], 1e6
    print(f"\nRedis used_memory above an empty server, {a.total}-prompt data set\n")
    print(kit.table([
        (f"(a) produce --once: {once['queued']} jobs queued", f"{once['bytes'] / mb:.1f}",
         f"{once['bytes'] / max(1, once['queued']):.0f}", f"{once['bytes'] / window['bytes']:.0f}"),
        (f"(b) produce --window {a.window}: {window['queued']} jobs queued",
         f"{window['bytes'] / mb:.2f}", f"{window['bytes'] / max(1, window['queued']):.0f}", "1")],
        ("state", "MB", "bytes/job queued", "ratio to (b)")))
    print(f"\n(a) took {once['seconds']:.1f} s; one queued rq:job hash is "
          f"{once['job_hash_bytes']} B, the queue list {once['queue_list_bytes'] / mb:.1f} MB")
    kit.dump_json(a.json, got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
