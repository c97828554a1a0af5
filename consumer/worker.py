"""The consumer loop: one slot per request the server runs at once (follow.py resizes them),
each holding one leased task at a time, plus lease renewal and housekeeping, in one TaskGroup.
A slot whose answer came hands it to a commit (write, then acknowledge) and claims its next task
at once, so the server stays exactly full; claims of many slots go to Redis together
(consumer/batch.py), and so do their writes and acks (consumer/commit.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import redis
import redis.asyncio as aioredis
import structlog

from common.data.records import build_record
from common.errors import (
    BadTask,
    Retryable,
    TryAgain,
    classify,
    mask_secrets,
)
from common.params import DEFAULTS, request_body
from common.queue.keys import RunKeys
from common.queue.scripts import ScriptRunner, iso_now
from common.sglang.client import SGLang
from consumer import background, presence, shutdown
from consumer.backoff import ClaimPause, ShuttingDown, redis_retry
from consumer.batch import Batcher
from consumer.commit import Committer
from consumer.follow import Tracking, new_history, resize
from consumer.leases import KEPT, Lease, TaskQueue
from consumer.ready import Ready
from consumer.reuse import kept_answer
from consumer.runstate import RunState
from consumer.settings import ConsumeSettings

logger = structlog.get_logger("consumer")
T = TypeVar("T")


@dataclass
class Inflight:
    lease: Lease
    request: asyncio.Task | None = None  # the request to the server, once sent
    abort: str = ""
    started: float = field(default_factory=time.monotonic)

    def sent(self, request: asyncio.Task) -> None:
        """SGLang.chat's on_request. An abort that came while the request was not sent yet
        (a probe's kept answer was being looked up) ends it now."""
        self.request = request
        if self.abort:
            request.cancel()


class Consumer:
    def __init__(self, s: ConsumeSettings, client: aioredis.Redis, keys: RunKeys, *,
                 sync: redis.Redis, total: int, dataset: Any, sink: Any, server: SGLang,
                 capacity: int, model: str, runstate: RunState) -> None:
        self.s, self.r, self.k, self.total = s, client, keys, total
        # The producer's top-up code is synchronous; it runs on its own client in a thread.
        self.sync, self.sync_scripts = sync, ScriptRunner(sync)
        self.dataset, self.sink, self.server = dataset, sink, server
        self.capacity, self.model = capacity, model
        self.context_length: int | None = None  # the server's, as last read (follow.py)
        self.server_recorded = False
        self.tg: asyncio.TaskGroup | None = None
        self.runstate = runstate
        self.q = TaskQueue(client, keys, server=s.server, worker=s.name,
                           visibility_timeout=s.visibility_timeout)
        self.held: dict[str, Inflight] = {}  # answers being generated, written or acked
        self.sending = 0  # requests sent and not yet answered
        self.ready = Ready(self)  # tasks claimed ahead for the next slots to finish
        self.claims = Batcher(self.ready.claim_for)
        self.committer = Committer(self)  # answers being written and acked
        self.stop = asyncio.Event()
        self.waker = asyncio.Event()  # ends every nap(); replaced each time it fires
        self.params: dict[int, dict[str, Any]] = {}
        self.version = 0
        self.pause = ClaimPause()
        self.load, self.load_history = None, new_history()  # follow.py reads and keeps them
        self.tracking = Tracking()  # the slot count following the server's load (follow.py)
        self.probe_kept = False  # answers of `requeue --probe` to look for (reuse.py)
        self.acked = self.started_at = 0
        self.birth = iso_now()
        self.crashed = ""  # the background task that died, if one did
        self.slots: dict[int, asyncio.Task] = {}  # slot number -> its task (follow.resize)
        self.deadline: float | None = None  # end of the shutdown grace, once stopping
        self.finished = False  # the slots are done: background loops end (see cancel_and_wait)

    # --- lifecycle ---------------------------------------------------------------------
    async def run(self) -> None:
        await redis_retry(self.q.preload)
        background = [asyncio.create_task(shutdown.supervise(self, body))
                      for body in (self.keep_leases, self.housekeeping)]
        try:
            async with asyncio.TaskGroup() as tg:
                self.tg = tg
                resize(self)
                tg.create_task(shutdown.drain(self))
        finally:
            self.finished = True
            await shutdown.cancel_and_wait(background)
            await shutdown.withdraw(lambda: presence.withdraw(self.r, self.k, self.s.name))

    def retry(self, op: Callable[[], Awaitable[T]]) -> Awaitable[T]:
        """A Redis operation retried through outages, except past the shutdown grace."""
        return redis_retry(op, self.past_grace)

    def past_grace(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def request_stop(self) -> None:
        """First SIGTERM: stop claiming and drain; a second one gives everything back now.
        The flag is set before anything is logged: stopping never depends on logging."""
        again = self.stop.is_set()
        self.halt()
        if again:
            self.deadline = time.monotonic()
            self.abort_all("shutdown")
        logger.info("stopping", inflight=len(self.held), grace_s=self.s.grace)

    def halt(self) -> None:
        """Stop claiming; napping slots see it now, not after their nap."""
        self.stop.set()
        self.committer.hurry.set()
        self.wake()

    def wake(self) -> None:
        self.waker.set()
        self.waker = asyncio.Event()

    async def nap(self, seconds: float) -> None:
        """Sleep up to `seconds`; a stop, or the last held task done (a burst run may have
        settled), ends it at once."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.waker.wait()

    def abort_all(self, reason: str) -> None:
        for inflight in list(self.held.values()):
            self.abort(inflight, reason)

    def abort(self, inflight: Inflight, reason: str) -> None:
        """Cancel the task's request; one not sent yet is not sent (generate and
        Inflight.sent check), nor is the retry of one that did not fit the context."""
        if inflight.request is None or inflight.request.done():
            inflight.abort = inflight.abort or reason
        else:
            inflight.abort = reason
            inflight.request.cancel()

    # --- slots -------------------------------------------------------------------------
    async def slot(self, n: int) -> None:
        try:
            await self.claim_and_process(n)
        except ShuttingDown as e:
            logger.warning("stopped_without_redis", error=str(e),
                           consequence="held leases expire and return to the queue")

    async def claim_and_process(self, n: int) -> None:
        """Slot n claims and runs tasks until the stop, or until the capacity drops below n."""
        while not self.stop.is_set() and n < self.capacity:
            if self.pause.remaining():
                await self.nap(min(0.5, self.pause.remaining()))
                continue
            if self.runstate.paused:  # the run is gone from Redis: claim nothing until back
                await self.nap(0.5)
                continue
            inflight = await self.ready.take(n)
            if inflight is None:
                if self.s.burst and not self.held and await self.settled():
                    if not self.stop.is_set():
                        logger.info("run_settled", acked=self.acked)
                    self.halt()
                    return
                spread = max(1.0, self.capacity / 64)  # thousands of idle slots poll slower
                await self.nap(self.s.poll * (0.5 + random.random()) * spread)
                continue
            # bind/reset, not bound_contextvars(): its generator costs ~2 % of a busy consumer
            tokens = structlog.contextvars.bind_contextvars(index=inflight.lease.index)
            try:
                await self.process(inflight)
            finally:
                structlog.contextvars.reset_contextvars(**tokens)

    def hold(self, lease: Lease) -> Inflight:
        """A claimed task is held (its lease renewed, abortable) from its claim to its ack."""
        inflight = self.held[lease.job_id] = Inflight(lease)
        return inflight

    def let_go(self, inflight: Inflight) -> None:
        """Stop holding this task, unless its job was claimed again meanwhile: a task given
        back can be claimed by another slot before this one resumes, and that claim's lease
        must stay held (renewed), or it expires under a running request."""
        job_id = inflight.lease.job_id
        if self.held.get(job_id) is inflight:
            del self.held[job_id]

    def spawn(self, body: Coroutine[Any, Any, None]) -> None:
        assert self.tg is not None  # everything a slot starts runs in Consumer.run's group
        self.tg.create_task(body)

    async def process(self, inflight: Inflight) -> None:
        lease = inflight.lease
        committing = False
        try:
            if lease.spent > self.s.max_attempts:
                last = await self.retry(lambda: self.q.last_error(lease.index))
                reason = f"gave up after {self.s.max_attempts} attempts; last error: {last}"
                outcome = await self.retry(lambda: self.q.fail(lease, reason))
                logger.warning("task_failed", reason=reason,
                               previous_result_kept=outcome == KEPT)
                return
            answered = await self.generate(inflight)
            if answered is not None:
                # The server's slot is free now: the write and ack run beside the next task,
                # and the committer lets the lease go once acked.
                self.committer.add(inflight, *answered)
                committing = True
        finally:
            if not committing:
                self.let_go(inflight)
        await self.committer.room.wait()  # a slow disk: wait rather than pile answers up

    async def generate(self, inflight: Inflight) -> tuple[dict[str, Any], Any] | None:
        """The task's record and completion, or None when it ended otherwise (failed, given
        back or aborted; Redis already says so)."""
        lease = inflight.lease
        try:
            # A read that may block (a Parquet row group) runs off the loop: never stall renewals.
            prompt = (self.dataset.prompt(lease.index) if self.dataset.cached(lease.index)
                      else await asyncio.to_thread(self.dataset.prompt, lease.index))
            params = await self.params_for(lease.version)
            body = request_body(prompt.messages, params, self.model)
            if inflight.abort or self.stop.is_set():
                # Claimed while the stop came (or aborted before its request existed): a
                # request started now would outlive the grace by a whole generation.
                inflight.abort = inflight.abort or "shutdown"
                await self.after_abort(inflight)
                return
            completion = await kept_answer(self, body, lease.index)
            if completion is None:
                self.sending += 1
                try:
                    completion = await self.server.chat(body, lease.index,
                                                        on_request=inflight.sent)
                finally:
                    self.sending -= 1
            record = build_record(
                run=self.s.run, index=lease.index, prompt_id=prompt.id, version=lease.version,
                attempt=lease.attempt, server=self.s.server, model=body["model"],
                completion=completion, latency_s=time.monotonic() - inflight.started)
            return record, completion
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            await self.after_abort(inflight)
        except Exception as e:
            await self.settle_error(lease, e)
        return None

    async def settle_error(self, lease: Lease, e: Exception) -> None:
        """Fail the task, or give it back with or without spending the attempt; an error
        no verdict covers is a bug and crashes the consumer."""
        verdict = classify(e)
        if verdict is BadTask:
            reason = mask_secrets(e.reason if isinstance(e, BadTask) else str(e))
            outcome = await self.retry(lambda: self.q.fail(lease, reason))
            logger.warning("task_failed", reason=reason,
                           previous_result_kept=outcome == KEPT)
            return
        if verdict is not Retryable and verdict is not TryAgain:
            raise e
        # Retryable: the server's trouble, refunded; TryAgain: spends the attempt.
        error = mask_secrets(str(e) or type(e).__name__)  # kept in Redis, shown by rq
        refund = verdict is Retryable
        await self.retry(lambda: self.q.release(lease, refund=refund, reason=error))
        if refund:
            self.pause.trouble(error)
        else:
            logger.info("task_retried", reason=error)

    async def after_abort(self, inflight: Inflight) -> None:
        lease = inflight.lease
        if inflight.abort == "lost":
            logger.warning("lease_lost", reason="lease expired; the task was handed out again")
            return
        reason = f"aborted: {inflight.abort}"
        await self.retry(lambda: self.q.release(lease, refund=True, reason=reason))
        logger.info("task_released", reason=reason)

    async def params_for(self, version: int) -> dict[str, Any]:
        if version not in self.params:
            raw = await self.r.hget(self.k.params, str(version))
            self.params[version] = orjson.loads(raw) if raw else dict(DEFAULTS)
        return self.params[version]

    async def settled(self) -> bool:
        return await redis_retry(self.count_settled, self.stop.is_set)

    async def count_settled(self) -> bool:
        pipe = self.r.pipeline(transaction=False)
        pipe.bitcount(self.k.done)
        pipe.bitcount(self.k.failed)
        pipe.zcard(self.k.leases)
        pipe.llen(self.k.rq_queue)
        done, failed, leased, queued = await pipe.execute()
        return done + failed >= self.total and not leased and not queued

    # --- background (consumer/background.py) ----------------------------------------------
    async def keep_leases(self) -> None:
        await background.keep_leases(self)

    async def housekeeping(self) -> None:
        await background.housekeeping(self)
