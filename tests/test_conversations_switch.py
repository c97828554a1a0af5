"""What a parameter switch refuses in a `--turns all` run is one rule (common/queue/lua/
prelude.lua's `superseded`, common/data/recovery.py's `Rules.refused`): a generation of an older
version written at or after a switch with `--inflight abort` never stands, whether it is a turn
before the last (turn.lua), the last (ack.lua) or a line `genq recover` reads. So after any fault
sequence, recover rebuilds the run that was live: the same status, the same export."""

from __future__ import annotations

import functools
import signal

import orjson
import pytest
from conftest import genq
from faultkit import Consumer, private_redis
from pipeline import consume_to_the_end, read_jsonl, wait_for
from test_conversations import conversation, write_rows
from test_conversations_recover import exported, going_on

from genq.common.data import recovery
from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys
from genq.common.turns.state import Standing


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
    # ack.lua gave its task back; turn.lua's consumer gives its own back (consumer/turns.py).
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


def recorded(r, k: RunKeys) -> int:
    """Turns recorded before conversations' last ones."""
    return sum(len(orjson.loads(raw)["made"]) for raw in r.hvals(k.conv))


def going_on_past(r, k: RunKeys, made: int) -> bool:
    return going_on(r, k) >= 1 and recorded(r, k) >= made


def chat(i: int, turns: int = 5) -> list[dict]:
    """A conversation of `turns` requests and answers, no tool in it: none diverges, so most
    turns are turns before a last."""
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"Step {t} of task {i}."},
                     {"role": "assistant", "content": f"Done with step {t}."}]
    return messages


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_frozen_consumer_across_an_aborting_requeue_then_redis_lost_recovers_the_live_run(
        tmp_path, run_name, sim_factory):
    """Turns finish under old parameters in the moment after each switch, before a running
    consumer polls it (every 0.5 s); a frozen one meets the switch only when it thaws."""
    n = 40
    data = write_rows(tmp_path / "rows.jsonl", [chat(i) for i in range(n)])
    sim = sim_factory(time_scale=10, tool_call_rate=0, length_dist="lognormal:30:0.4",
                      max_running_requests=16)
    out = tmp_path / "out"
    with private_redis() as redis_srv:
        url, r = redis_srv.url, redis_srv.client()
        k = RunKeys(run_name)
        genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60",
             redis_url=url, run=run_name)
        frozen = Consumer(url, run_name, sim.url, out / "a", vt=20, concurrency=4)
        running = Consumer(url, run_name, sim.url, out / "b", vt=20, concurrency=8)
        try:
            for version in (2, 3, 4):  # each once a few more turns are made, while some go on
                wait_for(functools.partial(going_on_past, r, k, recorded(r, k) + 8),
                         timeout=60, what="more turns made, conversations midway")
                frozen.signal(signal.SIGSTOP)
                genq("requeue", "--set", f"temperature=0.{version}", "--inflight", "abort",
                     redis_url=url, run=run_name)
                frozen.signal(signal.SIGCONT)
            assert running.wait(120) == 0 and frozen.wait(60) == 0
        finally:
            for c in (frozen, running):
                c.signal(signal.SIGCONT)
                c.cleanup()
        consume_to_the_end(url, run_name, sim.url, out / "a", "--visibility-timeout", "3")
        # The window was met: some line of an older version was written after its switch.
        switches = [orjson.loads(h) for h in r.lrange(k.params_history, 0, -1)]
        assert any(h["inflight"] == "abort" and h["version"] > rec["params_version"]
                   and rec["created_at"] >= h["at"] for h in switches
                   for shard in out.glob("*/*.jsonl") for rec in read_jsonl(shard))
        live, lines = status(url, run_name), exported(tmp_path, url, run_name, "live.jsonl")
        assert live["done"] == n
        r.flushall()
        genq("recover", "--shards", str(out / "a"), "--shards", str(out / "b"),
             redis_url=url, run=run_name)
        assert status(url, run_name) == live
        assert exported(tmp_path, url, run_name, "recovered.jsonl") == lines
        r.close()


@pytest.mark.slow  # a Redis loss and recover
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
