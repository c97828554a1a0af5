"""The checks a chaos soak ends with, on the run's final state: what a user cares about."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import redis
from _common import genq
from faultkit import bits
from pipeline import read_jsonl

from genq.common.queue.keys import FINISH_NAMES, RunKeys
from genq.common.report.status import read_status


def superseded(r: redis.Redis, k: RunKeys, records: list[dict], requeues: list[dict]
               ) -> list[int]:
    """Indices whose accepted result ran under parameters a requeue had replaced: one written
    after a requeue's switch (from the run's history, on this host's clock) under an older
    version; or a truncated result older than a `--redo truncated`."""
    switched = {h["version"]: h["at"] for h in map(orjson.loads, r.lrange(k.params_history, 0, -1))}
    for q in requeues:  # the moment Redis switched, not when the command was started
        q["at"] = switched.get(q["version"], q["at"])
    bad = set()
    for q in requeues:
        for rec in records:
            older = rec["params_version"] < q["version"]
            if older and rec["created_at"] > q["at"] + 0.01:  # created_at is rounded to 1 ms
                bad.add(rec["index"])
            if older and q["redo"] == "truncated" and rec["finish_reason"] == "length":
                bad.add(rec["index"])
    return sorted(bad)


def shard_lines(out_dirs: list[Path], run: str) -> Counter:
    lines: Counter = Counter()
    for d in out_dirs:
        for path in d.glob(f"{run}.*.jsonl"):
            for line in path.read_bytes().splitlines():
                try:
                    record = orjson.loads(line)
                    if record.get("status") != "failed":  # a failed task's line: no result
                        lines[record["index"]] += 1
                except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                    lines["torn"] += 1
    return lines


def run_checks(r: redis.Redis, k: RunKeys, total: int, records: list[dict],
               requeues: list[dict]) -> tuple[set, set, dict, list[int], dict]:
    """What every soak checks of the run's end and its export: (done, failed, status,
    superseded indices, checks: name -> passed)."""
    done, failed = bits(r.get(k.done), total), bits(r.get(k.failed), total)
    status, stale = read_status(r, k.run), superseded(r, k, records, requeues)
    finish = Counter(rec["finish_reason"] if rec["finish_reason"] in FINISH_NAMES.values()
                     else "other" for rec in records)
    return done, failed, status, stale, {
        "nothing_lost": len(done | failed) == total and not done & failed,
        "no_result_under_superseded_parameters": not stale,
        "status_equals_export": (
            status["done"] == len(done) and status["failed"] == len(failed)
            and status["finish_reasons"] == dict(finish)
            and status["output_tokens_total"] == sum(x["completion_tokens"] for x in records)
            and status["prompt_tokens_total"] == sum(x["prompt_tokens"] for x in records)),
        "queue_and_leases_empty": r.llen(k.rq_queue) == 0 and r.zcard(k.leases) == 0,
    }


def final_checks(r: redis.Redis, redis_url: str, run: str, total: int, workdir: Path,
                 requeues: list[dict], out_dirs: list[Path]) -> tuple[dict, dict]:
    """(checks: name -> passed, figures)."""
    k = RunKeys(run)
    genq("export", "--out", str(workdir / "export.jsonl"), redis_url=redis_url, run=run)
    records = read_jsonl(workdir / "export.jsonl")
    done, failed, status, stale, checks = run_checks(r, k, total, records, requeues)
    checks["each_index_once_in_export"] = [rec["index"] for rec in records] == sorted(done)
    lines = shard_lines(out_dirs, run)
    reasons = r.hmget(k.errors, [str(i) for i in sorted(failed)]) if failed else []
    errors = Counter((v or b"?").decode(errors="replace")[:80] for v in reasons)
    figures = {
        "done": len(done), "failed": len(failed), "superseded": stale[:20],
        "duplicate_shard_lines": sum(c for i, c in lines.items() if i != "torn") - len(
            [i for i in lines if i != "torn"]),
        "torn_shard_lines": lines.get("torn", 0),
        "top_failure_reasons": errors.most_common(5),
        "params_version": status["params_version"],
    }
    return checks, figures
