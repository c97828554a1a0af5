"""The queue scripts in any order, against a real Redis: claims, renewals, acks (current and
stale), releases, failures, expiries, reaps, consumer crashes, `rq info` sweeps, redos,
parameter changes (finishing or aborting old work) and RQ's own requeue, delete, cancel and
empty, with the invariants checked after every step: each index in exactly one of queued,
leased, done, failed (`pending` says which); done counted once (counters and histogram agree
with the bitmap); attempts never decrease.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass

import pytest
import redis
from conftest import ack_call
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from rq import Queue
from rq.job import Job
from rq.registry import CanceledJobRegistry, FailedJobRegistry, StartedJobRegistry

from genq.common import params
from genq.common.queue import feed, scripts
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import failure_reasons

N = 6
CONSUMERS = ("c0", "c1")
MAX_ATTEMPTS = 3
VT = 60.0  # expiry is forced by moving a lease's deadline, never by waiting


@dataclass(frozen=True)
class Held:
    job_id: str
    index: int
    exec_id: str
    attempt: int
    version: int


class QueueMachine(RuleBasedStateMachine):
    url = ""

    @initialize()
    def start(self) -> None:
        self.r = redis.Redis.from_url(self.url)
        self.k = RunKeys("m" + uuid.uuid4().hex[:10])
        self.run = scripts.ScriptRunner(self.r)
        assert feed.enqueue(self.r, self.k, list(range(N)), self.run) == N
        # The model: what each consumer believes it holds, and what Redis must say.
        self.held: dict[str, list[Held]] = {c: [] for c in CONSUMERS}
        self.owner: dict[int, str] = {}  # index -> exec id of its live lease
        self.done: set[int] = set()
        self.failed: set[int] = set()
        self.attempts = [0] * N
        self.finish: dict[int, str] = {}  # index -> finish_reason of its accepted result
        self.floor = 0  # results of a parameter version below this are superseded
        self.kept: set[int] = set()  # redone indices whose previous result a redo set aside
        self.marks: dict[str, int] = {}  # redo scope -> the version it was issued with

    def teardown(self) -> None:
        if hasattr(self, "r"):
            self.r.close()

    def current(self, lease: Held) -> bool:
        return self.owner.get(lease.index) == lease.exec_id

    def all_held(self) -> list[Held]:
        return [lease for leases in self.held.values() for lease in leases]

    # --- rules ---------------------------------------------------------------------------
    @rule(consumer=st.sampled_from(CONSUMERS), n=st.integers(1, 3))
    def claim(self, consumer: str, n: int) -> None:
        version, *rows = self.run(scripts.claim_call(self.k, n, VT, f"http://{consumer}", consumer,
                                                     uuid.uuid4().hex[:6]))
        for jid, idx, ex, attempt, spent, _tries, _kept in rows:
            idx = int(idx)
            assert idx not in self.owner and idx not in self.done | self.failed
            assert int(attempt) == self.attempts[idx] + 1
            self.attempts[idx] = int(attempt)
            lease = Held(jid.decode(), idx, ex.decode(), int(attempt), int(version))
            self.owner[idx] = lease.exec_id
            if int(spent) > MAX_ATTEMPTS:  # what the consumer does with an exhausted task
                self.fail_current(lease, "gave up")
            else:
                self.held[consumer].append(lease)

    @rule(consumer=st.sampled_from(CONSUMERS))
    def renew(self, consumer: str) -> None:
        leases = self.held[consumer]
        lost = self.run(scripts.renew_call(self.k, VT, [(x.job_id, x.exec_id) for x in leases]))
        assert {j.decode() for j in lost} == {x.job_id for x in leases if not self.current(x)}
        # A consumer drops the leases a renewal reports lost (fencing).
        self.held[consumer] = [x for x in leases if self.current(x)]

    def take(self, pick: int) -> tuple[str, Held]:
        """One lease some consumer holds (current or stale), removed from its hands."""
        owned = [(c, lease) for c, leases in self.held.items() for lease in leases]
        consumer, lease = owned[pick % len(owned)]
        self.held[consumer].remove(lease)
        return consumer, lease

    @precondition(lambda self: any(self.held.values()))
    @rule(pick=st.integers(0, 20), tokens=st.integers(1, 50),
          finish=st.sampled_from(["stop", "length"]))
    def ack(self, pick: int, tokens: int, finish: str) -> None:
        consumer, lease = self.take(pick)
        accepted = self.run(ack_call(
            self.k, lease.job_id, lease.index, lease.exec_id, completion_tokens=tokens,
            prompt_tokens=3, finish_reason=finish, version=lease.version,
            attempt=lease.attempt, server=f"http://{consumer}"))[0]
        # A stale ack (the lease expired and was reaped, or is someone else's now) is refused;
        # a current one under parameters an abort superseded sends the task round again; one
        # under a version a later redo covers is set aside and queued again.
        covered = lease.version < self.marks.get("done", 0) or (
            finish == "length" and lease.version < self.marks.get("truncated", 0))
        if not self.current(lease):
            assert accepted == 0
        elif lease.version < self.floor:
            assert accepted == 2
            del self.owner[lease.index]
        elif covered:
            assert accepted == 3
            del self.owner[lease.index]
            self.kept.add(lease.index)
            self.finish[lease.index] = finish  # the result set aside, which a failure restores
        else:
            assert accepted == 1
            self.finish[lease.index] = finish
            self.kept.discard(lease.index)  # the new result replaces the one set aside
            self.settle(lease.index, self.done)

    @precondition(lambda self: any(self.held.values()))
    @rule(pick=st.integers(0, 20), refund=st.booleans())
    def release(self, pick: int, refund: bool) -> None:
        _, lease = self.take(pick)
        released = self.run(scripts.release_call(self.k, lease.job_id, lease.index,
                                                 lease.exec_id, refund=refund, reason="x"))
        assert released == int(self.current(lease))
        if released:
            del self.owner[lease.index]

    @precondition(lambda self: any(self.held.values()))
    @rule(pick=st.integers(0, 20))
    def fail(self, pick: int) -> None:
        _, lease = self.take(pick)
        if self.current(lease):
            self.fail_current(lease, "bad task")
        else:
            assert self.run(scripts.fail_call(self.k, lease.job_id, lease.index, lease.exec_id,
                                              reason="bad task", worker="w")) == 0

    def fail_current(self, lease: Held, reason: str) -> None:
        """A task failed for good: failed, unless a redo set a result aside for it, which
        then stands again (a redo never loses a result)."""
        got = self.run(scripts.fail_call(self.k, lease.job_id, lease.index, lease.exec_id,
                                         reason=reason, worker="w"))
        assert got == (2 if lease.index in self.kept else 1)
        self.settle(lease.index, self.done if lease.index in self.kept else self.failed)

    @precondition(lambda self: self.owner)
    @rule(pick=st.integers(0, N - 1))
    def expire(self, pick: int) -> None:  # a deadline passes: its consumer stalled or died
        idx = sorted(self.owner)[pick % len(self.owner)]
        self.r.zadd(self.k.leases, {self.k.job_id(idx): 0}, xx=True)
        assert self.r.zscore(self.k.leases, self.k.job_id(idx)) == 0

    @rule()
    def reap(self) -> None:
        expired = {i for i in self.owner if self.r.zscore(self.k.leases, self.k.job_id(i)) == 0}
        got = self.run(scripts.reap_call(self.k, sweep_every_s=0))  # sweeps every time
        reaped = {int(j.decode().rsplit("-", 1)[1]) for j in got}
        # Exactly the expired leases go back to the queue; live ones (deadline from Redis TIME,
        # a minute ahead) are never touched.
        assert reaped == expired
        for idx in reaped:
            del self.owner[idx]  # back in the queue; its old token is now stale

    @rule(abort=st.booleans())
    def bump_params(self, abort: bool) -> None:
        """`genq requeue --set temperature=...`, letting old work finish or aborting it."""
        version, _ = params.bump(self.r, self.k, {"temperature": 0.5}, redo="none",
                                 inflight="abort" if abort else "finish")
        if abort:
            self.floor = version

    def unsettled(self) -> list[int]:
        return [i for i in range(N) if i not in self.done | self.failed]

    @precondition(lambda self: self.unsettled())
    @rule(pick=st.integers(0, N - 1), action=st.sampled_from(["delete", "cancel"]))
    def rq_remove(self, pick: int, action: str) -> None:
        """rq-dashboard's Delete or Job.cancel, then a reaper tick: failed, lease dropped."""
        live = self.unsettled()
        idx = live[pick % len(live)]
        job = Job.fetch(self.k.job_id(idx), connection=self.r)
        job.delete() if action == "delete" else job.cancel()
        self.reap()
        self.owner.pop(idx, None)
        self.failed.add(idx)
        assert "through RQ" in failure_reasons(self.r, self.k, [idx])[0]

    @rule()
    def rq_empty(self) -> None:
        """rq-dashboard's Empty on the queue (Queue.empty deletes every queued job)."""
        queued = {i for i in self.unsettled() if i not in self.owner}
        Queue(self.k.queue_name, connection=self.r).empty()
        self.reap()
        self.failed |= queued

    @precondition(lambda self: self.failed)
    @rule(pick=st.integers(0, N - 1))
    def rq_requeue(self, pick: int) -> None:
        """rq-dashboard's Requeue (or the cancelled registry's), then a reaper tick."""
        idx = sorted(self.failed)[pick % len(self.failed)]
        jid = self.k.job_id(idx)
        for registry in (FailedJobRegistry, CanceledJobRegistry):
            reg = registry(self.k.queue_name, connection=self.r)
            if jid in reg.get_job_ids(cleanup=False):
                reg.requeue(jid)
                break
        else:
            return  # deleted through RQ: RQ has nothing left to requeue
        self.reap()
        self.failed.discard(idx)
        assert self.r.bitfield(self.k.spent).get("u8", f"#{idx}").execute() == [0]
        assert self.r.bitfield(self.k.tries).get("u8", f"#{idx}").execute() == [0]

    @rule(consumer=st.sampled_from(CONSUMERS))
    def crash(self, consumer: str) -> None:  # its leases stay until they expire and are reaped
        self.held[consumer] = []

    @rule()
    def rq_info(self) -> None:  # `rq info` sweeps with the host clock: it must move nothing
        StartedJobRegistry(self.k.queue_name, connection=self.r).cleanup()

    @rule(what=st.sampled_from(["truncated", "done", "failed"]), limit=st.integers(1, 4))
    def redo(self, what: str, limit: int) -> None:
        """`genq requeue --redo` in bounded calls; the consumers' top-up queues them."""
        if what == "failed":
            expected, source = set(self.failed), self.failed
        else:
            expected = {i for i in self.done if what == "done" or self.finish[i] == "length"}
            source = self.done
        below = int(self.r.get(self.k.params_version) or 1) + 1
        # What params.bump does with a redo: a new version, and the scope recorded with it.
        self.r.set(self.k.params_version, below)
        if what != "failed":
            self.marks[what] = below
            self.r.hset(self.k.redo_marks, what, below)
        count, pos = 0, 0
        while pos < N:
            got, pos = self.run(scripts.redo_call(self.k, what, pos, N, below, limit))
            assert got <= limit
            count += got
        assert count == len(expected)
        source -= expected
        if what != "failed":
            self.kept |= expected
        assert feed.enqueue(self.r, self.k, sorted(expected), self.run) == len(expected)

    def settle(self, idx: int, into: set[int]) -> None:
        del self.owner[idx]
        into.add(idx)

    # --- invariants ----------------------------------------------------------------------
    @invariant()
    def each_index_in_exactly_one_state(self) -> None:
        if not hasattr(self, "r"):
            return
        k, r = self.k, self.r
        pipe = r.pipeline(transaction=True)
        pipe.lrange(k.rq_queue, 0, -1)
        pipe.zrange(k.leases, 0, -1)
        pipe.hkeys(k.lease_owner)
        for key in (k.done, k.failed, k.pending):
            pipe.get(key)
        queue, leased, owned, done, failed, pending = pipe.execute()
        queued = Counter(int(j.decode().rsplit("-", 1)[1]) for j in queue)
        leased = {int(j.decode().rsplit("-", 1)[1]) for j in leased}
        assert leased == {int(j.decode().rsplit("-", 1)[1]) for j in owned}
        done, failed, pending = (bitset(x) for x in (done, failed, pending))
        for i in range(N):
            states = [queued[i], i in leased, i in done, i in failed]
            assert sum(map(int, states)) == 1, (i, states)
            assert (i in pending) == bool(queued[i] or i in leased)
        assert leased == set(self.owner) and done == self.done and failed == self.failed

    @invariant()
    def done_counted_once(self) -> None:
        if not hasattr(self, "r"):
            return
        counters = {f.decode(): int(v) for f, v in self.r.hgetall(self.k.counters).items()}
        finishes = sum(v for f, v in counters.items() if f.startswith("finish:"))
        hist = sum(int(c) for c in self.r.hvals(self.k.length_hist))
        assert finishes == hist == len(self.done) == self.r.bitcount(self.k.done)

    @invariant()
    def attempts_never_decrease(self) -> None:
        if not hasattr(self, "r"):
            return
        raw = (self.r.get(self.k.claims) or b"").ljust(2 * N, b"\0")
        now = [int.from_bytes(raw[2 * i:2 * i + 2], "big") for i in range(N)]  # u16 each
        assert now == self.attempts  # the model's count only ever rises (asserted at claim)


def bitset(raw: bytes | None) -> set[int]:
    raw = raw or b""  # bit 0 is the MSB of byte 0, as Redis numbers them
    return {i for i in range(len(raw) * 8) if raw[i // 8] & (0x80 >> (i % 8))}


@pytest.mark.timeout(300)
def test_queue_invariants_hold_in_any_order(redis_server):
    QueueMachine.url = redis_server.url
    run_state_machine_as_test(QueueMachine, settings=settings(
        max_examples=100, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
