"""The consumer: keeps one SGLang server exactly full, with a slot per request it runs at once.
A stop drains the slots for --grace seconds and gives back what is left."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
import redis
import redis.asyncio as aioredis
import structlog

from genq.common.data.records import failed_record
from genq.common.data.rows import Dataset, Prompt
from genq.common.data.shards import ShardWriter
from genq.common.errors import (
    AnswerInvalid,
    BadTask,
    Retryable,
    RunStateLost,
    TryAgain,
    classify,
    mask_secrets,
)
from genq.common.params import DEFAULTS
from genq.common.queue import feed
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import ALL, LAST, OK, REPLACED, finished
from genq.common.queue.scripts import ScriptRunner, iso_now
from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import Partials
from genq.common.sglang.stream import Completion
from genq.common.task import Task, row_fields
from genq.consumer import presence, shutdown
from genq.consumer.backoff import ClaimPause, Duty, ShuttingDown, redis_retry, run_duty
from genq.consumer.commit import Committer
from genq.consumer.follow import HISTORY_PERIOD_S, Follower
from genq.consumer.leases import KEPT, Inflight, Prefetch, TaskQueue
from genq.consumer.runstate import RunState
from genq.consumer.settings import ConsumeSettings
from genq.consumer.structured import Structured
from genq.consumer.turns import Conversations, last_turn

logger = structlog.get_logger("consumer")
T = TypeVar("T")


class Consumer:
    def __init__(self, s: ConsumeSettings, client: aioredis.Redis, keys: RunKeys, *,
                 sync: redis.Redis, total: int, dataset: Dataset, sink: ShardWriter,
                 samples: int = 1, turns: str = LAST,
                 server: SGLang, capacity: int, model: str, runstate: RunState,
                 context_length: int | None = None,
                 lease_held: Callable[[], bool] = lambda: True) -> None:
        self.settings, self.redis, self.keys, self.total = s, client, keys, total
        self.samples = samples  # task t asks for row t // samples
        # --turns all: a task is a conversation, made turn by turn (consumer/turns.py)
        self.conversations = Conversations(self) if turns == ALL else None
        self.dataset, self.sink, self.server, self.model = dataset, sink, server, model
        # The queue's top-up is synchronous code, run in a thread on its own client.
        self.sync, self.sync_scripts, self.runstate = sync, ScriptRunner(sync), runstate
        self.queue = TaskQueue(client, keys, server=s.server_id, worker=s.name,
                               visibility_timeout=s.visibility_timeout,
                               life=lambda: (runstate.epoch, runstate.gen),
                               conversations=turns == ALL)
        self.follower = Follower(server, capacity=capacity, context_length=context_length,
                                 fixed=bool(s.concurrency))
        self.lease_held = lease_held  # our server lease is surely ours (consumer/servers.py)
        self.held: dict[str, Inflight] = {}  # claimed tasks, from their claim to their ack
        self.stop = asyncio.Event()
        self.prefetch = Prefetch(self.claim, self.put_back, slots=lambda: self.capacity,
                                 poll=s.poll, paused=self.claiming_paused, stop=self.stop,
                                 on_empty=self.on_empty)
        self.committer = Committer(
            lambda records: self.sink.write_many(records),
            lambda results: self.retry(lambda: self.queue.ack(results)),
            record=self.conversations.turns.run if self.conversations else None,
            on_error=self.settle_error,
            on_done=self.committed, slots=lambda: self.capacity,
            busy=lambda: any(i.at_server for i in self.held.values()))
        self.params: dict[int, dict[str, Any]] = {}
        self.structured = Structured(client, keys, self.retry)
        self.version = 0  # the newest parameter version seen
        self.out_dirs = 0  # output directories the run has, as last counted
        self.clock_offset = 0.0  # Redis's clock less this host's, as the heartbeat last saw
        self.pause = ClaimPause(s.max_retry_after)
        self.partials = Partials(self.redis, self.keys)  # `requeue --continue`'s
        self.acked = self.started_at = 0
        self.birth = iso_now()
        self.crashed = ""  # the duty that died, if one did
        self.slots: dict[int, asyncio.Task[None]] = {}
        self.tg: asyncio.TaskGroup | None = None
        self.deadline: float | None = None  # end of the shutdown grace, once stopping
        self.server_recorded = False
        self.finished_said = False  # run_finished was logged for the run as it stands

    @property
    def capacity(self) -> int:
        return self.follower.capacity

    @property
    def running(self) -> int:
        """Our requests the server holds now: sent and not answered yet."""
        return sum(1 for i in self.held.values() if i.at_server)

    async def run(self) -> None:
        await redis_retry(self.queue.preload)
        await redis_retry(self.heartbeat)  # the clock offset before the first record
        await redis_retry(self.watch_params)  # the version before the first claim
        loops = [asyncio.create_task(run_duty(duty, self.crash)) for duty in self.duties()]
        try:
            async with asyncio.TaskGroup() as tg:
                self.tg = tg
                self.resize()
                prefetching = tg.create_task(self.prefetch.run())
                committing = tg.create_task(self.committer.run())
                tg.create_task(self.drain(prefetching, committing))
        finally:
            await shutdown.cancel_and_wait(loops)
            await shutdown.withdraw(
                lambda: presence.withdraw(self.redis, self.keys, self.settings.name))

    def duties(self) -> list[Duty]:
        vt = self.settings.visibility_timeout
        return [
            Duty("renew_leases", self.renew_leases, lambda: vt / 3),
            Duty("heartbeat", self.heartbeat, lambda: 1.0),
            Duty("check_run", self.check_run, lambda: 0.5),
            Duty("watch_params", self.watch_params, lambda: 0.5),
            Duty("upkeep", self.upkeep, lambda: 1.0),
            # These two talk to the server, and to Redis only now and then.
            Duty("follow_load", self.follow_load,
                 lambda: 0.5 if self.follower.unconfirmed else 1.0, redis=False),
            Duty("follow_server", self.follow_server, lambda: HISTORY_PERIOD_S, redis=False),
        ]

    async def drain(self, prefetching: asyncio.Task[None], committing: asyncio.Task[None]) -> None:
        """Once stopping: in-flight work gets the grace, then is given back."""
        await self.stop.wait()
        if self.deadline is None:
            self.deadline = time.monotonic() + self.settings.grace
        shutdown.arm_watchdog(self.settings.grace)
        await shutdown.bounded([prefetching])  # its last claim, if one was under way, lands
        await self.prefetch.give_back()  # tasks claimed ahead and never started
        while self.held and not self.past_grace():
            await asyncio.sleep(0.05)
        self.abort_all("shutdown")
        await shutdown.bounded(list(self.slots.values()))
        self.committer.close()
        await shutdown.bounded([committing])

    def request_stop(self) -> None:
        """First SIGTERM: stop claiming and drain; a second one gives everything back now.
        The flag is set before anything is logged: stopping never depends on logging."""
        again = self.stop.is_set()
        self.halt()
        if again:
            self.deadline = time.monotonic()
            self.abort_all("shutdown")
        logger.info("stopping", inflight=len(self.held), grace_s=self.settings.grace,
                    then="giving it all back now" if again else "a second Ctrl-C (or SIGTERM) "
                    "gives everything in flight back at once")

    def halt(self) -> None:
        self.stop.set()
        self.committer.hurry.set()
        self.prefetch.wake()

    def crash(self, duty: str) -> None:
        self.crashed = duty
        self.request_stop()

    def retry(self, op: Callable[[], Awaitable[T]]) -> Awaitable[T]:
        """A Redis operation retried through outages, except past the shutdown grace."""
        return redis_retry(op, self.past_grace)

    def past_grace(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def abort_all(self, reason: str) -> None:
        for inflight in list(self.held.values()):
            inflight.cancel(reason)

    def resize(self) -> None:
        """One slot per request the server runs at once. Slots above a lowered capacity end
        after their current task; a raised one gets new slots here."""
        if self.tg is None or self.stop.is_set():
            return
        for n in range(self.capacity):
            if n not in self.slots:
                self.slots[n] = self.tg.create_task(self.slot(n))

    async def slot(self, n: int) -> None:
        try:
            while not self.stop.is_set() and n < self.capacity:
                if self.claiming_paused():
                    await asyncio.sleep(min(0.5, self.pause.remaining() or 0.5))
                    continue
                inflight = await self.prefetch.get()
                if inflight is None:
                    return
                if self.version and inflight.lease.version < self.version:
                    # Claimed under parameters changed since and not started: it runs again
                    # under the new ones, whatever --inflight said about running requests.
                    await self.put_back(inflight, "parameters changed before it started")
                    continue
                # bind/reset, not bound_contextvars(): its generator costs ~2 % of a busy slot
                tokens = structlog.contextvars.bind_contextvars(
                    **row_fields(inflight.lease.index, self.samples))
                try:
                    await self.process(inflight)
                finally:
                    structlog.contextvars.reset_contextvars(**tokens)
        except ShuttingDown as e:
            logger.warning("stopped_without_redis", error=str(e),
                           consequence="held leases expire and return to the queue")
        finally:
            self.slots.pop(n, None)

    def claiming_paused(self) -> bool:
        """The run is gone from Redis, the server or disk is in trouble, or our server lease
        is not surely ours (a spare may drive the server)."""
        return self.runstate.state != OK or self.pause.remaining() > 0 or not self.lease_held()

    async def claim(self, n: int) -> list[Inflight]:
        """Prefetch's claim: each claimed task is held from now on (renewed, abortable), and
        its data set row is read, off the event loop unless it is in memory already."""
        if not self.lease_held():  # a retry through an outage or a freeze: a spare may drive
            return []
        got = [Inflight(lease) for lease in await self.queue.claim(n)]
        if self.queue.stale:  # another run, or recovered since this consumer last looked
            await self.check_run()
        self.held.update({inflight.lease.job_id: inflight for inflight in got})
        if got:
            self.finished_said = False  # work again (a redo): its end is said again
        if all(self.dataset.cached(i.lease.index // self.samples) for i in got):
            self.read_prompts(got)
        else:
            await asyncio.to_thread(self.read_prompts, got)
        return got

    def read_prompts(self, tasks: list[Inflight]) -> None:
        for inflight in tasks:
            try:
                inflight.prompt = self.dataset.prompt(inflight.lease.index // self.samples)
            except Exception as e:  # a bad row or an unreadable file: its task settles it
                inflight.prompt = e

    def let_go(self, inflight: Inflight) -> None:
        """Stop holding this task, unless its job was claimed again meanwhile (by another slot,
        once given back): that claim's lease must stay renewed, or it expires under a request."""
        if self.held.get(inflight.lease.job_id) is inflight:
            del self.held[inflight.lease.job_id]
            if not self.held:
                self.prefetch.wake()  # a burst run may have settled

    async def put_back(self, inflight: Inflight, reason: str) -> None:
        """Release a task unspent: no request was sent for it."""
        try:
            await self.retry(lambda: self.queue.release(inflight.lease, refund=True,
                                                        reason=reason, unclaim=True))
            logger.debug("ready_task_returned", **row_fields(inflight.lease.index, self.samples),
                         reason=reason)
        except ShuttingDown:
            pass  # past the grace with Redis away: the lease expires instead
        finally:
            self.let_go(inflight)

    async def on_empty(self) -> None:
        """Prefetch found nothing to claim: a --burst consumer ends once the run is settled;
        a long-running one says once that the run is finished, and waits for more work."""
        if self.held or (self.finished_said and not self.settings.burst):
            return
        try:  # Redis away here is ridden out like any call, not a crash of the prefetcher
            if not await redis_retry(self.settled, self.stop.is_set):
                return
        except ShuttingDown:
            return
        if self.settings.burst:
            if not self.stop.is_set():
                logger.info("run_settled", acked=self.acked)
            self.halt()
        elif not self.finished_said:
            logger.info("run_finished", acked=self.acked,
                        reason="every prompt is done or failed; waiting for a requeue")
            self.finished_said = True

    async def settled(self) -> bool:
        return await asyncio.to_thread(finished, self.sync, self.keys, self.total)

    def committed(self, batch: list[Inflight], accepted: int) -> None:
        if accepted:  # counted per batch: a log call per task was 1 % of a busy consumer
            self.acked += accepted
            self.pause.recovered()
            logger.debug("tasks_acked", count=accepted)
        for inflight in batch:
            self.let_go(inflight)

    async def process(self, inflight: Inflight) -> None:
        lease, answered = inflight.lease, None
        try:
            s = self.settings
            if (gave_up := lease.gave_up(s.max_attempts, s.max_claims)) is not None:
                last = await self.retry(lambda: self.queue.last_error(lease.index))
                await self.fail(inflight, f"gave up after {gave_up}; last error: {last}")
            else:
                answered = await self.generate(inflight)
        finally:
            if answered is None:
                self.let_go(inflight)
        if answered is not None:
            # The server's slot is free: write and ack run beside the next task (on_done lets go).
            self.committer.add(inflight, *answered)
            await self.committer.room.wait()  # a slow disk: wait rather than pile answers up

    async def generate(self, inflight: Inflight) -> tuple[dict[str, Any], Completion] | None:
        """The task's record and completion; None if it ended otherwise (Redis already says so)."""
        lease = inflight.lease
        try:
            prompt = inflight.prompt
            if not isinstance(prompt, Prompt):
                raise prompt or RuntimeError(
                    f"row {lease.index // self.samples} was not read with its claim")
            task = Task(lease.index, self.samples, await self.params_for(lease.version))
            if self.conversations is not None:
                return await self.conversations.make(inflight, prompt, task)
            return await last_turn(self, inflight, prompt, task)
        except asyncio.CancelledError:
            if (current := asyncio.current_task()) is not None and current.cancelling():
                raise
            await self.after_abort(inflight)
        except Exception as e:
            await self.settle_error(inflight, e)
        return None

    async def fail(self, inflight: Inflight, reason: str,
                   answer: dict[str, Any] | None = None) -> int | None:
        """The whole reason goes to the shard first (Redis keeps its kind), as an answer does
        before its ack; a write that fails gives the task back, as it does an answer's (None).
        Else fail.lua's outcome."""
        lease, prompt = inflight.lease, inflight.prompt
        record = failed_record(
            run=self.settings.run, task=lease.index, samples=self.samples, error=reason,
            answer=answer,  # failed on the schema: the last answer, for inspection
            prompt_id=prompt.id if isinstance(prompt, Prompt) else getattr(prompt, "row_id", None),
            version=lease.version, attempt=lease.attempt, server=self.settings.server_id,
            gen=lease.gen, clock_offset=self.clock_offset)
        try:
            await asyncio.to_thread(self.sink.write_many, [record])
        except Exception as e:
            await self.settle_error(inflight, e)
            return None
        outcome = await self.retry(lambda: self.queue.fail(lease, reason))
        await self.retry(lambda: self.partials.drop(lease.index, lease.version))  # for good
        logger.warning("task_failed", reason=reason, previous_result_kept=outcome == KEPT)
        return outcome

    async def settle_error(self, inflight: Inflight, e: Exception) -> None:
        """Fail the task, or give it back with or without spending the attempt; an error no
        verdict covers is a bug and crashes the consumer."""
        verdict = classify(e)
        if verdict is BadTask:
            outcome = await self.fail(
                inflight, mask_secrets(e.reason if isinstance(e, BadTask) else str(e)),
                e.answer if isinstance(e, AnswerInvalid) else None)
            if outcome == 1 and isinstance(e, AnswerInvalid):  # failed on the schema
                await self.structured.failed(e)
            return
        if verdict is not Retryable and verdict is not TryAgain:
            raise e
        # Retryable: the server's trouble, refunded; TryAgain: spends the attempt.
        error = mask_secrets(str(e) or type(e).__name__)  # kept in Redis, shown by rq
        # A request the server never saw (refused) costs no claim either: no prompt is why.
        refund, unclaim = verdict is Retryable, getattr(e, "unsent", False)
        await self.retry(lambda: self.queue.release(inflight.lease, refund=refund, reason=error,
                                                    unclaim=unclaim))
        if refund:
            self.pause.trouble(error, getattr(e, "retry_after", None))
        else:
            logger.info("task_retried", reason=error)

    async def after_abort(self, inflight: Inflight) -> None:
        if inflight.abort == "lost":
            logger.warning("lease_lost", reason="lease expired; the task was handed out again")
            return
        reason = f"aborted: {inflight.abort}"  # genq's doing: neither attempt nor claim counts
        await self.retry(lambda: self.queue.release(inflight.lease, refund=True, reason=reason,
                                                    unclaim=True))
        logger.info("task_released", reason=reason)

    async def params_for(self, version: int) -> dict[str, Any]:
        if version not in self.params:
            raw = await self.redis.hget(self.keys.params, str(version))
            self.params[version] = orjson.loads(raw) if raw else dict(DEFAULTS)
        return self.params[version]

    async def renew_leases(self) -> None:
        held = list(self.held.values())
        lost = await self.queue.renew([i.lease for i in held])
        for inflight in held:
            if inflight.lease.job_id in lost:
                inflight.cancel("lost")

    async def heartbeat(self) -> None:
        before = time.time()
        now, micros = await self.redis.time()
        # Records are dated by Redis's clock (an abort switch's time is), whatever this host's.
        self.clock_offset = now + micros / 1e6 - (before + time.time()) / 2
        self.started_at = self.started_at or now
        f = self.follower
        # held = running at the server + claimed ahead + answered and being committed
        beat = {"name": self.settings.name, "server": self.settings.server_id,
                "url": self.settings.server,
                "capacity": self.capacity, "inflight": len(self.held), "running": self.running,
                "ahead": len(self.prefetch.ready), "load": f.load,
                "load_history": list(f.history), "host": socket.gethostname(),
                "pid": os.getpid(), "acked": self.acked, "started_at": self.started_at,
                "context_length": f.context_length, "out": os.path.abspath(self.settings.out),
                "run_state": self.runstate.state, "out_dirs": self.runstate.out_dirs}
        await presence.announce(self.redis, self.keys, self.settings.name, now, beat,
                                birth=self.birth, held=list(self.held))

    async def check_run(self) -> None:
        was = self.runstate.state
        state = await self.runstate.check(self.redis)
        if state != OK and was == OK or self.runstate.recovered:
            # Redis forgot these leases with the run: free the server now (their acks would be
            # refused: a recover starts a new generation of the run).
            self.abort_all("lost")
        if state == REPLACED:
            self.halt()  # cached parameters and data set are another run's: stop
        if state == OK and (was != OK or self.runstate.recovered):
            self.runstate.recovered = False
            await self.redis.sadd(self.keys.outdirs, os.path.abspath(self.settings.out))
            self.params.clear()  # versions may have been renumbered by a later requeue
            self.version = 0
            self.partials.reset()

    async def watch_params(self) -> None:
        if self.runstate.state != OK:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.params_version)
        pipe.scard(self.keys.outdirs)
        raw, out_dirs = await pipe.execute()
        if out_dirs != self.out_dirs:  # another consumer's output: the manifest lists it too
            self.out_dirs = out_dirs
            await self.runstate.keep_manifest(self.sync)
        version = int(raw or 1)
        if version <= self.version:
            return
        previous, self.version = self.version, version
        await self.runstate.keep_manifest(self.sync)
        if not previous:
            return
        last = await self.redis.lindex(self.keys.params_history, -1)
        policy = orjson.loads(last).get("inflight", "abort") if last else "abort"
        logger.info("params_changed", version=version, inflight=policy)
        if policy == "abort":
            for inflight in list(self.held.values()):
                if inflight.lease.version < version:
                    inflight.cancel(f"parameters changed to version {version}")

    async def upkeep(self) -> None:
        """Reap expired leases; top the queue up when it runs low, so the server stays full after
        a redo or with no producer running (the enqueue script prevents doubles)."""
        if self.runstate.state != OK:
            return
        await self.queue.reap()
        if await self.redis.llen(self.keys.rq_queue) >= self.capacity:
            return
        with contextlib.suppress(RunStateLost):  # vanished since the last check: it says so
            await asyncio.to_thread(feed.top_up, self.sync, self.keys, self.total,
                                    2 * self.capacity, self.sync_scripts,
                                    epoch=self.runstate.epoch)

    async def follow_load(self) -> None:
        if await self.follower.load_tick(self.running) is not None:
            self.resize()

    async def follow_server(self) -> None:
        if await self.follower.server_tick() or not self.server_recorded:
            f = self.follower
            await presence.record_server(self.redis, self.keys, self.settings.server_id,
                                         f.context_length, f.server_max or self.capacity)
            self.server_recorded = True
