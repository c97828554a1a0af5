"""Single state transitions of the queue scripts against a real Redis: claim, renew, ack,
release, fail, reap, and the refusal of stale acks."""

from __future__ import annotations

import re
import time

import orjson
import pytest
import redis
from conftest import ack_call
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

from genq.common.queue import bitmap, feed, scripts
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import failure_reasons


def setup_run(r: redis.Redis, run: str, n: int) -> tuple[RunKeys, scripts.ScriptRunner]:
    k = RunKeys(run)
    r.hset(k.meta, mapping={"total": n, "dataset": "/x", "fingerprint": "f", "epoch": "e"})
    runner = scripts.ScriptRunner(r)
    feed.enqueue(r, k, list(range(n)), runner)
    return k, runner


def claim(runner, k, n=1, vt=30.0, server="http://s:1"):
    version, *rows = runner(scripts.claim_call(k, n, vt, server, "w1", "ex"))
    return [(jid.decode(), int(idx), ex.decode(), int(att)) for jid, idx, ex, att, *_ in rows]


def ack(runner, k, lease, tokens=100, finish="stop"):
    jid, idx, ex, att = lease
    return runner(ack_call(k, jid, idx, ex, completion_tokens=tokens, prompt_tokens=7,
                           finish_reason=finish, version=1, attempt=att, server="s"))[0]


def test_enqueue_is_idempotent(r, run_name):
    k, runner = setup_run(r, run_name, 5)
    assert feed.enqueue(r, k, list(range(5)), runner) == 0
    assert r.llen(k.rq_queue) == 5
    assert list(feed.free_indices(r, k, 8)) == [5, 6, 7]


def test_claim_leases_in_rq_layout(r, run_name):
    k, runner = setup_run(r, run_name, 3)
    [lease] = claim(runner, k)
    jid, idx, ex, attempt = lease
    assert (idx, attempt) == (0, 1)
    q = Queue(k.queue_name, connection=r)
    assert len(q) == 2
    assert StartedJobRegistry(queue=q).get_job_ids(cleanup=False) == [jid]
    assert Job.fetch(jid, connection=r).get_status().value == "started"
    # rq's own sweep (what `rq info` does) must leave a live lease alone.
    StartedJobRegistry(queue=q).cleanup()
    assert r.zscore(k.leases, jid) is not None
    assert Job.fetch(jid, connection=r).get_status().value == "started"


def test_ack_counts_once_and_finishes_in_rq(r, run_name):
    k, runner = setup_run(r, run_name, 2)
    lease = claim(runner, k)[0]
    assert ack(runner, k, lease, tokens=4096, finish="length") == 1
    assert r.getbit(k.done, 0) == 1 and r.getbit(k.truncated, 0) == 1
    assert r.hget(k.counters, "finish:length") == b"1"
    assert r.hget(k.length_hist, "4096") == b"1"
    assert r.zcard(k.leases) == 0
    q = Queue(k.queue_name, connection=r)
    assert FinishedJobRegistry(queue=q).get_job_ids() == [lease[0]]
    # A second ack with the same token is refused: the lease is gone.
    assert ack(runner, k, lease) == 0
    assert r.hget(k.counters, "finish:length") == b"1"


def test_stale_ack_after_reap_is_refused(r, run_name):
    k, runner = setup_run(r, run_name, 1)
    old = claim(runner, k, vt=0.001)[0]
    time.sleep(0.01)  # let the 1 ms lease pass on Redis's clock
    assert runner(scripts.reap_call(k)) == [old[0].encode()]
    assert b"lease expired" in r.hget(k.errors, "0")
    new = claim(runner, k)[0]
    assert new[3] == 2  # the record's attempt rises with each claim
    assert ack(runner, k, old) == 0
    assert runner(scripts.renew_call(k, 30, [(old[0], old[2])])) == [old[0].encode()]
    assert ack(runner, k, new) == 1
    assert r.bitcount(k.done) == 1 and r.hget(k.counters, "finish:stop") == b"1"


def test_renew_extends_deadline(r, run_name):
    k, runner = setup_run(r, run_name, 1)
    jid, _, ex, _ = claim(runner, k, vt=1)[0]
    before = r.zscore(k.leases, jid)
    assert runner(scripts.renew_call(k, 100, [(jid, ex)])) == []
    assert r.zscore(k.leases, jid) > before + 50
    assert runner(scripts.reap_call(k)) == []


def test_release_with_refund_puts_task_first_and_spends_nothing(r, run_name):
    k, runner = setup_run(r, run_name, 3)
    jid, idx, ex, _ = claim(runner, k)[0]
    assert runner(scripts.release_call(k, jid, idx, ex, refund=True, reason="HTTP 503")) == 1
    assert r.lindex(k.rq_queue, 0).decode() == jid
    assert r.bitfield(k.spent).get("u8", f"#{idx}").execute() == [0]
    assert r.zcard(k.leases) == 0 and r.zcard(k.rq_wip) == 0


def test_a_refund_keeps_the_claim_counted_unless_genq_let_go_first(r, run_name):
    # The server's trouble refunds the attempt but not the claim (--max-claims bounds those);
    # a task genq gives back itself (a stop, an abort) costs neither; a redo starts afresh.
    k, runner = setup_run(r, run_name, 1)
    tries = r.bitfield(k.tries)
    for unclaim in (False, False, True, True):
        jid, idx, ex, _ = claim(runner, k)[0]
        runner(scripts.release_call(k, jid, idx, ex, refund=True, unclaim=unclaim))
    assert tries.get("u8", "#0").execute() == [2]
    jid, idx, ex, _ = claim(runner, k)[0]
    assert tries.get("u8", "#0").execute() == [3]
    runner(scripts.fail_call(k, jid, idx, ex, reason="gave up", worker="w1"))
    runner(scripts.redo_call(k, "failed", 0, 1, 1))
    assert tries.get("u8", "#0").execute() == [0]


def test_fail_lands_in_rq_failed_registry_with_reason(r, run_name):
    k, runner = setup_run(r, run_name, 2)
    jid, idx, ex, _ = claim(runner, k)[0]
    call = scripts.fail_call(k, jid, idx, ex, reason="row 0: not valid JSON",
                             worker="w1")
    assert runner(call) == 1
    assert r.getbit(k.failed, 0) == 1 and r.getbit(k.pending, 0) == 0
    q = Queue(k.queue_name, connection=r)
    assert FailedJobRegistry(queue=q).get_job_ids() == [jid]
    job = Job.fetch(jid, connection=r)
    assert job.get_status().value == "failed"
    assert job.latest_result().exc_string == "row 0: not valid JSON"  # rq-dashboard shows it
    assert feed.enqueue(r, k, [0], runner) == 0  # a failed index is not enqueued again


def test_a_failed_prompt_keeps_a_byte_of_reason_and_rq_keeps_its_job_for_the_failure_ttl(
        r, run_name):
    n = 300
    k, runner = setup_run(r, run_name, n)
    for jid, idx, ex, _ in claim(runner, k, n):
        long = f"row {idx}: not valid JSON (unexpected character: line 1 column {idx} " \
               f"(char {idx}))" + " context" * 100  # ~800 bytes, different for every row
        assert runner(scripts.fail_call(k, jid, idx, ex, reason=long, worker="w1")) == 1
    assert r.bitcount(k.failed) == n and r.hlen(k.errors) == 0
    assert r.hlen(k.fail_kinds) == 1 and r.strlen(k.fail_kind) == n  # one byte per index
    assert set(failure_reasons(r, k, range(n))) == {
        ("row N: not valid JSON (unexpected character: …)" + " context" * 100)[:300]}
    for jid in (k.job_id(0), k.job_id(n - 1)):  # RQ's own copy expires as RQ's would
        assert 0 < r.ttl(k.rq_job_prefix + jid) <= scripts.FAILURE_TTL_S
        assert 0 < r.ttl(k.rq_results_prefix + jid) <= scripts.FAILURE_TTL_S
    assert Job.fetch(k.job_id(0), connection=r).latest_result().exc_string.startswith("row 0:")


def test_claim_drops_job_of_settled_index(r, run_name):
    k, runner = setup_run(r, run_name, 1)
    lease = claim(runner, k)[0]
    ack(runner, k, lease)
    r.rpush(k.rq_queue, lease[0])  # a stray duplicate push
    assert claim(runner, k) == []
    assert r.bitcount(k.done) == 1


def test_redo_undoes_zero_token_results(r, run_name):
    """A result with 0 prompt or completion tokens must not break the redo script midway."""
    k, runner = setup_run(r, run_name, 2)
    for lease in claim(runner, k, n=2):
        jid, idx, ex, att = lease
        runner(ack_call(k, jid, idx, ex, completion_tokens=0, prompt_tokens=0,
                        finish_reason="length", version=1, attempt=att, server="s"))
    assert runner(scripts.redo_call(k, "truncated", 0, 2, 2)) == [2, 2]
    assert r.bitcount(k.done) == 0 and r.hget(k.counters, "finish:length") == b"0"
    assert r.hgetall(k.length_hist) == {}


def test_redo_stops_at_its_limit_and_resumes(r, run_name):
    k, runner = setup_run(r, run_name, 5)
    for lease in claim(runner, k, n=5):
        ack(runner, k, lease, finish="length")
    count, pos = runner(scripts.redo_call(k, "truncated", 0, 5, 2, limit=2))
    assert (count, pos) == (2, 2) and r.bitcount(k.done) == 3
    assert runner(scripts.redo_call(k, "truncated", pos, 5, 2, limit=2)) == [2, 4]
    assert runner(scripts.redo_call(k, "truncated", 4, 5, 2, limit=2)) == [1, 5]
    assert r.bitcount(k.done) == 0 and r.hget(k.counters, "finish:length") == b"0"


def test_leases_keep_working_while_redis_is_full(r, run_name):
    """At maxmemory (noeviction) new jobs are refused, but renewals, acks and releases of work
    already leased go through, so a full Redis costs no finished generation."""
    k, runner = setup_run(r, run_name, 3)
    first, second = claim(runner, k, n=2)
    r.config_set("maxmemory", max(1, r.info("memory")["used_memory"] - (256 << 10)))
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            feed.enqueue(r, k, [7], runner)
        assert runner(scripts.renew_call(k, 30, [(first[0], first[2])])) == []
        assert ack(runner, k, first) == 1
        assert runner(scripts.release_call(k, second[0], second[1], second[2], refund=True)) == 1
    finally:
        r.config_set("maxmemory", 0)
    assert r.bitcount(k.done) == 1 and r.llen(k.rq_queue) == 2


def test_finished_jobs_are_kept_by_number_and_errors_cleared_on_ack(r, run_name):
    """Redis must not grow with the run: the finished registry and its job hashes stop at
    FINISHED_KEEP, and an acked index leaves no errors entry."""
    n = scripts.FINISHED_KEEP + 5
    k, runner = setup_run(r, run_name, n)
    for lease in claim(runner, k, n=n):
        r.hset(k.errors, str(lease[1]), "HTTP 503 on an earlier attempt")
        assert ack(runner, k, lease) == 1
    registry = FinishedJobRegistry(k.queue_name, connection=r)
    kept = registry.get_job_ids()
    assert len(kept) == scripts.FINISHED_KEEP
    assert kept == [k.job_id(i) for i in range(5, n)]  # the newest stay
    assert [r.exists(k.rq_job(i)) for i in range(6)] == [0] * 5 + [1]
    assert r.hlen(k.errors) == 0 and r.bitcount(k.done) == n


def test_rq_requeue_of_a_failed_job_is_claimed_as_a_new_try(r, run_name):
    k, runner = setup_run(r, run_name, 2)
    jid, idx, ex, _ = claim(runner, k)[0]
    assert runner(scripts.fail_call(k, jid, idx, ex, reason="HTTP 400", worker="w")) == 1
    FailedJobRegistry(k.queue_name, connection=r).requeue(jid)
    leases = claim(runner, k, n=2)
    assert [lease[1] for lease in leases] == [1, 0]  # rq put it at the back
    assert r.getbit(k.failed, 0) == 0 and r.getbit(k.pending, 0) == 1
    assert r.hget(k.errors, "0") is None and leases[1][3] == 2
    assert r.bitfield(k.spent).get("u8", "#0").execute() == [1]  # fresh attempts
    assert ack(runner, k, leases[1]) == 1 and r.bitcount(k.done) == 1


def test_presence_prunes_dead_consumers_and_idle_has_no_current_job(r, run_name):
    import asyncio

    import redis.asyncio as aioredis

    from genq.consumer import presence

    k = RunKeys(run_name)
    now = int(r.time()[0])
    r.zadd(k.consumers, {"dead": now - presence.PRUNE_AFTER_S - 1, "recent": now - 5})
    r.sadd(k.rq_workers, k.rq_worker("dead"), k.rq_worker("recent"))

    async def beat(held: list[str]) -> None:
        port = r.connection_pool.connection_kwargs["port"]
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        try:
            await presence.announce(client, k, "alive", now, {"server": "s"},
                                    birth=scripts.iso_now(),  # rq-dashboard parses it
                                    held=held)
        finally:
            await client.aclose()

    asyncio.run(beat([f"{run_name}-0"]))
    assert r.hget(k.rq_worker("alive"), "current_job") == f"{run_name}-0".encode()
    asyncio.run(beat([]))
    assert r.hget(k.rq_worker("alive"), "current_job") is None  # "" made rq-dashboard 500
    assert {m.decode() for m in r.zrange(k.consumers, 0, -1)} == {"recent", "alive"}
    assert not r.sismember(k.rq_workers, k.rq_worker("dead"))
    assert r.sismember(k.rq_workers, k.rq_worker("recent"))


def ack_state(r: redis.Redis, k: RunKeys, n: int) -> dict:
    """Everything an ack changes, less timestamps (rate bucket times, rq's ended_at)."""
    state = {name: r.get(getattr(k, name)) for name in
             ("done", "pending", "truncated", "kept", "spent", "acc_tokens", "acc_ptoks",
              "acc_finish", "acc_version", "acc_attempt")}
    state.update(counters=sorted(r.hgetall(k.counters).items()),
                 hist=sorted(r.hgetall(k.length_hist).items()),
                 errors=sorted(r.hgetall(k.errors).items()),
                 owners=sorted(r.hgetall(k.lease_owner).items()),
                 leases=r.zrange(k.leases, 0, -1), wip=r.zcard(k.rq_wip),
                 queue=sorted(r.lrange(k.rq_queue, 0, -1)),
                 finished=sorted(r.zrange(k.rq_finished, 0, -1)),
                 status=[r.hget(k.rq_job(i), "status") for i in range(n)])
    buckets = [r.hgetall(key) for key in r.scan_iter(k.rate_prefix + "*")]
    state["rate"] = dict(sorted({f: sum(int(b.get(f, 0)) for b in buckets)
                                 for b in buckets for f in b}.items()))
    return state


def test_one_ack_of_many_results_equals_acking_them_one_by_one(r):
    # The same story on two runs: 9 results, of which one is stale (its lease was taken
    # over), one carries superseded parameters, two are truncated results a redo issued after
    # them covers, and the rest are new (one of them truncated too late for the redo). Run A
    # acks them one by one, run B in one call: every code, bit, counter and registry must end
    # the same.
    states, codes = [], []
    for batched in (False, True):
        run = ("ackmany" if batched else "ackone") + str(time.time_ns())
        k, runner = setup_run(r, run, 10)
        assert ack(runner, k, claim(runner, k)[0]) == 1  # index 0 done before
        leases = claim(runner, k, n=9)
        assert [lease[1] for lease in leases] == list(range(1, 10))
        r.hset(k.lease_owner, leases[0][0], "someone-else|s|1|9")  # index 1: lease lost
        r.set(k.params_floor, 1)  # results of version 0 are superseded
        r.hset(k.redo_marks, "truncated", 2)  # a redo of truncated results, issued at v2
        r.hset(k.errors, 4, "an earlier attempt failed")  # index 4's success clears it
        results = [scripts.Result(
            job_id=jid, index=idx, exec_id=ex, completion_tokens=10 * idx, prompt_tokens=idx,
            finish_reason="length" if idx in (3, 6, 8) else "stop",
            version=0 if idx == 3 else (3 if idx == 8 else 1), attempt=att)
            for jid, idx, ex, att in leases]
        if batched:
            got = runner(scripts.ack_many_call(k, "s", results))
        else:
            got = [runner(scripts.ack_many_call(k, "s", [res]))[0] for res in results]
        codes.append(got)
        state = ack_state(r, k, 10)
        for key in r.scan_iter(k.rate_prefix + "*"):  # rate buckets never outlive their use
            assert 0 < r.ttl(key) <= scripts.RATE_BUCKET_TTL_S
        states.append((repr(state).replace(run, "RUN"), state["rate"]))
    # indices 1..9: stale, new, superseded, new, new, set aside, new, new (v3), new
    assert codes[0] == codes[1] == [0, 1, 2, 1, 1, 3, 1, 1, 1]
    (one, rate), (many, _) = states
    assert one == many
    # accepted: index 0 before, then 2, 4, 5, 7, 8, 9; truncated ones counted by version
    assert rate[b"req"] == 7 and rate[b"vreq|3"] == 1 and rate[b"vlen|3"] == 1
    assert rate[b"fin|length"] == 1 and rate[b"tok"] == 100 + 10 * (2 + 4 + 5 + 7 + 8 + 9)


def deleted_through_rq(r: redis.Redis, k: RunKeys) -> set[int]:
    failed = list(bitmap.set_indices(r.get(k.failed) or b""))
    return {i for i, why in zip(failed, failure_reasons(r, k, failed), strict=True)
            if "through RQ" in why}


def test_sweep_goes_round_the_run_a_budget_at_a_time(r, run_name):
    """Jobs deleted through RQ anywhere in the run (chunk edges, the last index) are found by
    sweeps of a bounded budget that carry on where the last one stopped, then start over."""
    k, runner = setup_run(r, run_name, 2000)
    gone = [0, 511, 512, 700, 1337, 1999]
    for idx in gone:
        Job.fetch(k.job_id(idx), connection=r).delete()

    def sweep() -> None:
        runner(scripts.reap_call(k, sweep_every_s=0, sweep_budget=300))

    sweep()  # indices 0-299 checked
    assert deleted_through_rq(r, k) == {0}
    for _ in range(3):
        sweep()  # up to 1199
    assert deleted_through_rq(r, k) == {0, 511, 512, 700}
    for _ in range(3):
        sweep()  # the rest
    assert deleted_through_rq(r, k) == set(gone)
    assert r.bitcount(k.pending) == 2000 - len(gone)
    assert sorted(i for i in range(2000) if r.getbit(k.failed, i)) == gone
    # Past the end the sweep starts over: a job deleted now near the start is found again.
    Job.fetch(k.job_id(5), connection=r).delete()
    sweep()
    sweep()
    assert 5 in deleted_through_rq(r, k)


def test_sweep_runs_once_a_period_for_the_whole_run(r, run_name):
    """However many consumers and monitors reap, the run is swept once per period."""
    k, runner = setup_run(r, run_name, 10)
    runner(scripts.reap_call(k, sweep_every_s=60))  # the first sweep of the run
    Job.fetch(k.job_id(3), connection=r).delete()
    runner(scripts.reap_call(k, sweep_every_s=60))  # another reaper, within the period
    assert deleted_through_rq(r, k) == set()
    runner(scripts.reap_call(k, sweep_every_s=0))
    assert deleted_through_rq(r, k) == {3}


def sample_calls(k: RunKeys) -> list[scripts.Call]:
    """One call of each script, built as the product builds them."""
    res = scripts.Result(job_id="j", index=0, exec_id="e", completion_tokens=1, prompt_tokens=1,
                         finish_reason="stop", version=1, attempt=1)
    return [scripts.claim_call(k, 1, 30, "s", "w", "x"), scripts.renew_call(k, 30, [("j", "e")]),
            scripts.ack_many_call(k, "s", [res]), scripts.release_call(k, "j", 0, "e", refund=True),
            scripts.fail_call(k, "j", 0, "e", reason="r", worker="w"),
            scripts.reap_call(k), scripts.enqueue_call(k, [(0, b"d", "row 0")]),
            scripts.redo_call(k, "done", 0, 1, 2), scripts.expire_call(k, "s"),
            scripts.server_call("server_renew", "lease", token="t", ms=1),
            scripts.server_call("server_release", "lease", token="t"),
            scripts.server_call("server_take", "lease", holder="h", token="t", ms=1),
            scripts.bump_call(k, 1, b"", b"{}", b"{}", abort=False, scopes=()),
            scripts.invalid_call(k, 0, b"{}", 1, 5),
            scripts.turn_call(k, "j", 0, "e", b"{}", b"", made=1, ended=0),
            scripts.rewind_call(k, [(0, b"{}", b"")])]


def test_scripts_read_their_keys_and_arguments_by_name():
    """Each script reads only keys its table names (K) and arguments its call sends (A), and no
    KEYS or ARGV by position: a misspelt name would be nil only on the path that reads it."""
    calls = {call.script: call for call in sample_calls(RunKeys("names"))}
    assert set(calls) == set(scripts.NAMES)
    for name, source in scripts.SOURCES.items():
        body = source.split("local A = cjson.decode(ARGV[1])\n", 1)[1]
        assert not re.search(r"KEYS\[|ARGV\[\d", body), name
        assert set(re.findall(r"\bK\.(\w+)", body)) <= set(scripts.KEYS[name]), name
        call = calls[name]
        assert len(call.keys) == len(scripts.KEYS[name])
        sent = orjson.loads(call.args[0])
        assert set(re.findall(r"\bA\.(\w+)", body)) <= set(sent), name
        for field in re.findall(r"ARGV\[A\.(\w+)\]", body):  # bytes after the JSON
            assert 2 <= sent[field] <= len(call.args), (name, field)


def test_pipelined_calls_run_once_each_after_redis_lost_its_scripts(r, redis_url, run_name):
    """pipelined sends the scripts by sha alone (no SCRIPT EXISTS round trip first); after a
    SCRIPT FLUSH (what a restart leaves) each call still runs, once."""
    import asyncio

    import redis.asyncio as aioredis

    k, _ = setup_run(r, run_name, 4)

    async def go() -> list:
        client = aioredis.Redis.from_url(redis_url)
        try:
            runner = scripts.ScriptRunner(client)
            calls = [scripts.claim_call(k, 1, 30.0, "http://s:1", "w1", f"ex{n}")
                     for n in range(2)]
            first = await runner.pipelined(client, calls)
            await client.script_flush()
            return [*first, *await runner.pipelined(client, calls)]
        finally:
            await client.aclose()

    got = asyncio.run(go())
    assert sorted(int(row[1]) for _, row in got) == [0, 1, 2, 3]
    assert r.llen(k.rq_queue) == 0


def test_a_conversations_claim_says_which_have_made_turns_kept(r, run_name):
    """A --turns all consumer's claim tells it which conversations have no made turns kept (0),
    so those begin without reading them; any other claim says 1 (look)."""
    k, runner = setup_run(r, run_name, 3)
    r.hset(k.conv, "1", orjson.dumps({"made": [[1, 1]]}))
    _, *rows = runner(scripts.claim_call(k, 2, 30.0, "http://s:1", "w1", "ex",
                                         conversations=True))
    assert {int(row[1]): row[6] for row in rows} == {0: 0, 1: 1}
    _, *rows = runner(scripts.claim_call(k, 1, 30.0, "http://s:1", "w1", "ex"))
    assert [(int(row[1]), row[6]) for row in rows] == [(2, 1)]


def test_made_turns_count_in_a_rate_bucket_that_expires(r, run_name):
    """turn.lua sets a rate bucket's TTL when its first generation makes it, not every turn:
    turns alone (no ack yet) still leave a bucket that expires."""
    from genq.common.turns.state import Standing

    k, runner = setup_run(r, run_name, 1)
    [(jid, idx, ex, _)] = claim(runner, k)
    for made in (1, 2):
        standing = Standing([[1, 1]] * made).encode()
        assert runner(scripts.turn_call(k, jid, idx, ex, standing, b"", made, 0, tokens=16,
                                        server="s", version=1)) == 1
    [bucket] = r.scan_iter(k.rate_prefix + "*")
    assert 0 < r.ttl(bucket) <= scripts.RATE_BUCKET_TTL_S
    assert {f.decode(): int(v) for f, v in r.hgetall(bucket).items()} == {
        "tok": 32, "tok|s": 32, "gen": 2, "gen|s": 2}
