"""Finished answers are written and acknowledged beside the slots, in batches: one fdatasync
and one ack.lua call for every answer that finished while the previous batch was committed.
A slot hands its answer over and claims its next task at once, so a slow disk never keeps a
server slot empty; the task's lease stays held (and renewed) until its ack.

While requests are running, a batch waits up to LINGER_S after the previous one began, or
until half the slots' answers are in: a server answering 160 requests a second then shares
each ack.lua call among ~8 answers instead of ~1.5 (with the claims' larger batches, Redis
commands per task 33 -> 15, bench/README.md). No slot waits for it; an answer that comes
while no other request runs, or at a stop, goes at once. The price: at a parameter change
that aborts old work, answers that finished up to LINGER_S before it run again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from common.queue.scripts import Result
from consumer.backoff import ShuttingDown
from consumer.batch import MAX_BATCH
from consumer.leases import ACCEPTED, SET_ASIDE, SUPERSEDED

if TYPE_CHECKING:
    from consumer.worker import Consumer, Inflight

logger = structlog.get_logger("consumer")

LINGER_S = 0.05


@dataclass
class Finished:
    inflight: Inflight
    record: dict[str, Any]
    completion: Any  # common.sglang.stream.Completion


class Committer:
    def __init__(self, consumer: Consumer) -> None:
        self.c = consumer
        self.pending: list[Finished] = []
        self.task: asyncio.Task[None] | None = None
        self.room = asyncio.Event()  # cleared while a capacity of answers waits (a slow disk)
        self.room.set()
        self.hurry = asyncio.Event()  # commit the next batch without lingering
        self.last = 0.0  # when the last batch began (time.monotonic)

    def add(self, inflight: Inflight, record: dict[str, Any], completion: Any) -> None:
        self.pending.append(Finished(inflight, record, completion))
        if len(self.pending) >= max(1, self.c.capacity // 2) or not self.c.sending:
            self.hurry.set()
        if len(self.pending) >= self.c.capacity:
            self.room.clear()
        if self.task is None:
            assert self.c.tg is not None  # slots only run inside Consumer.run's TaskGroup
            self.task = self.c.tg.create_task(self.run())

    async def run(self) -> None:
        try:
            await asyncio.sleep(0)  # the answers that came in this turn of the loop join
            while self.pending:
                await self.linger()
                self.hurry.clear()
                self.last = time.monotonic()
                batch, self.pending = self.pending[:MAX_BATCH], self.pending[MAX_BATCH:]
                try:
                    await self.commit(batch)
                finally:
                    for done in batch:
                        self.c.let_go(done.inflight)
                    if len(self.pending) < self.c.capacity:
                        self.room.set()
                    if not self.c.held:
                        self.c.wake()  # idle slots look again now: the run may be settled
        finally:
            self.task = None
            self.room.set()

    async def linger(self) -> None:
        """Wait for more answers to share this batch's write and ack: until LINGER_S after the
        previous batch began, half the slots' answers, the last request's answer, or a
        stop (Consumer.halt hurries)."""
        wait = self.last + LINGER_S - time.monotonic()
        if wait <= 0 or self.hurry.is_set() or self.c.stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self.hurry.wait()

    async def commit(self, batch: list[Finished]) -> None:
        """Write the records, then acknowledge them: never an ack for a result not on disk."""
        try:
            await asyncio.to_thread(self.c.sink.write_many, [done.record for done in batch])
        except Exception as e:
            for done in batch:  # the disk's trouble: each task is given back (or a bug raises)
                await self.c.settle_error(done.inflight.lease, e)
            return
        results = [result(done) for done in batch]
        try:
            outcomes = await self.c.retry(lambda: self.c.q.ack(results))
        except ShuttingDown as e:
            logger.warning("stopped_without_redis", error=str(e), unacked=len(batch),
                           consequence="held leases expire and return to the queue")
            return
        accepted = 0
        for done, outcome in zip(batch, outcomes, strict=True):
            if outcome == ACCEPTED:
                accepted += 1
            else:
                self.log_refusal(outcome, done)
        if accepted:  # counted per batch: a log call per task was 1 % of a busy consumer
            self.c.acked += accepted
            self.c.pause.recovered()
            logger.debug("tasks_acked", count=accepted)

    def log_refusal(self, outcome: int, done: Finished) -> None:
        """A result that was not accepted: a redo covers it, new parameters, a lost lease."""
        lease = done.inflight.lease
        if outcome == SET_ASIDE:
            logger.info("result_set_aside", index=lease.index, version=lease.version,
                        reason="a redo issued since covers it; kept until a new one is accepted")
        elif outcome == SUPERSEDED:
            logger.info("result_superseded", index=lease.index, version=lease.version,
                        reason="parameters changed; the task runs again under the new ones")
        else:
            logger.warning("ack_refused", index=lease.index,
                           reason="lease lost; another attempt owns the task")


def result(done: Finished) -> Result:
    lease, completion = done.inflight.lease, done.completion
    return Result(job_id=lease.job_id, index=lease.index, exec_id=lease.exec_id,
                  completion_tokens=completion.completion_tokens,
                  prompt_tokens=completion.prompt_tokens,
                  finish_reason=completion.finish_reason, version=lease.version,
                  attempt=lease.attempt)
