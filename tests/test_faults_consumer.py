"""Faults of the consumer process itself: SIGKILL mid-request, mid-write and between write and
ack, a SIGSTOP past its lease, and a clock 90 s ahead. Each run must end with nothing lost,
every figure exact, and the bound the row promises."""

from __future__ import annotations

import re
import shutil
import signal
import time
from datetime import datetime

import orjson
import pytest
from conftest import genq
from faultkit import (
    VT,
    Consumer,
    check_truth,
    claims,
    done_set,
    owners,
    produce_once,
    record_figures,
    shard_lines,
    sim_kwargs,
)
from pipeline import read_jsonl, wait_for, write_dataset
from rq.job import Job
from rq.registry import FailedJobRegistry

from genq.common.queue.keys import RunKeys
from genq.consumer.servers import identity

pytestmark = pytest.mark.slow  # a kill of every kind, each waited out in leases


def held_by(r, run: str, server: str) -> set[str]:
    """The jobs leased by the consumer driving `server` (its URL): a lease names the server as
    the cluster knows it (consumer/servers.identity)."""
    return {job for job, owner in owners(r, run).items()
            if owner.split("|")[1] == identity(server)}


def test_sigkill_mid_request_returns_its_tasks_within_the_visibility_timeout(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 40
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim_a, sim_b = sim_factory(**sim_kwargs(1.0)), sim_factory(**sim_kwargs(0.2))
    victim = Consumer(redis_url, run_name, sim_a.url, tmp_path / "a")
    survivor = Consumer(redis_url, run_name, sim_b.url, tmp_path / "b")
    try:
        wait_for(lambda: len(held_by(r, run_name, sim_a.url)) >= 3, what="victim mid-request")
        stranded = held_by(r, run_name, sim_a.url)
        victim.kill()
        killed_at = time.monotonic()
        # Back in the queue (or already taken by the survivor): no longer the victim's lease.
        wait_for(lambda: not stranded & held_by(r, run_name, sim_a.url), timeout=VT + 10,
                 interval=0.02, what="the killed consumer's leases reaped")
        back_after = time.monotonic() - killed_at
        assert survivor.wait(60) == 0, survivor.log()[-3000:]
    finally:
        victim.cleanup()
        survivor.cleanup()
    assert back_after <= VT + 5
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    record_figures("sigkill_mid_request", recovery_s=round(back_after, 2), bound_s=VT + 5,
                   stranded=len(stranded), **figures)


def torn_index(shard_dir) -> tuple[int, int]:
    """(index of the torn last line, its length) in the one shard of a dead consumer."""
    (shard,) = shard_dir.glob("*.jsonl")
    data = shard.read_bytes()
    assert not data.endswith(b"\n"), "the fault hook should have left a torn last line"
    tail = data[data.rfind(b"\n") + 1:]
    return int(re.match(rb'\{"index":(\d+)', tail).group(1)), len(tail)


def test_sigkill_mid_write_tail_repaired_at_restart_task_redone(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 30
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    out = tmp_path / "out"
    first = Consumer(redis_url, run_name, sim.url, out, env={"GENQ_FAULT": "torn_write:5"})
    second = None
    try:
        assert first.proc.wait(60) == -signal.SIGKILL, first.log()[-3000:]
        torn, torn_bytes = torn_index(out)
        assert torn not in done_set(r, run_name, n)
        restarted_at = time.monotonic()
        second = Consumer(redis_url, run_name, sim.url, out)
        assert second.wait(60) == 0, second.log()[-3000:]
        took = time.monotonic() - restarted_at
        repaired = [e for e in second.events() if e.get("event") == "torn_tail_repaired"]
    finally:
        for c in (first, second):
            if c is not None:
                c.cleanup()
    assert [e["bytes_removed"] for e in repaired] == [torn_bytes]
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    assert figures["broken_shard_lines"] == 0
    # The torn record's task was done again, by a later attempt.
    assert claims(r, run_name, n)[torn] >= 2
    record_figures("sigkill_mid_write", restart_to_done_s=round(took, 2),
                   torn_bytes_removed=torn_bytes, **figures)


def test_sigkill_between_write_and_ack_leaves_at_most_one_duplicate_line(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 30
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    out = tmp_path / "out"
    first = Consumer(redis_url, run_name, sim.url, out, env={"GENQ_FAULT": "kill_after_write:5"})
    second = None
    try:
        assert first.proc.wait(60) == -signal.SIGKILL, first.log()[-3000:]
        written, _ = shard_lines(r, run_name)
        unacked = set(written) - done_set(r, run_name, n)
        # The fifth record, and any other whose ack had not gone out yet.
        assert 1 <= len(unacked) <= 4
        second = Consumer(redis_url, run_name, sim.url, out)
        assert second.wait(60) == 0, second.log()[-3000:]
    finally:
        for c in (first, second):
            if c is not None:
                c.cleanup()
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    per_index, _ = shard_lines(r, run_name)
    assert figures["max_lines_per_index"] <= 2
    assert {i for i, c in per_index.items() if c > 1} <= unacked
    record_figures("kill_between_write_and_ack", **figures)


@pytest.mark.timeout(150)
def test_sigstop_past_the_lease_gets_stale_acks_refused(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 30
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim_a, sim_b = sim_factory(**sim_kwargs(1.0)), sim_factory(**sim_kwargs(0.2))
    zombie = Consumer(redis_url, run_name, sim_a.url, tmp_path / "a")
    other = Consumer(redis_url, run_name, sim_b.url, tmp_path / "b")
    try:
        wait_for(lambda: len(held_by(r, run_name, sim_a.url)) >= 3, what="zombie mid-request")
        zombie.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(0.3)  # an ack already sent lands; then what it holds is frozen for sure
        frozen = held_by(r, run_name, sim_a.url)
        assert frozen
        # The other consumer reaps the frozen leases and finishes everything meanwhile.
        assert other.wait(60) == 0, other.log()[-3000:]
        paused_s = time.monotonic() - stopped_at
        assert frozen <= {f"{run_name}-{i}" for i in done_set(r, run_name, n)}
        # Its leases expired while it was stopped: another claim took them over.
        attempts = claims(r, run_name, n)
        assert all(attempts[int(job.rsplit("-", 1)[1])] >= 2 for job in frozen)
        zombie.signal(signal.SIGCONT)
        assert zombie.wait(60) == 0, zombie.log()[-3000:]
        seen = zombie.event_names()
    finally:
        zombie.cleanup()
        other.cleanup()
    refused = seen["lease_lost"] + seen["ack_refused"]
    assert refused == len(frozen), seen  # every stale result refused, none accepted
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    record_figures("sigstop_past_lease", paused_s=round(paused_s, 1), frozen=len(frozen),
                   stale_refused=refused, **figures)


def test_consumer_clock_90s_ahead_causes_no_premature_reclaim(
        tmp_path, redis_url, r, run_name, sim_factory):
    # Never skipped: a missing tool must fail loudly (.ci/run installs it).
    assert shutil.which("faketime"), "faketime is not installed (apt-get install faketime)"
    n = 16
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    # Requests outlast the lease, so both consumers must renew, and both reap meanwhile.
    sim = sim_factory(**sim_kwargs(2.0 * VT))
    ahead = Consumer(redis_url, run_name, sim.url, tmp_path / "a",
                     prefix=("faketime", "-m", "-f", "+90s"))
    normal = Consumer(redis_url, run_name, sim.url, tmp_path / "b")
    try:
        assert ahead.wait(90) == 0, ahead.log()[-3000:]
        assert normal.wait(90) == 0, normal.log()[-3000:]
        logged = [datetime.fromisoformat(e["timestamp"]).timestamp() for e in ahead.events()
                  if "timestamp" in e]
    finally:
        ahead.cleanup()
        normal.cleanup()
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    # Every prompt ran exactly once: no lease was taken away from a live consumer.
    assert claims(r, run_name, n) == [1] * n
    assert not r.hlen(RunKeys(run_name).errors)
    assert figures["duplicate_lines"] == 0
    # The skewed consumer did its share with its clock 90 s ahead (its log says so), and dated
    # its records by Redis's clock all the same.
    skewed = read_jsonl(next((tmp_path / "a").glob("*.jsonl")))
    assert logged and min(logged) > time.time() + 60
    assert skewed and max(abs(rec["created_at"] - time.time()) for rec in skewed) < 60
    record_figures("clock_90s_ahead", premature_reclaims=0, **figures)


def test_task_that_kills_its_consumer_every_time_fails_after_max_attempts(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 1
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.1))
    exits = []
    for _ in range(3):
        c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "2",
                     env={"GENQ_FAULT": "kill_after_write:1"})
        try:
            exits.append(c.wait(60))
        finally:
            c.cleanup()
    # Attempts are counted at claim: two crashes spend both, the third claim gives up.
    assert exits == [-signal.SIGKILL, -signal.SIGKILL, 0]
    check_truth(r, redis_url, run_name, n, tmp_path, failed={0})
    [job_id] = FailedJobRegistry(RunKeys(run_name).queue_name, connection=r).get_job_ids()
    reason = Job.fetch(job_id, connection=r).latest_result().exc_string
    assert "gave up after 2 attempts" in reason and "lease expired" in reason
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert (status["done"], status["failed"]) == (0, 1)
