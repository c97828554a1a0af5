"""Answers written and acknowledged beside the slots in batches (one fdatasync'd write, one ack),
so a slow disk never keeps a server slot empty. A batch lingers to share its ack: at a parameter
change that aborts old work, answers that finished up to LINGER_S before it run again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from genq.common.queue.scripts import Call, Result
from genq.common.sglang.stream import Completion
from genq.consumer.backoff import ShuttingDown
from genq.consumer.leases import ACCEPTED, SET_ASIDE, SUPERSEDED, Inflight

logger = structlog.get_logger("consumer")

LINGER_S = 0.05
MAX_BATCH = 128  # keeps one ack.lua call short (a 128-result ack runs in about a millisecond)


@dataclass
class Finished:
    inflight: Inflight
    record: dict[str, Any]
    completion: Completion

    def result(self) -> Result:
        lease, c = self.inflight.lease, self.completion
        return Result(job_id=lease.job_id, index=lease.index, exec_id=lease.exec_id,
                      completion_tokens=c.completion_tokens, prompt_tokens=c.prompt_tokens,
                      finish_reason=c.finish_reason, version=lease.version, attempt=lease.attempt,
                      created_at=self.record["created_at"],
                      continued=(c.continued_from or {}).get("tokens", 0),
                      cached=c.cached_tokens or 0)

    def named(self) -> dict[str, Any]:
        """The task as its record names it to a user: row ``index`` (and ``sample``)."""
        return {key: self.record[key] for key in ("index", "sample") if key in self.record}


class Committer:
    """write(records) makes them durable; ack(results) acknowledges them (retried through
    outages), after record(calls) ran the batch's `Inflight.then` calls (a conversation's last
    turn: written, then recorded); on_error(task, error) settles a task whose write failed;
    on_done(tasks, accepted) is told of each settled batch; slots() and busy(): how many, and
    whether any is running."""

    def __init__(self, write: Callable[[list[dict[str, Any]]], None],
                 ack: Callable[[list[Result]], Awaitable[list[int]]], *,
                 record: Callable[[list[Call]], Awaitable[list[int]]] | None = None,
                 on_error: Callable[[Inflight, Exception], Awaitable[None]],
                 on_done: Callable[[list[Inflight], int], None],
                 slots: Callable[[], int], busy: Callable[[], bool]) -> None:
        self.write, self.ack, self.on_error, self.on_done = write, ack, on_error, on_done
        self.record = record  # runs the conversations' last turns' turn.lua calls
        self.slots, self.busy = slots, busy
        self.pending: list[Finished] = []
        self.room = asyncio.Event()  # cleared while a capacity of answers waits (a slow disk)
        self.room.set()
        self.hurry = asyncio.Event()  # commit the next batch without lingering
        self.arrived = asyncio.Event()  # an answer came
        self.closed = False
        self.last = 0.0  # when the last batch began (time.monotonic)

    def add(self, inflight: Inflight, record: dict[str, Any], completion: Completion) -> None:
        self.pending.append(Finished(inflight, record, completion))
        self.arrived.set()
        if len(self.pending) >= max(1, self.slots() // 2) or not self.busy():
            self.hurry.set()
        if len(self.pending) >= self.slots():
            self.room.clear()

    def close(self) -> None:
        self.closed = True
        self.hurry.set()
        self.arrived.set()

    async def run(self) -> None:
        while not (self.closed and not self.pending):
            if not self.pending:
                self.arrived.clear()
                await self.arrived.wait()
                continue
            await asyncio.sleep(0)  # the answers that came in this turn of the loop join
            await self.linger()
            self.hurry.clear()
            self.last = time.monotonic()
            batch, self.pending = self.pending[:MAX_BATCH], self.pending[MAX_BATCH:]
            accepted = 0
            try:
                accepted = await self.commit(batch)
            finally:
                if len(self.pending) < self.slots():
                    self.room.set()
                self.on_done([done.inflight for done in batch], accepted)

    async def linger(self) -> None:
        """Wait for more answers to share this batch's write and ack: until LINGER_S after the
        previous batch began, half the slots' answers, the last request's answer, or a stop."""
        wait = self.last + LINGER_S - time.monotonic()
        if wait <= 0 or self.hurry.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self.hurry.wait()

    async def commit(self, batch: list[Finished]) -> int:
        """Write, then ack (never an ack for a result not on disk); how many were accepted."""
        try:
            await asyncio.to_thread(self.write, [done.record for done in batch])
        except Exception as e:
            for done in batch:  # the disk's trouble: each task is given back (or a bug raises)
                await self.on_error(done.inflight, e)
            return 0
        try:
            calls = [done.inflight.then for done in batch if done.inflight.then is not None]
            if calls and self.record is not None:  # how each conversation ended (turn.lua)
                await self.record(calls)
            outcomes = await self.ack([done.result() for done in batch])
        except ShuttingDown as e:
            logger.warning("stopped_without_redis", error=str(e), unacked=len(batch),
                           consequence="held leases expire and return to the queue")
            return 0
        for done, outcome in zip(batch, outcomes, strict=True):
            lease = done.inflight.lease
            if outcome == SET_ASIDE:
                logger.info("result_set_aside", **done.named(), version=lease.version,
                            reason="a redo issued since covers it; kept until a new one is "
                                   "accepted")
            elif outcome == SUPERSEDED:
                logger.info("result_superseded", **done.named(), version=lease.version,
                            reason="parameters changed; the task runs again under the new ones")
            elif outcome != ACCEPTED:
                logger.warning("ack_refused", **done.named(),
                               reason="lease lost; another attempt owns the task")
        return outcomes.count(ACCEPTED)
