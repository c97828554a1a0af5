"""Lost run state: consumers notice that Redis forgot the run (or holds a re-created one of the
same name), stop claiming and writing, say so once with the fixing command, and resume when the
run is back; status says what happened; a stale epoch can never queue work."""

from __future__ import annotations

import time

import orjson
import pytest
from conftest import genq
from faultkit import Consumer, private_redis
from pipeline import wait_for, write_dataset

from genq.common.data.dataset import open_dataset
from genq.common.errors import RunStateLost
from genq.common.queue import feed
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import register
from genq.common.queue.scripts import ScriptRunner


def forget_run(r, k: RunKeys) -> None:
    """What a Redis restart without persistence does to one run (the shared test Redis holds
    other tests' runs, so no FLUSHALL)."""
    keys = [key for key in r.scan_iter(match=f"{k.prefix}*") if b":consumer" not in key]
    r.delete(*keys, k.rq_queue)


def test_a_stale_epoch_queues_nothing(tmp_path, redis_url, r, run_name):
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 5)),
         "--once", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    r.delete(k.rq_queue, k.pending)
    with pytest.raises(RunStateLost):
        feed.enqueue(r, k, [0, 1], ScriptRunner(r), epoch="not-this-run")
    assert r.llen(k.rq_queue) == 0
    epoch = r.hget(k.meta, "epoch").decode()
    assert feed.enqueue(r, k, [0, 1], ScriptRunner(r), epoch=epoch) == 2


@pytest.mark.timeout(120)
def test_consumer_waits_while_the_run_is_lost_and_stops_when_it_is_recreated(
        tmp_path, redis_url, r, run_name, sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", 400)
    sim = sim_factory(time_scale=20, length_dist="fixed:60", max_running_requests=4)
    k = RunKeys(run_name)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    out = tmp_path / "out"
    c = Consumer(redis_url, run_name, sim.url, out)
    try:
        wait_for(lambda: r.bitcount(k.done) >= 4, what="4 done")
        forget_run(r, k)
        lost_at = time.time()
        wait_for(lambda: "run_state_lost" in c.log(), what="run_state_lost")
        [event] = [e for e in c.events() if e["event"] == "run_state_lost"]
        assert event["command"] == f"genq recover --shards {out} --run {run_name}"
        time.sleep(1.5)
        # Nothing was queued again or claimed; status says what happened and what to run.
        assert r.llen(k.rq_queue) == 0 and not r.exists(k.meta) and not r.exists(k.done)
        st = genq("status", redis_url=redis_url, run=run_name, check=False)
        assert st.returncode != 0 and "lost its state" in st.stderr
        assert f"genq recover --shards {out} --run {run_name}" in st.stderr
        # A different run registered under the same name (`genq produce` would wait for the
        # recover while a consumer waits: tests/test_loss_producer.py).
        register(r, k, str(data), open_dataset(data).fingerprint, 400)
        assert c.wait(30) == 1
        assert "was registered again" in c.log() and "run_replaced" in c.log()
    finally:
        c.cleanup()
    # Nothing this consumer wrote after the loss used the new run's parameters.
    lines = [orjson.loads(x) for p in out.glob("*.jsonl") for x in p.read_bytes().splitlines()]
    assert all(rec["completion_tokens"] == 60 for rec in lines)
    assert all(rec["params_version"] == 1 for rec in lines if rec["created_at"] >= lost_at)
    # (A consumer of the new run started on `out` writes beside it: tests/test_second_run.py.)
    # recover refuses to mix the two, and --replace brings the earlier one back.
    proc = genq("recover", "--shards", str(out), redis_url=redis_url, run=run_name,
                check=False)
    assert proc.returncode == 1 and "--replace" in proc.stderr
    proc = genq("recover", "--shards", str(out), "--replace", redis_url=redis_url,
                run=run_name)
    # Every index the earlier run wrote stands again, no more: the count, not merely a success.
    done = len({rec["index"] for rec in lines})
    assert f"recovered run {run_name!r}: {done} of 400 done," in proc.stdout, proc.stdout
    assert r.bitcount(k.done) >= 4 and r.hget(k.params, "1") is not None


@pytest.mark.timeout(60)
def test_status_warns_when_redis_runs_without_persistence(tmp_path, run_name):
    data = write_dataset(tmp_path / "d.jsonl", 3)
    with private_redis() as srv:
        genq("produce", str(data), "--once", redis_url=srv.url, run=run_name)
        st = orjson.loads(genq("status", "--json", redis_url=srv.url, run=run_name).stdout)
        [alert] = [a for a in st["alerts"] if a["kind"] == "redis_no_persistence"]
        assert alert["command"] == "redis-cli CONFIG SET appendonly yes"
        assert "genq recover --shards" in alert["message"]
        table = genq("status", redis_url=srv.url, run=run_name).stdout
        assert "without persistence" in table
        srv.client().config_set("appendonly", "yes")
        st = orjson.loads(genq("status", "--json", redis_url=srv.url, run=run_name).stdout)
        assert not [a for a in st["alerts"] if a["kind"] == "redis_no_persistence"]


def test_monitor_says_when_the_run_is_lost_or_recreated(tmp_path, redis_url, r, run_name):
    from genq.common.queue import run as runs
    from genq.monitor.service import StatusSource

    data = write_dataset(tmp_path / "d.jsonl", 4)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    source = StatusSource(r, run_name, url=redis_url, truncation_threshold=0.05)
    status, error = source.read()
    assert error is None and not [a for a in status["alerts"] if a["kind"] == "run_replaced"]
    k = RunKeys(run_name)
    forget_run(r, k)
    status, error = source.read()
    assert status is None and "genq recover --shards" in error
    runs.register(r, k, str(data), "4r-fp", 4)  # registered again: a new epoch
    status, error = source.read()
    [alert] = [a for a in status["alerts"] if a["kind"] == "run_replaced"]
    assert "registered again" in alert["message"] and "--replace" in alert["message"]
