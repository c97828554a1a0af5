"""`genq recover` of a `--turns all` run: Redis lost, every conversation is rebuilt from the
manifest and the shards turn by turn, so export and status say what they said before, a
truncated conversation's redo goes on from its truncated turn, and a conversation a killed
consumer left midway goes on at its next turn: no earlier turn is asked again."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import genq
from faultkit import private_redis
from pipeline import ConsumerProcess, consume_to_the_end, read_jsonl, wait_for
from test_conversations import by_conversation, conversation, requests_served, write_rows

from genq.common.queue.keys import RunKeys

N = 30
SIM = dict(time_scale=60, tool_call_rate=0.6, length_dist="lognormal:40:0.5",
           max_running_requests=4)


def exported(tmp_path: Path, url: str, run: str, name: str) -> dict[int, list[dict]]:
    """Task -> its accepted generations, turn 1 first, as `genq export` writes them."""
    out = tmp_path / name
    genq("export", "--out", str(out), redis_url=url, run=run)
    return by_conversation(read_jsonl(out))


def keys_of(chains: dict[int, list[dict]]) -> set[tuple[int, int, int, int]]:
    return {(rec["index"], rec["turn"], rec["attempt"], rec["params_version"])
            for chain in chains.values() for rec in chain}


def conversations(url: str, run: str) -> dict:
    figures = orjson.loads(genq("status", "--json", redis_url=url, run=run).stdout)[
        "conversations"]
    figures.pop("generations_per_s")  # a live rate: recover rebuilds no rate buckets
    return figures


def going_on(r, k: RunKeys) -> int:
    """Conversations with turns recorded and their last not made yet (one made but not yet
    acknowledged says how it ended already)."""
    return sum(1 for raw in r.hvals(k.conv) if (got := orjson.loads(raw))["made"]
               and "end" not in got)


def consume(url: str, run: str, server: str, out: Path) -> None:
    consume_to_the_end(url, run, server, out, "--visibility-timeout", "3", timeout=180)


@pytest.mark.slow  # a kill, a loss and recover
@pytest.mark.timeout(300)
def test_recover_rebuilds_conversations_done_and_midway_and_they_go_on(
        tmp_path, run_name, sim_factory):
    data = write_rows(tmp_path / "conversations.jsonl", [conversation(i) for i in range(N)])
    # The doomed consumer's server is slower, so conversations stay midway a while.
    sim, slow, fresh = sim_factory(**SIM), sim_factory(**{**SIM, "time_scale": 10}), \
        sim_factory(**SIM)
    ended, half = run_name + "e", run_name + "m"
    produce = ("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60")
    with private_redis() as redis_srv:  # FLUSHALL there loses every run, as a lost Redis
        url, r = redis_srv.url, redis_srv.client()
        # One run consumed to the end; another whose only consumer is killed mid-run.
        genq(*produce, redis_url=url, run=ended)
        consume(url, ended, sim.url, tmp_path / "e")
        genq(*produce, redis_url=url, run=half)
        doomed = ConsumerProcess(url, half, slow.url, tmp_path / "m", "--visibility-timeout", "3")
        try:
            # Killed with some conversations done and some midway. Decoding stands still
            # first, so every turn written is recorded before the kill: the shards then hold
            # exactly what Redis accepted (a line written and never recorded would be adopted
            # by the recover, as any written result is). A midway conversation may still end
            # in the moment before the stall: then decoding goes on and the test waits again.
            k = RunKeys(half)
            for _ in range(20):
                wait_for(lambda: going_on(r, k) >= 1 and r.bitcount(k.done) >= 1,
                         interval=0.01, timeout=120, what="conversations done and midway")
                httpx.post(slow.url + "/_sim/faults", json={"stall": True}, timeout=5)
                time.sleep(1.5)  # what was written is recorded meanwhile
                if going_on(r, k) >= 1:
                    break
                httpx.post(slow.url + "/_sim/faults", json={"stall": False}, timeout=5)
            doomed.kill()
        finally:
            doomed.cleanup()
        dirs = {ended: tmp_path / "e", half: tmp_path / "m"}
        before = {run: (exported(tmp_path, url, run, f"{run}-before.jsonl"),
                        conversations(url, run)) for run in dirs}
        assert before[ended][1]["done"] == N
        assert 0 < before[half][1]["done"] < N
        left = {task for task, chain in before[half][0].items() if "ended" not in chain[-1]}
        assert left, "no conversation was midway at the kill"

        r.flushall()
        for run, directory in dirs.items():
            out = genq("recover", "--shards", str(directory), redis_url=url, run=run)
            assert "recovered run" in out.stdout, out.stdout
        for run in dirs:
            chains = exported(tmp_path, url, run, f"{run}-after.jsonl")
            assert keys_of(chains) == keys_of(before[run][0]), run
            assert chains == before[run][0], run  # the very lines
            assert conversations(url, run) == before[run][1], run

        # The midway conversations go on at their next turn; earlier turns stay as they were.
        served = requests_served(fresh)
        genq(*produce, redis_url=url, run=half)
        consume(url, half, fresh.url, tmp_path / "m")
        chains = exported(tmp_path, url, half, "half-done.jsonl")
        assert conversations(url, half)["done"] == N
        asked = 0
        for task, chain in chains.items():
            old = before[half][0].get(task, [])
            if task in left or not old:
                assert chain[:len(old)] == old, task
                asked += len(chain) - len(old)
            else:
                assert chain == old, task
        assert asked and requests_served(fresh) - served == asked

        # A truncated conversation's redo goes on from its truncated turn: the turns before it
        # were rebuilt with their messages.
        old = before[ended][0]
        truncated = {task: chain[-1]["turn"] for task, chain in old.items()
                     if chain[-1]["ended"] == "truncated"}
        assert truncated, "no conversation was cut at max_tokens: the lengths need a look"
        served = requests_served(fresh)
        genq("requeue", "--set", "max_tokens=2000", "--redo", "truncated",
             redis_url=url, run=ended)
        consume(url, ended, fresh.url, tmp_path / "e")
        chains = exported(tmp_path, url, ended, "ended-redone.jsonl")
        asked = 0
        for task, chain in chains.items():
            if task not in truncated:
                assert chain == old[task], task
                continue
            t = truncated[task]
            assert chain[:t - 1] == old[task][:t - 1], task  # kept, not made again
            assert chain[t - 1]["params_version"] == 2, task
            asked += len(chain) - (t - 1)
        assert requests_served(fresh) - served == asked
        r.close()


def _gen(index: int, turn: int, version: int, attempt: int, *, finish: str = "stop",
         ended: str = "", at: float = 10.0) -> bytes:
    rec = {"index": index, "turn": turn, "params_version": version, "attempt": attempt,
           "finish_reason": finish, "completion_tokens": 7, "prompt_tokens": 3,
           "created_at": at, "content": f"{index}.{turn} v{version} a{attempt}"}
    return orjson.dumps({**rec, **({"ended": ended} if ended else {})}) + b"\n"


def test_each_turn_takes_the_newest_line_not_older_than_the_turn_before():
    from genq.common.data.recovery_turns import rebuild
    from genq.common.turns import state
    history = [{"version": 1, "redo": "none", "inflight": "finish", "at": 0},
               {"version": 2, "redo": "truncated", "inflight": "finish", "at": 50.0}]
    manifest = {"run": "x", "total": 5, "turns": "all", "params_version": 2,
                "history": history}
    lines = [
        # 0: claim 1 lost its lease after turn 2; claim 2 went on from turn 3 while claim 1
        # still wrote its turns 3 and 4 (never recorded).
        _gen(0, 1, 1, 1), _gen(0, 2, 1, 1), _gen(0, 3, 1, 1), _gen(0, 3, 1, 2),
        _gen(0, 4, 1, 2, ended="complete"), _gen(0, 4, 1, 1, ended="complete"),
        # 1: cut at turn 2, redone under v2 from turn 2.
        _gen(1, 1, 1, 1), _gen(1, 2, 1, 1, finish="length", ended="truncated"),
        _gen(1, 2, 2, 2, at=60), _gen(1, 3, 2, 2, ended="complete", at=61),
        # 2: cut at turn 2, its redo not made yet: kept aside, its turn 1 kept to go on from.
        _gen(2, 1, 1, 1), _gen(2, 2, 1, 1, finish="length", ended="truncated"),
        # 3: midway: turn 3 of an older claim is no part of it.
        _gen(3, 3, 1, 1), _gen(3, 1, 1, 2), _gen(3, 2, 1, 2),
        # 4: its turn 1 never written whole.
        _gen(4, 1, 1, 1)[:-5],
    ]
    out = rebuild(manifest, lambda: [iter(lines)])
    rec = out.rec
    assert set(rec.standing) == {0, 1} and set(rec.kept) == {2}
    assert rec.standing[0][:2] == (1, 2) and rec.standing[1][:2] == (2, 2)
    assert rec.claims == {0: 2, 1: 2, 2: 1, 3: 2} and rec.skipped == 1
    conv = {task: state.Standing.decode(raw) for task, raw in out.conv.items()}
    assert [e[:2] for e in conv[0].made] == [[1, 1], [1, 1], [1, 2]]
    assert (conv[0].end, conv[0].last) == ("complete", 4)
    assert [e[:2] for e in conv[1].made] == [[1, 1], [2, 2]]
    assert (conv[2].end, conv[2].last, len(conv[2].made)) == ("truncated", 2, 1)
    assert [e[:2] for e in conv[3].made] == [[1, 2], [1, 2]] and not conv[3].end
    # Messages for what goes on: the midway one and the one cut (ack.lua drops the others').
    assert sorted(out.msgs) == [2, 3]
    assert [m["content"] for m in state.unpack(out.msgs[3])] == ["3.1 v1 a2", "3.2 v1 a2"]
    assert [m["content"] for m in state.unpack(out.msgs[2])] == ["2.1 v1 a1"]
