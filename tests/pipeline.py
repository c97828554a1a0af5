"""Helpers for end-to-end tests: data sets on disk, consumers as real subprocesses, waiting on
the run's truth in Redis."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import redis
from conftest import REPO, genq_env

from genq.common.task import Request

BAD_MARKER = "__GENQ_BAD__"


def write_dataset(path: Path, n: int, *, bad_json: tuple[int, ...] = (),
                  no_fields: tuple[int, ...] = (), poison: tuple[int, ...] = ()) -> Path:
    """n rows of chat messages; chosen rows broken or poisoned (the simulator answers 400)."""
    with open(path, "w") as f:
        for i in range(n):
            if i in bad_json:
                f.write('{"messages": [this is not json\n')
            elif i in no_fields:
                f.write(json.dumps({"id": f"p{i}", "text": "no messages here"}) + "\n")
            else:
                text = f"Write program number {i}." + (f" {BAD_MARKER}" if i in poison else "")
                row = {"id": f"p{i}", "messages": [{"role": "user", "content": text}]}
                f.write(json.dumps(row) + "\n")
    return path


class ConsumerProcess:
    """`genq consume` as a subprocess a test can signal, kill, pause and resume."""

    def __init__(self, redis_url: str, run: str, server: str, out: Path, *flags: str) -> None:
        self.log_path = Path(tempfile.mkstemp(prefix="genq-consumer-", suffix=".log")[1])
        # --share-server: tests put several consumers on one simulator on purpose.
        args = [sys.executable, "-m", "genq", "consume", "--server", server, "--share-server",
                "--out", str(out), *flags]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, cwd=REPO, env=genq_env(redis_url, run),
                                         stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(line))
        return out

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"consumer did not exit in {timeout}s:\n{self.log()[-3000:]}") from None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)


def consume_to_the_end(redis_url: str, run: str, server: str, out: Path, *flags: str,
                       timeout: float = 90) -> None:
    """`genq consume --burst` on `server` until the run settles; its log if it fails."""
    consumer = ConsumerProcess(redis_url, run, server, out, "--burst", *flags)
    try:
        assert consumer.wait(timeout) == 0, consumer.log()[-3000:]
    finally:
        consumer.cleanup()


def bitcount(r: redis.Redis, key: str) -> int:
    return int(r.bitcount(key))


def wait_for(predicate, timeout: float = 30, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def take_leases(r: redis.Redis, run: str, indices: list[int], server: str) -> None:
    """Lease these indices to `server` the real way (enqueue.lua, then claim.lua), so a test's
    hand-set run holds leases exactly as consumers write them."""
    from genq.common.queue import feed, scripts
    from genq.common.queue.keys import RunKeys

    k, runner = RunKeys(run), scripts.ScriptRunner(r)
    assert r.llen(k.rq_queue) == 0, "take leases before queueing other jobs"
    assert feed.enqueue(r, k, indices, runner) == len(indices)
    _, *rows = runner(scripts.claim_call(k, len(indices), 60.0, server, "w", "populate"))
    assert sorted(int(row[1]) for row in rows) == sorted(indices)


def queue_jobs(r: redis.Redis, run: str, indices: list[int]) -> None:
    """Queue these indices as the producer does (enqueue.lua)."""
    from genq.common.queue import feed, scripts
    from genq.common.queue.keys import RunKeys

    k = RunKeys(run)
    assert feed.enqueue(r, k, indices, scripts.ScriptRunner(r)) == len(indices)


def record_failure(r: redis.Redis, k, index: int, reason: str) -> None:
    """What fail.lua keeps of a failed index's reason: the number of its kind (for tests that
    build a run's state by hand)."""
    from genq.common.errors import reason_kind

    kind = reason_kind(reason)
    number = r.hget(k.fail_kinds, kind) or r.hlen(k.fail_kinds) + 1
    r.hset(k.fail_kinds, kind, number)
    r.bitfield(k.fail_kind).set("u8", f"#{index}", int(number)).execute()


def failure_reason(r: redis.Redis, k, index: int) -> str:
    from genq.common.queue.run import failure_reasons

    return failure_reasons(r, k, [index])[0]


def request_of(body: dict) -> Request:
    """The Request whose body() is this plain body (a test's request_body, its parameters
    changed), for what takes a request rather than a body (continue_answer)."""
    return Request(messages=body["messages"], model=body["model"], tools=body.get("tools"),
                   params={k: v for k, v in body.items()
                           if k not in ("messages", "model", "tools")})
