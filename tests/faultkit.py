"""What the fault suite shares: private Redis servers a test may kill, consumers under a skewed
clock or other wrapper, the run's truth checked against `genq export`, and the figures each
fault test measured (appended to $GENQ_FAULT_FIGURES, the source of docs/RELIABILITY.md)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import orjson
import redis
import timescale
from conftest import REPO, RedisServer, genq, genq_env
from pipeline import ConsumerProcess, wait_for

from genq.common.queue.keys import FINISH_NAMES, RunKeys
from genq.common.report.status import read_status

# Short leases keep the suite fast (tests/timescale.py); every bound is stated in their terms.
VT = timescale.VT
# Simulated requests take under a second; a 30 s read timeout bounds any request that never
# comes back, so a lost request shows as a retry in the log rather than a stuck test.
BASE_FLAGS = ("--burst", "--poll", "0.05", "--grace", str(timescale.GRACE), "--server-wait", "15",
              "--request-timeout", "30")


def sim_kwargs(request_s: float, **extra: object) -> dict[str, object]:
    """Simulator flags giving requests of about `request_s` seconds (a mix of stop and length
    finishes at --max-tokens 300)."""
    # ttft 0.5 s + ~200 tokens at 87.5 tok/s ≈ 2.8 simulated seconds per request.
    return {"time_scale": round(2.8 / request_s, 3), "length_dist": "lognormal:200:0.5",
            "max_running_requests": 16, **extra}


def produce_once(data: Path, redis_url: str, run: str) -> None:
    genq("produce", str(data), "--once", "--max-tokens", "300", redis_url=redis_url, run=run)


class Consumer(ConsumerProcess):
    """`genq consume` as a subprocess, optionally under a wrapper command (faketime, prlimit)
    or with extra environment (GENQ_FAULT)."""

    def __init__(self, redis_url: str, run: str, server: str, out: Path, *flags: str,
                 vt: float = VT, concurrency: int = 4, prefix: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, name: str | None = None) -> None:
        self.log_path = Path(tempfile.mkstemp(prefix="genq-consumer-", suffix=".log")[1])
        # With GENQ_FAULT, the consumer that crashes on cue (tests/crashing_consumer.py).
        genq = (["tests/crashing_consumer.py"] if "GENQ_FAULT" in (env or {})
                else ["-m", "genq"])
        args = [*prefix, sys.executable, *genq, "consume", "--server", server,
                "--out", str(out), "--visibility-timeout", str(vt),
                "--concurrency", str(concurrency), "--share-server", *BASE_FLAGS, *flags]
        if name:
            args += ["--name", name]
        # PYTHONFAULTHANDLER: a consumer that hangs is sent SIGABRT and its stacks go to the log.
        # Its own session: `faketime` forks genq as its child, and signals go to both.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**genq_env(redis_url, run), "PYTHONFAULTHANDLER": "1", **(env or {})})

    def signal(self, sig: int) -> None:
        """To genq itself under a wrapper too: SIGSTOP to `faketime` alone pauses nothing."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGABRT)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
            raise AssertionError(f"consumer did not exit in {timeout}s:\n{self.log()[-6000:]}") \
                from None

    def event_names(self) -> Counter:
        return Counter(e.get("event") for e in self.events())


class Background:
    """Any genq service as a subprocess with its log in a temp file (the windowed producer)."""

    def __init__(self, redis_url: str, run: str, *args: str) -> None:
        self.log_path = Path(tempfile.mkstemp(prefix="genq-bg-", suffix=".log")[1])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "genq", *args], cwd=REPO,
                                         env=genq_env(redis_url, run), stdout=log,
                                         stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            with suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(line))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"did not stop on SIGTERM:\n{self.log()[-2000:]}") from None

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log_path.unlink(missing_ok=True)


@contextmanager
def private_redis(*extra: str) -> Iterator[RedisServer]:
    """A redis-server of this test's own, free to be killed and restarted on the same port."""
    directory = Path(tempfile.mkdtemp(prefix="genq-redis-"))
    server = RedisServer(directory, None, *extra)
    server.start()
    try:
        yield server
    finally:
        server.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)


def bits(raw: bytes | None, limit: int) -> set[int]:
    raw = raw or b""
    return {i for i in range(min(limit, len(raw) * 8)) if raw[i // 8] & (0x80 >> (i % 8))}


def done_set(r: redis.Redis, run: str, total: int) -> set[int]:
    return bits(r.get(RunKeys(run).done), total)


def owners(r: redis.Redis, run: str) -> dict[str, str]:
    """job id -> "exec|server|version|attempt" of every live lease."""
    return {j.decode(): o.decode() for j, o in r.hgetall(RunKeys(run).lease_owner).items()}


def claims(r: redis.Redis, run: str, total: int) -> list[int]:
    """Every index's claim count (the record's `attempt`), from the claims bitfield."""
    raw = (r.get(RunKeys(run).claims) or b"").ljust(2 * total, b"\0")  # u16 per index
    return [int.from_bytes(raw[2 * i:2 * i + 2], "big") for i in range(total)]


def shard_lines(r: redis.Redis, run: str) -> tuple[Counter, int]:
    """(lines per index over every shard of the run, lines that are not a whole record)."""
    per_index: Counter = Counter()
    broken = 0
    for directory in r.smembers(RunKeys(run).outdirs):
        for path in Path(directory.decode()).glob(f"{run}.*.jsonl"):
            for line in path.read_bytes().splitlines(keepends=True):
                try:
                    record = orjson.loads(line)
                    if record.get("status") == "failed":  # a failed task's line, no result
                        continue
                    per_index[record["index"]] += 1
                    broken += not line.endswith(b"\n")
                except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                    broken += 1
    return per_index, broken


def check_truth(r: redis.Redis, redis_url: str, run: str, total: int, workdir: Path,
                failed: set[int] = frozenset()) -> dict[str, int]:
    """Assert the run settled with nothing lost and every figure exact; return the figures.

    Exact means: the done bitmap, the finish_reason counters, the token sums and the length
    histogram each count every done index once, `read_status` (what `genq status` prints)
    agrees, and `genq export` writes exactly one whole record per done index.
    """
    k = RunKeys(run)
    done = done_set(r, run, total)
    failed_now = bits(r.get(k.failed), total)
    lost = total - len(done | failed_now)
    assert lost == 0, f"lost {lost}: {sorted(set(range(total)) - done - failed_now)[:20]}"
    assert not done & failed_now
    assert failed_now == set(failed), f"failed {sorted(failed_now)}, expected {sorted(failed)}"
    assert r.llen(k.rq_queue) == 0 and r.zcard(k.leases) == 0 and r.hlen(k.lease_owner) == 0

    out = workdir / f"export-{run}.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run)
    lines = out.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines), "export has a broken line"
    records = [orjson.loads(line) for line in lines]
    indices = [rec["index"] for rec in records]
    assert indices == sorted(done), "export must hold exactly one record per done index"

    counters = {f.decode(): int(v) for f, v in r.hgetall(k.counters).items()}
    finish = {name: counters.get(f"finish:{name}", 0) for name in FINISH_NAMES.values()}
    by_record = Counter(rec["finish_reason"] if rec["finish_reason"] in finish else "other"
                        for rec in records)
    assert {n: c for n, c in finish.items() if c} == dict(by_record)
    assert sum(finish.values()) == len(done)
    assert counters.get("ctok_sum", 0) == sum(rec["completion_tokens"] for rec in records)
    assert counters.get("ptok_sum", 0) == sum(rec["prompt_tokens"] for rec in records)
    hist = {int(v): int(c) for v, c in r.hgetall(k.length_hist).items()}
    assert hist == dict(Counter(rec["completion_tokens"] for rec in records))

    status = read_status(r, run)
    assert (status["done"], status["failed"]) == (len(done), len(failed_now))
    assert status["finish_reasons"] == dict(by_record)

    per_index, broken = shard_lines(r, run)
    assert set(per_index) >= done
    return {"lost": lost, "done": len(done), "failed": len(failed_now),
            "duplicate_lines": sum(per_index.values()) - len(per_index),
            "max_lines_per_index": max(per_index.values(), default=0),
            "broken_shard_lines": broken}


def record_figures(row: str, **figures: object) -> None:
    """Keep what a fault test measured, for docs/RELIABILITY.md (only when asked to)."""
    path = os.environ.get("GENQ_FAULT_FIGURES")
    if path:
        with open(path, "ab") as f:
            f.write(orjson.dumps({"row": row, **figures}) + b"\n")


def wait_done(r: redis.Redis, run: str, at_least: int, timeout: float = 60) -> None:
    k = RunKeys(run)
    wait_for(lambda: r.bitcount(k.done) >= at_least, timeout=timeout,
             what=f"{at_least} prompts done")


def first_progress_after(r: redis.Redis, run: str, timeout: float = 60) -> float:
    """Seconds until the done count next rises (how long recovery took)."""
    k = RunKeys(run)
    start, before = time.monotonic(), r.bitcount(k.done)
    wait_for(lambda: r.bitcount(k.done) > before, timeout=timeout, interval=0.02,
             what="progress after the fault ended")
    return round(time.monotonic() - start, 2)
