"""`genq requeue --redo truncated` at scale: a finished 1,000,000-prompt run with 200,000
truncated results, built directly in Redis exactly as ack.lua leaves it, then the real command
timed as a subprocess, with the longest Redis stall seen by a PING loop meanwhile. Baseline
side by side: the same requeue without --redo on an identical run (the fixed cost). The issue's
budget is 5 s.

    python bench/redo_scale.py                          # 1M prompts, 200k truncated, 3 rounds
    python bench/redo_scale.py --total 4000000 --truncated 800000 --rounds 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from array import array
from collections import Counter

import redis
from _common import RedisServer, commandstats, delta, dump_json, genq, table

from common import params
from common.queue.keys import RUNS, RunKeys

BUDGET_S = 5.0
MAX_TOKENS = 4096


def build_run(r: redis.Redis, run: str, total: int, truncated: int, seed: int) -> dict:
    """Every index done once (attempt 1, params version 1); `truncated` of them hit
    max_tokens. Returns the expected state after a redo of the truncated ones."""
    k = RunKeys(run)
    rng = random.Random(seed)
    trunc = set(rng.sample(range(total), truncated))
    ctoks = array("I", (MAX_TOKENS if i in trunc else min(MAX_TOKENS - 1,
                                                          int(rng.lognormvariate(7.0, 0.6)) + 1)
                        for i in range(total)))
    ptoks = array("I", (rng.randrange(20, 600) for _ in range(total)))
    nbytes = (total + 7) // 8

    def bitmap(indices) -> bytes:
        b = bytearray(nbytes)
        for i in indices:
            b[i >> 3] |= 0x80 >> (i & 7)
        return bytes(b)

    def be(a: array) -> bytes:  # BITFIELD u32/u16 '#i' is big-endian at offset i*width
        a = array(a.typecode, a)
        if sys.byteorder == "little":
            a.byteswap()
        return a.tobytes()

    all_done = bytearray(b"\xff" * nbytes)
    if total % 8:
        all_done[-1] = (0xFF << (8 - total % 8)) & 0xFF
    finish = bytearray(b"\x01" * total)
    for i in trunc:
        finish[i] = 2
    hist = Counter(ctoks)
    pipe = r.pipeline(transaction=False)
    pipe.hset(k.meta, mapping={"dataset": f"/nonexistent/{run}.jsonl",
                               "fingerprint": f"{total}r-bench", "total": total,
                               "queue": k.queue_name, "created_at": time.time()})
    pipe.sadd(RUNS, run)
    pipe.set(k.done, bytes(all_done))
    pipe.set(k.truncated, bitmap(trunc))
    pipe.set(k.pending, bytes(nbytes))  # enqueue set each bit, ack cleared it
    pipe.set(k.acc_tokens, be(ctoks))
    pipe.set(k.acc_ptoks, be(ptoks))
    pipe.set(k.acc_finish, bytes(finish))
    pipe.set(k.acc_version, be(array("H", [1]) * total))
    pipe.set(k.acc_attempt, b"\x00\x01" * total)  # u16 each
    pipe.set(k.claims, b"\x00\x01" * total)
    pipe.set(k.spent, bytes(total))  # ack zeroes the spent attempts
    pipe.hset(k.counters, mapping={"finish:stop": total - truncated, "finish:length": truncated,
                                   "ctok_sum": sum(ctoks), "ptok_sum": sum(ptoks)})
    for start in range(0, len(hist), 1000):
        pipe.hset(k.length_hist, mapping=dict(list(hist.items())[start:start + 1000]))
    pipe.execute()
    params.init_version_one(r, k, dict(params.DEFAULTS))
    after_hist = Counter(hist)
    del after_hist[MAX_TOKENS]
    return {"done": total - truncated, "hist": after_hist,
            "ctok_sum": sum(ctoks) - MAX_TOKENS * truncated,
            "ptok_sum": sum(ptoks) - sum(ptoks[i] for i in trunc), "trunc": trunc}


class StallProbe:
    """PING in a loop on its own connection; the longest round trip is the longest stall."""

    def __init__(self, url: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.worst = 0.0
        self.over_100ms = 0
        self.pings = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            self.r.ping()
            took = time.perf_counter() - t
            self.pings += 1
            self.worst = max(self.worst, took)
            self.over_100ms += took > 0.1
            time.sleep(0.0005)

    def __enter__(self) -> StallProbe:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.r.close()


def timed_requeue(rs: RedisServer, run: str, *flags: str) -> dict:
    r = rs.client()
    cmd0 = r.info("commandstats")
    with StallProbe(rs.url) as probe:
        t = time.monotonic()
        proc = genq("requeue", "--set", "max_tokens=8192", *flags, redis_url=rs.url, run=run)
        wall = time.monotonic() - t
    cmd1 = r.info("commandstats")
    r.close()
    script_us = (cmd1.get("cmdstat_evalsha", {}).get("usec", 0)
                 - cmd0.get("cmdstat_evalsha", {}).get("usec", 0))
    return {"wall_s": wall, "stall_s": probe.worst, "stalls_over_100ms": probe.over_100ms,
            "pings": probe.pings, "script_s": script_us / 1e6, "stdout": proc.stdout.strip()}


def verify(r: redis.Redis, run: str, expect: dict) -> None:
    k = RunKeys(run)
    counters = {a.decode(): int(b) for a, b in r.hgetall(k.counters).items()}
    hist = Counter({int(a): int(b) for a, b in r.hgetall(k.length_hist).items()})
    done = int(r.bitcount(k.done))
    problems = []
    if done != expect["done"]:
        problems.append(f"done bitcount {done} != {expect['done']}")
    if int(r.bitcount(k.truncated)) != 0:
        problems.append("truncated bitmap not empty")
    if counters.get("finish:length") != 0:
        problems.append(f"finish:length {counters.get('finish:length')} != 0")
    if counters.get("finish:stop") != expect["done"]:
        problems.append(f"finish:stop {counters.get('finish:stop')} != {expect['done']}")
    if counters.get("ctok_sum") != expect["ctok_sum"]:
        problems.append("ctok_sum differs")
    if counters.get("ptok_sum") != expect["ptok_sum"]:
        problems.append("ptok_sum differs")
    if hist != expect["hist"] or sum(hist.values()) != expect["done"]:
        problems.append(f"length_hist differs (sum {sum(hist.values())})")
    # The redone indices are runnable again: not done, not pending, no attempts spent.
    done_bits, spent = r.get(k.done), r.get(k.spent)
    for i in list(expect["trunc"])[:2000]:
        if done_bits[i >> 3] & (0x80 >> (i & 7)) or spent[i]:
            problems.append(f"index {i} still done or has spent attempts")
            break
    if problems:
        raise AssertionError(f"run {run} after redo: " + "; ".join(problems))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", type=int, default=1_000_000)
    p.add_argument("--truncated", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3, help="medians reported (default 3)")
    p.add_argument("--json", help="also write every round's figures here")
    a = p.parse_args()
    redo_rounds, base_rounds = [], []
    with RedisServer() as rs:
        r = rs.client()
        for n in range(a.rounds):
            t = time.monotonic()
            build_run(r, f"base{n}", a.total, a.truncated, seed=n)
            expect = build_run(r, f"redo{n}", a.total, a.truncated, seed=n)
            built = time.monotonic() - t
            base_rounds.append(timed_requeue(rs, f"base{n}"))
            cmd0 = commandstats(r)
            redo_rounds.append(timed_requeue(rs, f"redo{n}", "--redo", "truncated"))
            cmds = delta(commandstats(r), cmd0)
            for own in ("info", "ping"):  # the bench's own snapshots and stall probe
                cmds.pop(own, None)
            redo_rounds[-1]["commands"] = cmds
            verify(r, f"redo{n}", expect)
            print(f"round {n + 1}: built 2 runs in {built:.1f} s; requeue "
                  f"{base_rounds[-1]['wall_s']:.2f} s, with --redo truncated "
                  f"{redo_rounds[-1]['wall_s']:.2f} s ({redo_rounds[-1]['stdout']!r}); "
                  "verified", file=sys.stderr)
            for run in (f"base{n}", f"redo{n}"):
                for key in r.scan_iter(f"genq:{run}:*"):
                    r.delete(key)
        memory_note = r.info("memory")["used_memory_peak_human"]
        r.close()

    def med(rounds: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in rounds)

    redo, base = med(redo_rounds, "wall_s"), med(base_rounds, "wall_s")
    per_index_us = 1e6 * (redo - base) / a.truncated
    rows = [
        ("wall s (subprocess start to exit)", f"{redo:.2f}", f"{base:.2f}",
         f"{redo / base:.1f}", f"{redo / BUDGET_S:.2f}"),
        ("redo script time in Redis, s (commandstats)", f"{med(redo_rounds, 'script_s'):.2f}",
         f"{med(base_rounds, 'script_s'):.2f}", "-", "-"),
        ("longest Redis stall (PING), ms", f"{1000 * med(redo_rounds, 'stall_s'):.0f}",
         f"{1000 * med(base_rounds, 'stall_s'):.0f}", "-", "-"),
        ("PINGs over 100 ms", f"{med(redo_rounds, 'stalls_over_100ms'):.0f}",
         f"{med(base_rounds, 'stalls_over_100ms'):.0f}", "-", "-"),
        ("redo cost per truncated index, us", f"{per_index_us:.1f}", "-", "-", "-"),
    ]
    print(f"\n{a.total} prompts done, {a.truncated} truncated; median of {a.rounds} rounds; "
          f"Redis peak memory {memory_note}\n")
    print(table(rows, ("figure", "--redo truncated", "no --redo", "redo/base",
                       f"redo/{BUDGET_S:.0f} s budget")))
    mid = sorted(redo_rounds, key=lambda x: x["wall_s"])[len(redo_rounds) // 2]
    print("\nRedis commands during the redo requeue (script-internal calls count):")
    print(table([(c, n, f"{n / a.truncated:.2f}") for c, n in
                 sorted(mid["commands"].items(), key=lambda kv: -kv[1])],
                ("command", "calls", "per truncated index")))
    dump_json(a.json, {"total": a.total, "truncated": a.truncated,
                       "redo": [{k: v for k, v in x.items()} for x in redo_rounds],
                       "base": base_rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
