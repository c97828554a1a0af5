"""What a parameter switch refuses in a `--turns all` run is one rule (common/queue/lua/
prelude.lua's `superseded`, common/data/recovery.py's `Rules.refused`): a generation of an older
version written at or after a switch with `--inflight abort` never stands, whether it is a turn
before the last (turn.lua), the last (ack.lua) or a line `genq recover` reads. So after any fault
sequence, recover rebuilds the run that was live: the same status, the same export."""

from __future__ import annotations

import signal
import time

import httpx
import orjson
import pytest
from conftest import genq
from faultkit import Consumer, private_redis
from pipeline import consume_to_the_end, wait_for
from test_conversations import conversation, write_rows
from test_conversations_recover import exported, going_on

from genq.common.data import recovery
from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys
from genq.turns.state import Standing


def test_turn_lua_ack_lua_and_recover_refuse_the_same_superseded_turn(
        tmp_path, redis_url, r, run_name):
    """The window a frozen consumer opens, step by step on the real scripts: a turn claimed
    under v1 finishes after a switch to v2 that aborts old work, before its consumer saw it."""
    data = write_rows(tmp_path / "rows.jsonl", [conversation(i) for i in range(2)])
    genq("produce", str(data), "--once", "--turns", "all", redis_url=redis_url, run=run_name)
    k, runner = RunKeys(run_name), scripts.ScriptRunner(r)
    _, *rows = runner(scripts.claim_call(k, 2, 60.0, "http://s", "w", "frozen"))
    (job0, task0, exec0, *_), (job1, task1, exec1, *_) = sorted(rows, key=lambda row: row[1])
    genq("requeue", "--set", "temperature=0.3", "--inflight", "abort",
         redis_url=redis_url, run=run_name)
    now, micros = r.time()
    written = now + micros / 1e6  # by Redis's clock, after the switch
    # A turn before the last (turn.lua) and a last turn (ack.lua) of version 1.
    made = Standing([[1, 1]]).encode()
    turn = runner(scripts.turn_call(k, job0.decode(), int(task0), exec0.decode(), made, b"",
                                    1, 0, version=1, created_at=written))
    acked = runner(scripts.ack_many_call(k, "http://s", [scripts.Result(
        job_id=job1.decode(), index=int(task1), exec_id=exec1.decode(), completion_tokens=5,
        prompt_tokens=5, finish_reason="stop", version=1, attempt=1, created_at=written)]))
    history = [orjson.loads(h) for h in r.lrange(k.params_history, 0, -1)]
    assert recovery.Rules({"history": history}).refused(1, written)
    assert (turn, acked) == (2, [2])  # both superseded, as recover finds them
    assert r.hget(k.conv, str(task0)) is None  # the turn is not recorded
    # ack.lua gave its task back; turn.lua's consumer gives its own back (turns/engine.py).
    assert int(r.llen(k.rq_queue)) == 1 and list(r.hkeys(k.lease_owner)) == [job0]
    # Written just before the switch, it stands (and recover keeps its line too).
    assert not recovery.Rules({"history": history}).refused(1, float(history[-1]["at"]) - 1)


STATUS = ("done", "failed", "truncated", "finish_reasons", "continued", "kept")


def status(url: str, run: str) -> dict:
    st = orjson.loads(genq("status", "--json", redis_url=url, run=run).stdout)
    conv = st["conversations"]
    conv.pop("generations_per_s", None)  # a live rate: recover rebuilds no rate buckets
    for key in ("boundary_checked", "boundary_unstable"):  # no line says them (recover.py)
        conv.pop(key, None)
    return {"conversations": conv, **{key: st.get(key) for key in STATUS}}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_frozen_consumer_across_an_aborting_requeue_then_redis_lost_recovers_the_live_run(
        tmp_path, run_name, sim_factory):
    n = 24
    data = write_rows(tmp_path / "rows.jsonl", [conversation(i) for i in range(n)])
    sim = sim_factory(time_scale=30, tool_call_rate=0.6, length_dist="lognormal:30:0.4",
                      max_running_requests=8)
    out = tmp_path / "out"
    with private_redis() as redis_srv:
        url, r = redis_srv.url, redis_srv.client()
        genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60",
             redis_url=url, run=run_name)
        frozen = Consumer(url, run_name, sim.url, out, vt=20, concurrency=8)
        try:
            for round_ in range(3):  # each round: answers finish while it is frozen
                wait_for(lambda: going_on(r, RunKeys(run_name)) >= 2, timeout=60,
                         what="conversations midway")
                frozen.signal(signal.SIGSTOP)
                wait_for(lambda: running(sim) == 0, timeout=30, what="answers made")
                genq("requeue", "--set", f"temperature=0.{round_ + 1}", "--inflight", "abort",
                     redis_url=url, run=run_name)
                time.sleep(0.2)  # Redis's clock past the switch
                frozen.signal(signal.SIGCONT)
        finally:
            frozen.signal(signal.SIGCONT)
            frozen.cleanup()
        consume_to_the_end(url, run_name, sim.url, out, "--visibility-timeout", "3")
        live, lines = status(url, run_name), exported(tmp_path, url, run_name, "live.jsonl")
        assert live["done"] == n
        r.flushall()
        genq("recover", "--shards", str(out), redis_url=url, run=run_name)
        assert status(url, run_name) == live
        assert exported(tmp_path, url, run_name, "recovered.jsonl") == lines
        r.close()


def running(sim) -> int:
    text = httpx.get(sim.url + "/metrics", timeout=5).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("sglang:num_running_reqs"))


@pytest.mark.timeout(240)
def test_recover_rebuilds_the_continued_count(tmp_path, run_name, sim_factory):
    """Turns continued by `requeue --redo truncated --continue`, the last of a conversation or
    not, count as continued after a recover as they did live."""
    n = 24
    data = write_rows(tmp_path / "rows.jsonl", [conversation(i) for i in range(n)])
    sim = sim_factory(time_scale=200, tool_call_rate=0.6, length_dist="lognormal:40:0.5")
    out = tmp_path / "out"
    with private_redis() as redis_srv:
        url, r = redis_srv.url, redis_srv.client()
        genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "50",
             "--token-ids", redis_url=url, run=run_name)
        consume_to_the_end(url, run_name, sim.url, out)
        genq("requeue", "--set", "max_tokens=2000", "--redo", "truncated", "--continue",
             redis_url=url, run=run_name)
        consume_to_the_end(url, run_name, sim.url, out)
        live = status(url, run_name)
        assert live["continued"]["2"]["continued"] >= 3, live
        r.flushall()
        genq("recover", "--shards", str(out), redis_url=url, run=run_name)
        assert status(url, run_name) == live
        r.close()
