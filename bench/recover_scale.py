"""`genq recover` at scale: a run of 100,000 prompts, all done, lost by Redis and rebuilt from
its output (the issue's budget: 30 s). The output is built as consumers would have left it:
the run registered by the real `genq produce` and requeued by the real `genq requeue --set
max_tokens=8192 --redo truncated` (two versions and a redo scope in the manifest); four shards
written with the consumers' own `common.data.records.build_record`, every prompt under v1 (1 %
twice: refused zombie acks), the truncated ones (~11 %) again under v2. Then FLUSHALL (what a
restart without persistence leaves) and the real `genq recover`, timed as a subprocess, against
`genq export` of the recovered run, which reads the same shard bytes once.

    python bench/recover_scale.py                    # 100k prompts, ~6 KB of text a record
    python bench/recover_scale.py --total 400000 --chars 3000
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
from _common import dump_json, genq, parser, private_redis, table, workdir, write_dataset

from common.data import manifest as manifests
from common.data.records import build_record
from common.queue.keys import RunKeys

BUDGET_S = 30.0
RUN = "bench"


def completion(rng: random.Random, limit: int, chars: int) -> SimpleNamespace:
    tokens = min(limit, int(rng.lognormvariate(7.6, 0.6)) + 1)
    text = "x" * max(1, int(chars * rng.uniform(0.5, 1.5)))
    return SimpleNamespace(finish_reason="length" if tokens >= limit else "stop",
                           prompt_tokens=rng.randrange(20, 600), completion_tokens=tokens,
                           reasoning_content=text[: len(text) * 2 // 3],
                           content=text[len(text) * 2 // 3:])


def open_shards(dirs: list[Path], tag: str) -> list:
    # Named like ShardWriter's shards, written buffered: a per-line fdatasync (what consumers
    # do) would only slow the building of the output, which is not what is measured.
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return [open(d / f"{RUN}.c{n}.20261130T00000{tag}000000000Z-1.jsonl", "wb")
            for n, d in enumerate(dirs)]


def write(f, index: int, version: int, attempt: int, c: SimpleNamespace) -> None:
    f.write(orjson.dumps(build_record(
        run=RUN, index=index, prompt_id=f"p{index}", version=version, attempt=attempt,
        server="http://gpu:1", model="m", completion=c, latency_s=1.0)) + b"\n")


def first_pass(dirs: list[Path], total: int, chars: int, rng: random.Random) -> dict:
    """Every prompt under v1 (1 % twice: a zombie's refused duplicate); returns the results."""
    results, shards = {}, open_shards(dirs, "0")
    for index in range(total):
        c = completion(rng, 4096, chars)
        for _ in range(1 + (rng.random() < 0.01)):
            write(shards[index % len(shards)], index, 1, 1, c)
        results[index] = c
    for f in shards:
        f.close()
    return results


def redo_pass(dirs: list[Path], results: dict, chars: int, rng: random.Random) -> None:
    """The truncated fifth again under v2, after `genq requeue --redo truncated`."""
    shards = open_shards(dirs, "1")
    for index, old in list(results.items()):
        if old.finish_reason == "length":
            results[index] = completion(rng, 8192, chars)
            write(shards[index % len(shards)], index, 2, 2, results[index])
    for f in shards:
        f.close()


def expected_state(results: dict) -> dict:
    out = {"stop": 0, "length": 0, "ctok_sum": 0}
    for c in results.values():
        out[c.finish_reason] += 1
        out["ctok_sum"] += c.completion_tokens
    return out


def measure(url: str, dirs: list[Path], rounds: int, r) -> list[dict]:
    k, out = RunKeys(RUN), []
    for _ in range(rounds):
        r.flushall()  # what a restart without persistence leaves
        started = time.monotonic()
        genq("recover", "--shards", *map(str, dirs), redis_url=url, run=RUN)
        recover_s = time.monotonic() - started
        counters = {f.decode(): int(v) for f, v in r.hgetall(k.counters).items()}
        started = time.monotonic()
        target = dirs[0].parent / "export.jsonl"
        genq("export", "--out", str(target), redis_url=url, run=RUN)  # recover's dirs
        export_s = time.monotonic() - started
        exported = sum(1 for _ in open(target, "rb"))
        target.unlink()
        out.append({"recover_s": recover_s, "export_s": export_s, "done": r.bitcount(k.done),
                     "counters": counters, "exported": exported})
    return out


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--total", type=int, default=100_000)
    p.add_argument("--chars", type=int, default=6000, help="text per record (mean)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    with workdir() as work, private_redis() as srv:
        r = srv.client()
        data = write_dataset(work / "d.jsonl", a.total)
        genq("produce", str(data), "--once", redis_url=srv.url, run=RUN)
        dirs = [work / f"out{n}" for n in range(4)]
        rng, started = random.Random(a.seed), time.monotonic()
        results = first_pass(dirs, a.total, a.chars, rng)
        genq("requeue", "--set", "max_tokens=8192", "--redo", "truncated",
             redis_url=srv.url, run=RUN)
        redo_pass(dirs, results, a.chars, rng)
        snap = manifests.snapshot(r, RunKeys(RUN))
        for d in dirs:
            manifests.write(d, snap)
        built_s, expected = time.monotonic() - started, expected_state(results)
        files = [f for d in dirs for f in d.glob("*.jsonl")]
        size = sum(f.stat().st_size for f in files)
        rounds = measure(srv.url, dirs, a.rounds, r)
    for rd in rounds:
        c = rd["counters"]
        ok = (rd["done"] == rd["exported"] == a.total
              and c.get("finish:stop", 0) == expected["stop"]
              and c.get("finish:length", 0) == expected["length"]
              and c.get("ctok_sum") == expected["ctok_sum"])
        if not ok:
            raise SystemExit(f"recovered state differs from the output: {rd} vs {expected}")
    rec = statistics.median(rd["recover_s"] for rd in rounds)
    exp = statistics.median(rd["export_s"] for rd in rounds)
    print(f"{a.total} done prompts, {size / 2**20:.0f} MiB in {len(files)} shard files "
          f"(built in {built_s:.0f} s); {a.rounds} rounds, medians; nothing lost in any round")
    print(table([("genq recover", f"{rec:.1f}", f"{rec / exp:.2f}", f"{BUDGET_S:.0f}"),
                 ("genq export (baseline)", f"{exp:.1f}", "1.00", "-")],
                ("command", "wall s", "ratio to export", "budget s")))
    dump_json(a.json, {"total": a.total, "bytes": size, "rounds": rounds, "expected": expected})
    return 0 if rec < BUDGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
