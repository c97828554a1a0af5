"""End to end as a user runs it: produce, two consumers in burst mode against the simulator,
status and export agreeing exactly, RQ's own view of the run, and clear errors for bad input."""

from __future__ import annotations

import subprocess
import threading
from collections import Counter

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, status_json, wait_for, write_dataset
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys

RECORD_KEYS = {"index", "id", "params_version", "finish_reason", "prompt_tokens",
               "completion_tokens", "reasoning_content", "content", "server", "attempt"}


@pytest.mark.timeout(180)
def test_two_consumers_export_every_index_once_and_status_agrees(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 300
    data = write_dataset(tmp_path / "data.jsonl", n, bad_json=(7,), no_fields=(11,))
    sim = sim_factory(time_scale=400, max_running_requests=12)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    consumers = [ConsumerProcess(redis_url, run_name, sim.url, tmp_path / f"out{i}", "--burst")
                 for i in range(2)]
    try:
        # Mid-run: the simulator's slots all fill and rq sees the in-flight jobs. Waited for,
        # not sampled once: on a loaded machine an instant between answers shows fewer.
        def running() -> int:
            return httpx.get(sim.url + "/v1/loads").json()["loads"][0]["num_running_reqs"]
        wait_for(lambda: running() == 12, what="the simulator's 12 slots all running")
        q = Queue(k.queue_name, connection=r)
        started = StartedJobRegistry(queue=q).get_job_ids(cleanup=False)
        # Each consumer holds its 12 running, 3 claimed ahead (consumer/ready.py) and the
        # answers still being written and acked (at most 12 before its slots wait).
        held_most = 2 * (12 + 3 + 12)
        assert 12 <= len(started) <= held_most
        assert all(jid.startswith(run_name) for jid in started)
        info = subprocess.run(["rq", "info", "-u", redis_url, "--only-queues"],
                              capture_output=True, text=True, timeout=30)
        assert info.returncode == 0 and k.queue_name in info.stdout
        for c in consumers:
            assert c.wait(120) == 0, c.log()[-2000:]
    finally:
        for c in consumers:
            c.cleanup()
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    records = read_jsonl(out)
    assert [rec["index"] for rec in records] == [i for i in range(n) if i not in (7, 11)]
    assert all(rec.keys() >= RECORD_KEYS for rec in records)
    assert records[0]["id"] == "p0"
    status = status_json(redis_url, run_name)
    assert status["done"] == len(records) and status["failed"] == 2
    assert status["finish_reasons"] == dict(Counter(rec["finish_reason"] for rec in records))
    lengths = sorted(rec["completion_tokens"] for rec in records)
    assert status["output_tokens"]["max"] == lengths[-1]
    assert status["output_tokens"]["mean"] == pytest.approx(sum(lengths) / len(lengths), 0.01)
    # RQ agrees after the run, through its own classes.
    q = Queue(k.queue_name, connection=r)
    assert len(q) == 0 and StartedJobRegistry(queue=q).count == 0
    # rq's tools keep the last FINISHED_KEEP finished jobs, not one hash per prompt.
    finished = FinishedJobRegistry(queue=q).get_job_ids()
    assert len(finished) == min(len(records), scripts.FINISHED_KEEP)
    assert all(r.getbit(k.done, int(jid.rsplit("-", 1)[1])) for jid in finished)
    assert sorted(x["count"] for x in status["failure_reasons"]) == [1, 1]
    failed = FailedJobRegistry(queue=q).get_job_ids()
    assert sorted(failed) == sorted([f"{run_name}-7", f"{run_name}-11"])
    reason = Job.fetch(f"{run_name}-7", connection=r).latest_result().exc_string
    assert "row 7: not valid JSON" in reason


def test_produce_twice_enqueues_nothing_twice(tmp_path, redis_url, r, run_name):
    data = write_dataset(tmp_path / "d.jsonl", 50)
    first = genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    second = genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    assert "enqueued 50 of 50" in first.stdout and "enqueued 0 of 50" in second.stdout
    assert r.llen(RunKeys(run_name).rq_queue) == 50


def test_windowed_producer_keeps_a_bounded_queue(tmp_path, redis_url, r, run_name):
    data = write_dataset(tmp_path / "d.jsonl", 5000)
    proc = subprocess.Popen(["python", "-m", "genq", "produce", str(data), "--window", "100",
                             "--interval", "0.05"],
                            env=__import__("conftest").genq_env(redis_url, run_name),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    k = RunKeys(run_name)
    try:
        wait_for(lambda: r.llen(k.rq_queue) == 100, what="window filled")
        r.delete(k.rq_queue)  # as if consumers drained it (their jobs stay pending)
        wait_for(lambda: r.llen(k.rq_queue) == 100, what="window topped up")
        assert r.bitcount(k.pending) == 200
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_other_dataset_for_existing_run_is_refused(tmp_path, redis_url, run_name):
    genq("produce", str(write_dataset(tmp_path / "a.jsonl", 5)), "--once",
         redis_url=redis_url, run=run_name)
    other = genq("produce", str(write_dataset(tmp_path / "b.jsonl", 6)), "--once",
                 redis_url=redis_url, run=run_name, check=False)
    assert other.returncode != 0
    assert "use another --run" in other.stderr and "Traceback" not in other.stderr


@pytest.mark.parametrize("args, message", [
    (["produce", "/nonexistent/data.jsonl", "--once"], "data set not found"),
    (["status"], "unknown run"),
    (["export", "--out", "/tmp/x.jsonl"], "unknown run"),
    (["consume", "--server", "http://127.0.0.1:9", "--burst"], "unknown run"),
    (["produce", "x.jsonl", "--set", "max_tokens=-5"], "max_tokens"),
    (["consume", "--server", "gpu0:30000"], "must be an http"),
])
def test_bad_input_gives_one_clear_line(redis_url, run_name, args, message):
    proc = genq(*args, redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_redis_and_server_are_named(tmp_path, redis_url, run_name):
    proc = genq("status", redis_url="redis://127.0.0.1:1/0", run=run_name, check=False)
    assert proc.returncode != 0 and "127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr
    genq("produce", str(write_dataset(tmp_path / "a.jsonl", 3)), "--once",
         redis_url=redis_url, run=run_name)
    proc = genq("consume", "--server", "http://127.0.0.1:9", "--server-wait", "0",
                "--out", str(tmp_path / "o"), redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode == 1 and "cannot reach SGLang server http://127.0.0.1:9" in proc.stderr


def test_sigterm_gives_back_inflight_work(tmp_path, redis_url, r, run_name, sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", 40)
    sim = sim_factory(time_scale=5, max_running_requests=4)  # slow: requests stay in flight
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--grace", "0")
    try:
        wait_for(lambda: r.zcard(k.leases) >= 4, what="4 leases (and one claimed ahead)")
        c.signal(15)
        assert c.wait(30) == 0
    finally:
        c.cleanup()
    assert r.zcard(k.leases) == 0
    assert r.llen(k.rq_queue) + r.bitcount(k.done) == 40
    spent = r.bitfield(k.spent)
    for i in range(40):
        spent.get("u8", f"#{i}")
    assert set(spent.execute()) <= {0}  # a shutdown spends no attempt


def test_status_during_run_is_readable(tmp_path, redis_url, run_name, sim_factory):
    """`genq status` (the table) works while consumers run, from another thread."""
    data = write_dataset(tmp_path / "d.jsonl", 60)
    sim = sim_factory(time_scale=400)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--burst")
    outputs: list[str] = []
    t = threading.Thread(target=lambda: outputs.append(
        genq("status", redis_url=redis_url, run=run_name).stdout))
    t.start()
    try:
        assert c.wait(60) == 0
    finally:
        t.join()
        c.cleanup()
    assert run_name in outputs[0]


def test_risky_redis_settings_are_named_at_start(tmp_path, run_name):
    """A Redis without AOF: the producer says what that risks, once, and goes on."""
    from faultkit import private_redis

    with private_redis() as srv:
        proc = genq("produce", str(write_dataset(tmp_path / "d.jsonl", 3)), "--once",
                    redis_url=srv.url, run=run_name)
        risks = settings_risks(proc.stderr)
        assert len(risks) == 1 and risks[0].startswith("appendonly is not yes")
        client = srv.client()
        client.config_set("appendonly", "yes")
        client.close()
        proc = genq("produce", str(tmp_path / "d.jsonl"), "--once", redis_url=srv.url,
                    run=run_name)
        assert settings_risks(proc.stderr) == []


def settings_risks(log: str) -> list[str]:
    events = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [e["risk"] for e in events if e.get("event") == "redis_settings"]
