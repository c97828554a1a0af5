"""A chaos soak's processes, each restartable on the same port and directory (the run sees a
restart, not a new deployment), and the checks it ends with on the run's final state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path

import httpx
import orjson
import redis
from _common import REPO, genq, genq_env
from faultkit import bits
from pipeline import read_jsonl, wait_for

from genq.common.net import free_port, wait_port
from genq.common.queue.keys import FINISH_NAMES, RunKeys
from genq.common.report.status import read_status


class Proc:
    """One restartable process; its output goes to one log file across restarts."""

    def __init__(self, name: str, args: list[str], log: Path, environ: dict[str, str],
                 marker: bytes = b"") -> None:
        self.name, self.args, self.log, self.env = name, args, log, environ
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.marker, self.offset, self.seen = marker, 0, False

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.seen = not self.marker
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.starts += 1
        self.ready()

    def ready(self) -> None:
        """Wait until the process serves (nothing to wait for by default)."""

    @property
    def started(self) -> bool:
        """Up, and its log shows the marker since the last start (a SIGTERM before is moot)."""
        if self.up and not self.seen:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                self.seen = self.marker in f.read()
        return self.up and self.seen

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.up and not self.started and time.monotonic() < deadline:
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        if self.up:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.up:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, bound_s: float) -> tuple[int | None, float]:
        """SIGTERM: (exit status, seconds to exit), or (None, bound) and a SIGKILL if too slow."""
        if not self.up:
            return self.proc.returncode if self.proc else 0, 0.0
        self.signal(signal.SIGCONT)  # a paused process must be able to hear the SIGTERM
        start = time.monotonic()
        self.proc.terminate()
        try:
            rc = self.proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return None, bound_s
        return rc, round(time.monotonic() - start, 2)


class Redis(Proc):
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        data = workdir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(data), "--save", "", "--appendonly", "yes",
                "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]
        super().__init__("redis", args, workdir / "redis.log", dict(os.environ))
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def ready(self) -> None:
        wait_port(self.port, timeout=30)


class Simulator(Proc):
    def __init__(self, n: int, workdir: Path, flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "genq.simulator", "--port", str(self.port), *flags]
        super().__init__(f"sim{n}", args, workdir / f"sim{n}.log", dict(os.environ))

    def ready(self) -> None:
        wait_for(self.healthy, timeout=30, what=f"{self.name} healthy")

    def healthy(self) -> bool:
        with suppress(httpx.TransportError):
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        return False

    def fault(self, body: dict) -> None:
        httpx.post(self.url + "/_sim/faults", json=body, timeout=5).raise_for_status()


def genq_proc(name: str, args: list[str], workdir: Path, redis_url: str, run: str,
              marker: bytes = b"") -> Proc:
    return Proc(name, [sys.executable, "-m", "genq", *args], workdir / f"{name}.log",
                genq_env(redis_url, run), marker)


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
    """What every soak checks of the run's end and its export."""
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
        "duplicate_shard_lines": sum(c - 1 for i, c in lines.items() if i != "torn"),
        "torn_shard_lines": lines.get("torn", 0),
        "top_failure_reasons": errors.most_common(5),
        "params_version": status["params_version"],
    }
    return checks, figures
