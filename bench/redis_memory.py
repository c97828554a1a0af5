"""Redis memory of a 1,000,000-prompt run: (a) `genq produce --once`, every job enqueued up
front, vs (b) the windowed producer (`genq produce DATA --window 512`) after it has run a few
seconds; and (d) right after a real run: `--after-run N` prompts produced,
consumed by real consumers against the simulator, then everything left in Redis, by key
pattern. Each case on a fresh private redis-server; figures are used_memory above the empty
server's.

    python bench/redis_memory.py                        # 1M prompts, and (d) at 20,000
    python bench/redis_memory.py --total 200000 --window 2048
    python bench/redis_memory.py --only after-run --after-run 20000
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, RedisServer, dump_json, env, genq, table, write_dataset
from after_run import after_run, after_run_rows

from common.queue.keys import RunKeys

RUN = "mem"


def used(r) -> int:
    return int(r.info("memory")["used_memory"])


def produce_once(dataset: Path) -> dict:
    with RedisServer() as rs:
        r = rs.client()
        empty = used(r)
        t = time.monotonic()
        out = genq("produce", str(dataset), "--once", redis_url=rs.url, run=RUN, timeout=1800)
        took = time.monotonic() - t
        k = RunKeys(RUN)
        queued = int(r.llen(k.rq_queue))
        mem = used(r) - empty
        job_hash = int(r.memory_usage(k.rq_job(0)) or 0)
        queue_list = int(r.memory_usage(k.rq_queue) or 0)
        r.close()
    print(f"produce --once: {out.stdout.strip()} in {took:.1f} s", file=sys.stderr)
    return {"bytes": mem, "queued": queued, "seconds": took, "job_hash_bytes": job_hash,
            "queue_list_bytes": queue_list}


def produce_window(dataset: Path, window: int, settle_s: float) -> dict:
    with RedisServer() as rs:
        r = rs.client()
        empty = used(r)
        k = RunKeys(RUN)
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "produce", str(dataset), "--window", str(window)],
            cwd=REPO, env=env(rs.url, RUN), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            t = time.monotonic()
            while int(r.llen(k.rq_queue)) < window:
                if proc.poll() is not None:
                    raise RuntimeError(f"producer exited:\n{proc.stderr.read().decode()}")
                if time.monotonic() - t > 300:
                    raise TimeoutError("windowed producer never filled its window")
                time.sleep(0.05)
            filled = time.monotonic() - t
            time.sleep(settle_s)  # several top-up rounds: the queue must stay at the window
            queued = int(r.llen(k.rq_queue))
            mem = used(r) - empty
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        r.close()
    print(f"produce --window {window}: {queued} queued, window filled {filled:.1f} s after "
          "start", file=sys.stderr)
    return {"bytes": mem, "queued": queued, "fill_s": filled}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", type=int, default=1_000_000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds the windowed producer runs after filling its window")
    p.add_argument("--after-run", type=int, default=20_000,
                   help="prompts in the real run of case (d) (0: skip it)")
    p.add_argument("--consumers", type=int, default=2, help="consumers in case (d)")
    p.add_argument("--only", choices=("after-run",), help="run only case (d)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="genq-bench-mem-"))
    if a.only == "after-run":
        try:
            run = after_run(work, a.after_run, a.consumers)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(after_run_rows(run))
        dump_json(a.json, {"after_run": run})
        return 0
    try:
        t = time.monotonic()
        dataset = write_dataset(work / "prompts.jsonl", a.total)
        print(f"wrote {a.total} rows in {time.monotonic() - t:.1f} s", file=sys.stderr)
        window = produce_window(dataset, a.window, a.settle)
        once = produce_once(dataset)
        run = after_run(work, a.after_run, a.consumers) if a.after_run else None
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mb = 1e6
    rows = [
        (f"(a) produce --once: {once['queued']} jobs queued", f"{once['bytes'] / mb:.1f}",
         f"{once['bytes'] / max(1, once['queued']):.0f}", f"{once['bytes'] / window['bytes']:.0f}"),
        (f"(b) produce --window {a.window}: {window['queued']} jobs queued",
         f"{window['bytes'] / mb:.2f}", f"{window['bytes'] / max(1, window['queued']):.0f}",
         "1"),
    ]
    print(f"\nRedis used_memory above an empty server, {a.total}-prompt run\n")
    print(table(rows, ("state", "MB", "bytes/job queued", "ratio to (b)")))
    print(f"\n(a) took {once['seconds']:.1f} s; one queued rq:job hash is "
          f"{once['job_hash_bytes']} B, the queue list {once['queue_list_bytes'] / mb:.1f} MB")
    if run:
        print(after_run_rows(run))
    dump_json(a.json, {"total": a.total, "once": once, "window": window,
                       "after_run": run})
    return 0


if __name__ == "__main__":
    sys.exit(main())
