"""The partials `genq requeue --continue` keeps: used only for the version they were made for,
gone with every later parameter change and with a prompt that fails for good, not looked for
once none is left; and what a continued answer counts."""

from __future__ import annotations

import threading

import orjson
import pytest
import redis
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, wait_for, write_dataset

from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys

# Nearly every first answer is cut at 50 tokens (lengths lognormal around 300).
FIRST = ("--max-tokens", "50")
SIM = {"time_scale": 1000, "reasoning_parser": "qwen3", "length_dist": "lognormal:300:0.8"}
CONTINUE = ("--set", "max_tokens=200", "--redo", "truncated", "--continue")


def run_to_end(redis_url, run, sim, out, *flags) -> None:
    c = ConsumerProcess(redis_url, run, sim.url, out, "--burst", *flags)
    assert c.wait(120) == 0, c.log()[-3000:]
    c.cleanup()


def export(tmp_path, redis_url, run) -> dict[int, dict]:
    out = tmp_path / f"{run}.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run)
    return {rec["index"]: rec for rec in read_jsonl(out)}


def first_pass(tmp_path, redis_url, run, sim, n: int, **data) -> dict[int, dict]:
    """The truncated first answers (nearly all)."""
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", n, **data)), "--once", *FIRST,
         redis_url=redis_url, run=run)
    run_to_end(redis_url, run, sim, tmp_path / "out")
    first = export(tmp_path, redis_url, run)
    return {i: rec for i, rec in first.items() if rec["finish_reason"] == "length"}


@pytest.mark.slow  # three requeues, run to the end each
@pytest.mark.timeout(300)
def test_a_later_requeue_drops_the_partials_and_never_continues_them(
        tmp_path, redis_url, r, run_name, sim_factory):
    sim, n, k = sim_factory(**SIM), 30, RunKeys(run_name)
    cut = first_pass(tmp_path, redis_url, run_name, sim, n)
    genq("requeue", *CONTINUE, redis_url=redis_url, run=run_name)
    assert r.hlen(k.partials) == len(cut)
    # New parameters before any partial was continued: they were made for version 2 only.
    genq("requeue", "--set", "max_tokens=300", "--redo", "all", redis_url=redis_url,
         run=run_name)
    assert not r.exists(k.partials)
    run_to_end(redis_url, run_name, sim, tmp_path / "out")
    records = export(tmp_path, redis_url, run_name)
    assert {rec["params_version"] for rec in records.values()} == {3}  # --redo all
    assert not [i for i, rec in records.items() if rec.get("continued_from")]


@pytest.mark.timeout(300)
def test_a_prompt_that_fails_for_good_drops_its_partial(tmp_path, redis_url, r, run_name,
                                                        sim_factory):
    n, poison, k = 20, (3, 7), RunKeys(run_name)
    lenient = sim_factory(bad_marker="__NOT_IN_ANY_PROMPT__", **SIM)
    cut = first_pass(tmp_path, redis_url, run_name, lenient, n, poison=poison)
    assert set(poison) <= set(cut)
    genq("requeue", *CONTINUE, redis_url=redis_url, run=run_name)
    assert r.hlen(k.partials) == len(cut)
    run_to_end(redis_url, run_name, sim_factory(**SIM), tmp_path / "out")  # refuses poison
    records = export(tmp_path, redis_url, run_name)
    assert {records[i]["params_version"] for i in poison} == {1}  # failed: the old one kept
    assert r.hkeys(k.partials) == []


@pytest.mark.timeout(300)
def test_a_continuation_past_the_context_is_generated_anew(tmp_path, redis_url, r, run_name,
                                                          sim_factory):
    n, k = 20, RunKeys(run_name)
    first = first_pass(tmp_path, redis_url, run_name, sim_factory(**SIM), n)
    genq("requeue", *CONTINUE, redis_url=redis_url, run=run_name)
    # A server whose context holds every prompt but no prompt with its 50-token partial.
    context = max(rec["prompt_tokens"] for rec in first.values()) + 20
    small = sim_factory(context_length=context, **SIM)
    run_to_end(redis_url, run_name, small, tmp_path / "out")
    records = export(tmp_path, redis_url, run_name)
    assert r.bitcount(k.failed) == 0
    assert {records[i]["params_version"] for i in first} == {2}
    assert not [i for i, rec in records.items() if rec.get("continued_from")]
    assert r.hlen(k.partials) == 0


LOOKUPS = {"HGET", "HMGET", "HEXISTS", "HLEN", "EXISTS", "HSCAN", "HGETALL"}


class KeyWatch(threading.Thread):
    """Every lookup of `key` Redis runs (MONITOR), until stopped."""

    def __init__(self, redis_url: str, key: str, beat_prefix: str = "") -> None:
        super().__init__(daemon=True)
        self.conn, self.key = redis.Redis.from_url(redis_url), key
        self.seen: list[str] = []
        self.beat_prefix, self.beats = beat_prefix, 0  # consumers' heartbeats seen
        self.stop_now = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        with self.conn.monitor() as m:
            self.ready.set()
            while not self.stop_now.is_set():
                command = m.next_command()["command"]
                verb, _, rest = command.partition(" ")
                if self.beat_prefix and verb.upper() == "SET" and rest.startswith(self.beat_prefix):
                    self.beats += 1
                # Lookups only: the ack script deletes partials in the same call (not a trip).
                if self.key in command and command.split()[0].upper() in LOOKUPS:
                    self.seen.append(command)


@pytest.mark.timeout(300)
def test_consumers_stop_looking_once_no_partial_is_left(tmp_path, redis_url, r, run_name,
                                                        sim_factory):
    from test_probe import settled

    sim, n, k = sim_factory(**SIM), 30, RunKeys(run_name)
    first_pass(tmp_path, redis_url, run_name, sim, n)
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out")
    try:
        genq("requeue", *CONTINUE, redis_url=redis_url, run=run_name)
        wait_for(lambda: settled(r, k, n) and not r.exists(k.partials), timeout=120,
                 what="the continued answers")
        watch = KeyWatch(redis_url, k.partials, beat_prefix=k.consumer(""))
        watch.start()
        watch.ready.wait(10)
        genq("requeue", "--set", "max_tokens=300", "--redo", "all", redis_url=redis_url,
             run=run_name)
        wait_for(lambda: settled(r, k, n), timeout=120, what="the redo")  # it cleared done
        # Several heartbeats and parameter watches go by: none may ask again.
        beats = watch.beats
        wait_for(lambda: watch.beats >= beats + 3, timeout=30, what="three more heartbeats")
        watch.stop_now.set()
        r.ping()  # wakes the monitor to see its stop
        watch.join(10)
    finally:
        consumer.cleanup()
    # One look when the consumer first meets version 3, none per task or per heartbeat.
    assert len(watch.seen) <= 1, watch.seen


def test_the_rate_counts_only_the_tokens_decoded_now(r, run_name):
    from test_scripts import claim, setup_run

    k, runner = setup_run(r, run_name, 1)
    jid, idx, ex, att = claim(runner, k)[0]
    result = scripts.Result(job_id=jid, index=idx, exec_id=ex, completion_tokens=400,
                            prompt_tokens=7, finish_reason="stop", version=1, attempt=att,
                            continued=300)
    assert runner(scripts.ack_many_call(k, "s", [result])) == [1]
    [bucket] = r.keys(k.rate_prefix + "*")
    assert (int(r.hget(bucket, "tok")), int(r.hget(bucket, "tok|s"))) == (100, 100)
    assert r.hget(k.counters, "ctok_sum") == b"400"  # the answer is 400 tokens long all the same


def test_partials_are_written_as_they_are_read_in_bounded_batches(r, run_name):
    from genq.common.sglang import continuation

    k, n, bound = RunKeys(run_name), 5000, 2000
    behind: list[int] = []  # records read but not yet in Redis, at each read

    def records():
        for i in range(n):
            behind.append(i - r.hlen(k.partials))
            yield {"index": i, "reasoning_content": "x" * 200, "content": "y" * 200,
                   "completion_tokens": 100, "prompt_tokens": 10, "params_version": 1,
                   "attempt": 1}

    r.hset(k.partials, "999999", b"old")  # an older set: replaced
    continuation.put(r, k, records(), 2)
    assert r.hlen(k.partials) == n and not r.hexists(k.partials, "999999")
    assert max(behind) <= bound  # never the whole set in memory, nor one transaction of it


def continued(redis_url, run) -> dict:
    return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run).stdout)["continued"]


@pytest.mark.slow  # a Redis loss and recover
@pytest.mark.timeout(300)
def test_recover_rebuilds_the_continued_counters(tmp_path, redis_url, r, run_name, sim_factory):
    sim, n, k = sim_factory(**SIM), 20, RunKeys(run_name)
    first_pass(tmp_path, redis_url, run_name, sim, n)
    genq("requeue", *CONTINUE, redis_url=redis_url, run=run_name)
    run_to_end(redis_url, run_name, sim, tmp_path / "out")
    before = continued(redis_url, run_name)
    assert before["2"]["continued"] > 0
    r.delete(k.meta)  # the run is gone from Redis; its shards and manifest are not
    genq("recover", "--shards", str(tmp_path / "out"), redis_url=redis_url, run=run_name)
    assert continued(redis_url, run_name) == before


@pytest.mark.slow  # a Redis loss and recover
@pytest.mark.timeout(300)
def test_recover_keeps_what_pending_continuations_need(tmp_path, redis_url, r, run_name,
                                                       sim_factory):
    sim, n, k = sim_factory(**SIM), 20, RunKeys(run_name)
    first_pass(tmp_path, redis_url, run_name, sim, n)
    genq("requeue", *CONTINUE, redis_url=redis_url, run=run_name)
    pending = r.hlen(k.partials)
    assert pending > 0
    r.hset(k.partials, "999999", b"not of this run")  # gone with the state recover replaces
    r.delete(k.meta)  # the run is gone from Redis before any continuation ran
    genq("recover", "--shards", str(tmp_path / "out"), redis_url=redis_url, run=run_name)
    assert r.hlen(k.partials) == pending and not r.hexists(k.partials, "999999")
    run_to_end(redis_url, run_name, sim, tmp_path / "out")
    records = export(tmp_path, redis_url, run_name)
    assert sum(bool(rec.get("continued_from")) for rec in records.values()) == pending
    assert continued(redis_url, run_name)["2"]["continued"] == pending


def test_status_does_not_count_a_continued_answer_a_later_redo_set_aside(r, run_name):
    from test_scripts import claim, setup_run

    from genq.common.report.status import read_status

    k, runner = setup_run(r, run_name, 2)
    for jid, idx, ex, att in claim(runner, k, n=2):
        result = scripts.Result(job_id=jid, index=idx, exec_id=ex, completion_tokens=400,
                                prompt_tokens=7, finish_reason="length", version=1,
                                attempt=att, continued=300 if idx == 0 else 0)
        assert runner(scripts.ack_many_call(k, "s", [result])) == [1]
    assert read_status(r, k.run)["continued"] == {
        "1": {"continued": 1, "decode_tokens_saved": 300}}
    assert runner(scripts.redo_call(k, "truncated", 0, 2, 2)) == [2, 2]
    assert read_status(r, k.run)["continued"] == {}
