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
from conftest import REPO, genq, genq_env

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


def status_json(redis_url: str, run: str) -> dict:
    """`genq status --json`, parsed."""
    return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run).stdout)


def exported(tmp_path: Path, redis_url: str, run: str, *flags: str,
             name: str = "export.jsonl") -> list[dict]:
    """`genq export --out tmp_path/name *flags`, its records."""
    out = tmp_path / name
    genq("export", "--out", str(out), *flags, redis_url=redis_url, run=run)
    return read_jsonl(out)


def one_at_a_time(server, tmp_path: Path, redis_url: str, run: str,
                  name: str = "all.jsonl", concurrency: int = 1) -> list[dict]:
    """The real tier's consume and export: `server` asked one request at a time (a greedy answer
    is then the one a lone request gets, and each turn meets the cache the turn before left;
    sampled answers may take `concurrency` at once, each conversation's turns still in order),
    with time for a real server to start, to the end; the export's records."""
    consume_to_the_end(redis_url, run, server.url, tmp_path / "out", "--concurrency",
                       str(concurrency), "--server-wait", "300", timeout=600)
    return exported(tmp_path, redis_url, run, name=name)


def continue_truncated(redis_url: str, run: str, max_tokens: int, partials: int,
                       *flags: str) -> str:
    """`genq requeue --set max_tokens=N --redo truncated --continue *flags`, checked to keep
    `partials` partial answers; its output."""
    out = genq("requeue", "--set", f"max_tokens={max_tokens}", "--redo", "truncated",
               "--continue", *flags, redis_url=redis_url, run=run).stdout
    assert f"partials kept for --continue: {partials} " in out, out
    return out


def redone_chains(chains: dict, before: dict, cut: dict):
    """(index, chain, cut turn) of each conversation a redo made again from its cut turn, once
    it is checked that every other conversation is untouched and that the turns before the cut
    are the same lines (kept, not made again)."""
    for index, chain in chains.items():
        old = before[index]
        if index not in cut:
            assert chain == old, index  # untouched
            continue
        t = cut[index]["turn"]
        assert chain[:t - 1] == old[:t - 1], index  # the same lines: kept, not made again
        yield index, chain, t


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
