"""A lost node in a `--turns all` run, repaired by the one command docs/SLURM.md gives:
`genq requeue --redo missing --from-s3 URI` makes each conversation again from its earliest
turn whose accepted line is in no shipped shard, with the turns after it; the turns before it
are kept and never asked again. Until then, no export holds a turn without the turns before it."""

from __future__ import annotations

import shutil
from collections import Counter

import orjson
import pytest
from conftest import genq
from faultkit import private_redis
from pipeline import ConsumerProcess, consume_to_the_end, read_jsonl, wait_for
from test_conversations import (
    PROBE,
    by_conversation,
    check_chains,
    conversation,
    midway,
    requests_served,
    write_rows,
)
from test_conversations_switch import status
from test_s3 import URI, bucket_records, s3  # noqa: F401  (s3: the moto fixture)

from genq.common.queue.keys import RunKeys


def export(tmp_path, redis_url: str, run: str, name: str, *where: str
           ) -> tuple[int, list[dict]]:
    out = tmp_path / name
    done = genq("export", *where, "--out", str(out), redis_url=redis_url, run=run, check=False)
    return done.returncode, read_jsonl(out) if out.exists() else []


def no_gaps(records: list[dict]) -> None:
    for index, chain in by_conversation(records).items():
        assert [rec["turn"] for rec in chain] == list(range(1, len(chain) + 1)), index


@pytest.mark.slow  # a lost node, as tests/test_lost_node.py
@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["s3", "shards"])
def test_a_lost_node_is_repaired_by_redo_missing_and_the_export_is_whole(
        tmp_path, run_name, sim_factory, s3, where):  # noqa: F811
    """--from-s3 URI: what the nodes shipped; --shards DIR: the surviving node's output (the
    export then reads the consumers' directories). Redis lost after it, `genq recover` from
    the same outputs rebuilds the run as it was."""
    output = ("--from-s3", URI) if where == "s3" else ("--shards", str(tmp_path / "b"))
    read = ("--from-s3", URI) if where == "s3" else ()
    with private_redis() as redis_srv:
        redis_url, r = redis_srv.url, redis_srv.client()
        _lose_and_repair(tmp_path, redis_url, r, run_name, sim_factory, s3, output, read)


def _lose_and_repair(tmp_path, redis_url: str, r, run_name: str, sim_factory, s3,  # noqa: F811
                     output: tuple[str, ...], read: tuple[str, ...]) -> None:
    n = 24
    rows = [conversation(i) for i in range(n)]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    kwargs = dict(time_scale=40, tool_call_rate=0.6, length_dist="lognormal:30:0.4",
                  max_running_requests=4)
    lost_sim, kept_sim, new_sim = (sim_factory(**kwargs) for _ in range(3))
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "300",
         "--token-ids", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    # The lost node ships nothing before it dies (its shard never fills): all it made is lost,
    # and the conversations it had midway go on elsewhere from the turns Redis recorded.
    lost = ConsumerProcess(redis_url, run_name, lost_sim.url, tmp_path / "a", "--s3-uri", URI,
                           "--visibility-timeout", "3", "--shard-records", "1000",
                           "--name", "node-a")
    try:
        wait_for(lambda: r.bitcount(k.done) >= 3 and len(midway(r, k, lost_sim.url)) >= 2,
                 timeout=60, interval=0.01, what="conversations done and midway on node-a")
        lost.kill()
    finally:
        lost.cleanup()
    shutil.rmtree(tmp_path / "a")
    consume_to_the_end(redis_url, run_name, kept_sim.url, tmp_path / "b", "--s3-uri", URI,
                       "--visibility-timeout", "3", "--shard-records", "5", "--name", "node-b")
    assert r.bitcount(k.done) == n
    code, records = export(tmp_path, redis_url, run_name, "before.jsonl", *read)
    assert code == 1  # it says what it lacks, and holds no turn without the turns before it
    no_gaps(records)
    shipped = {(rec["index"], rec["turn"], rec["params_version"], rec["attempt"])
               for rec in bucket_records(s3[0], run_name)}

    put_back = genq("requeue", "--redo", "missing", *output, redis_url=redis_url,
                    run=run_name)
    assert "conversations made again from their earliest missing turn" in put_back.stdout, \
        put_back.stdout
    served = requests_served(new_sim)
    consume_to_the_end(redis_url, run_name, new_sim.url, tmp_path / "c", "--s3-uri", URI,
                       "--name", "node-c")
    code, records = export(tmp_path, redis_url, run_name, "after.jsonl", *read)
    assert code == 0
    chains = check_chains(rows, records)  # every conversation's turns 1..m once, in order
    assert Counter((rec["index"], rec["turn"]) for rec in records).most_common(1)[0][1] == 1
    again = [rec for rec in records if rec["params_version"] == 2]
    assert again, "nothing was made again"
    # Turns before a conversation's earliest missing one are the shipped lines, not made again.
    for chain in chains.values():
        versions = [rec["params_version"] for rec in chain]
        assert versions == sorted(versions), chain
        for rec in chain:
            if rec["params_version"] == 1:
                assert (rec["index"], rec["turn"], 1, rec["attempt"]) in shipped
    assert requests_served(new_sim) - served == PROBE + len(again)
    st = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert st["done"] == n and st["conversations"]["generations"] == len(records)
    live = status(redis_url, run_name)
    r.flushall()
    again_from = ("--from-s3", URI) if read else (
        "--shards", str(tmp_path / "b"), "--shards", str(tmp_path / "c"), "--partial")
    genq("recover", *again_from, redis_url=redis_url, run=run_name)
    assert status(redis_url, run_name) == live
    assert export(tmp_path, redis_url, run_name, "recovered.jsonl", *read) == (0, records)


def test_a_conversation_on_a_consumer_goes_back_and_its_consumer_is_refused(
        tmp_path, redis_url, r, run_name):
    """rewind.lua on the real scripts: a conversation leased when the repair runs loses its
    lease (queued again, its consumer's next turn refused); one whose kept turns changed since
    they were read is left as it is."""
    from genq.common.queue import scripts
    from genq.common.turns import state

    data = write_rows(tmp_path / "rows.jsonl", [conversation(i) for i in range(2)])
    genq("produce", str(data), "--once", "--turns", "all", redis_url=redis_url, run=run_name)
    k, runner = RunKeys(run_name), scripts.ScriptRunner(r)
    _, *rows = runner(scripts.claim_call(k, 2, 60.0, "http://s", "w", "held"))
    claims = {int(row[1]): (row[0].decode(), row[2].decode()) for row in rows}
    # Task 0's turn 2 was continued from a 7-token partial; task 1's was not.
    made = {0: [[1, 1], [1, 1, 7]], 1: [[1, 1], [1, 1]]}
    for task, (job, exe) in claims.items():
        assert runner(scripts.turn_call(k, job, task, exe, state.Standing(made[task]).encode(),
                                        state.pack([{"role": "assistant", "content": "a"}] * 2),
                                        2, 0, continued=7 if task == 0 else 0, version=1)) == 1
    assert r.hget(k.counters, "continued|1") == b"1"
    kept = state.Standing([[1, 1]]).encode(), state.Standing([[1, 2]]).encode()
    one = state.pack([{"role": "assistant", "content": "a"}])
    assert runner(scripts.rewind_call(k, [(0, kept[0], one), (1, kept[1], one)])) == 1
    job, exe = claims[0]
    assert state.Standing.decode(r.hget(k.conv, "0")).made == [[1, 1]]
    assert r.execute_command("BITFIELD", k.conv_made, "GET", "u16", "#0") == [1]
    assert r.hget(k.lease_owner, job) is None and r.lrange(k.rq_queue, 0, -1) == [job.encode()]
    assert runner(scripts.turn_call(k, job, 0, exe, state.Standing(made[0]).encode(), b"", 2,
                                    0, version=1)) == 0  # its consumer's next turn: refused
    assert state.Standing.decode(r.hget(k.conv, "1")).made == made[1]  # read as [1, 2]: left
    assert r.hget(k.lease_owner, claims[1][0]) is not None
    # Task 0's continued turn 2, set aside, no longer counts as continued.
    assert (r.hget(k.counters, "continued|1"), r.hget(k.counters, "saved|1")) == (b"0", b"0")
