"""The Redis copy of a prompt's last answer failed on its `--schema` (RunKeys.invalid, for
`export --include-failed`): dropped when the prompt ends after all, and bounded in total, so a
schema wrong for every prompt does not fill Redis. Past the bound the shards' failed lines
still hold every answer; status and export say how many copies Redis did not keep."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, write_dataset
from test_scripts import ack, claim, setup_run

from genq.common.queue import feed, scripts
from genq.common.queue.keys import RunKeys

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def produce_failing(tmp_path, redis_url, run, sim_factory, n: int):
    """n prompts whose only answer (no retry) the simulator breaks: every one fails."""
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    sim = sim_factory(time_scale=1000, invalid_json_rate=1.0, seed=5,
                      length_dist="fixed:60")
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", n)), "--once", "--schema",
         str(tmp_path / "s.json"), "--max-tokens", "200", "--set", "schema_retries=0",
         redis_url=redis_url, run=run)
    return sim


def consume(redis_url, run, sim, out) -> None:
    c = ConsumerProcess(redis_url, run, sim.url, out, "--burst")
    try:
        assert c.wait(180) == 0, c.log()[-3000:]
    finally:
        c.cleanup()


def status_of(redis_url, run) -> dict:
    return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run).stdout)


@pytest.mark.timeout(300)
def test_a_prompt_that_succeeds_after_a_redo_drops_its_copy(tmp_path, redis_url, r, run_name,
                                                            sim_factory):
    """Failed on the schema, then answered after `requeue --redo failed`: the prompt ended, so
    Redis keeps no copy of an answer that export will never show."""
    n, k = 4, RunKeys(run_name)
    sim = produce_failing(tmp_path, redis_url, run_name, sim_factory, n)
    consume(redis_url, run_name, sim, tmp_path / "out")
    assert status_of(redis_url, run_name)["failed"] == n
    assert r.hlen(k.invalid) == n

    httpx.post(sim.url + "/_sim/faults", json={"invalid_json_rate": 0.0}, timeout=5)
    genq("requeue", "--redo", "failed", redis_url=redis_url, run=run_name)
    consume(redis_url, run_name, sim, tmp_path / "out")
    status = status_of(redis_url, run_name)
    assert status["done"] == n and status["failed"] == 0
    assert r.hlen(k.invalid) == 0, r.hkeys(k.invalid)


@pytest.mark.timeout(300)
def test_the_copies_are_bounded_and_the_shards_keep_every_answer(tmp_path, redis_url, r,
                                                                 run_name, sim_factory,
                                                                 monkeypatch):
    """GENQ_INVALID_KEEP=3 and 10 prompts failed on the schema: Redis keeps 3 copies, status
    says 7 were not kept; export still writes every answer from the shards' failed lines, and
    from Redis alone (no shards given) the 3 it kept, saying 7 are not there."""
    n, keep, k = 10, 3, RunKeys(run_name)
    monkeypatch.setenv("GENQ_INVALID_KEEP", str(keep))
    sim = produce_failing(tmp_path, redis_url, run_name, sim_factory, n)
    consume(redis_url, run_name, sim, tmp_path / "out")
    status = status_of(redis_url, run_name)
    assert status["failed"] == n and r.hlen(k.invalid) == keep
    assert status["schema"]["1"]["failed"] == n
    assert status["schema"]["1"]["unkept"] == n - keep
    table = " ".join(genq("status", redis_url=redis_url, run=run_name).stdout.split())
    assert f"{n - keep} answers not kept in Redis" in table, table

    out = tmp_path / "all.jsonl"
    genq("export", "--out", str(out), "--include-failed", redis_url=redis_url, run=run_name)
    records = read_jsonl(out)
    assert len(records) == n and all(rec["answer"]["content"] is not None for rec in records)

    empty = tmp_path / "no-shards"
    empty.mkdir()
    out = tmp_path / "redis.jsonl"
    proc = genq("export", "--out", str(out), "--include-failed", "--shards", str(empty),
                redis_url=redis_url, run=run_name, check=False)
    records = read_jsonl(out)
    assert len(records) == n and sum("answer" in rec for rec in records) == keep
    assert f"{n - keep} prompts failed on the schema have no answer in Redis" in proc.stderr, \
        proc.stderr


def test_a_copy_lives_while_its_failure_stands_and_the_bound_counts_the_rest(r, run_name):
    """invalid.lua on its own: no copy for a prompt a redo revived before it ran; past the
    bound no new copy (counted), a kept one may be replaced; the prompt's next failure, for any
    reason, drops its copy (fail.lua), and so does its accepted ack (ack.lua)."""
    k, runner = setup_run(r, run_name, 4)
    fail = "answer is not JSON: unexpected character"

    def fails(lease, reason=fail) -> None:
        jid, idx, ex, _ = lease
        assert runner(scripts.fail_call(k, jid, idx, ex, reason=reason, worker="w1")) == 1

    def keep(index, keep_at_most=2) -> int:
        return runner(scripts.invalid_call(k, index, b'{"content": "x"}', 1, keep_at_most))

    assert keep(0) == 0 and r.hlen(k.invalid) == 0  # not failed (revived meanwhile)
    leases = claim(runner, k, n=4)
    for lease in leases[:3]:
        fails(lease)
    assert [keep(0), keep(1), keep(2), keep(0)] == [1, 1, 2, 1]
    assert r.hlen(k.invalid) == 2
    counts = r.hgetall(k.counters)
    assert counts[b"schema_failed|1"] == b"5" and counts[b"schema_unkept|1"] == b"1"

    runner(scripts.redo_call(k, "failed", 0, 4, 1))  # all three run again
    feed.enqueue(r, k, [0, 1, 2], runner)  # as requeue does after the redo
    again = {lease[1]: lease for lease in claim(runner, k, n=4)}
    fails(again[0], "gave up after 3 tries; last error: HTTP 500")
    assert r.hkeys(k.invalid) == [b"1"]  # 0 failed for another reason: not its answer now
    assert ack(runner, k, again[1]) == 1
    assert r.hlen(k.invalid) == 0
