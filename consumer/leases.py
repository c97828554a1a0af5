"""The consumer's side of the task queue: a claimed task (Lease, Inflight); claim, renew, ack,
release, fail and reap over the shared Lua scripts; and the claims ahead for the slots."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from genq.common.data.rows import Prompt
from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys
from genq.consumer.backoff import ShuttingDown, redis_retry

REFUSED, ACCEPTED, SUPERSEDED, SET_ASIDE = 0, 1, 2, 3  # what ack.lua answers
KEPT = 2  # what fail.lua answers besides 0/1: a redo's set-aside result stands instead


@dataclass(kw_only=True)
class Lease:
    job_id: str
    index: int
    exec_id: str
    attempt: int
    spent: int
    version: int
    tries: int = 0  # claims towards --max-claims, this one included
    gen: int = 0  # the run's generation it was claimed in (the records carry it)
    kept: bool = True  # a conversation's made turns may be kept (False: claim.lua saw none)

    def gave_up(self, max_attempts: int, max_claims: int) -> str | None:
        """What this claim is past (attempts, or claims: a server failing it every time is
        refunded each time), or None while it may run."""
        if self.spent > max_attempts:
            return f"{max_attempts} attempts"
        return f"{max_claims} claims" if self.tries > max_claims else None


@dataclass(eq=False)
class Inflight:
    """A claimed task, held (its lease renewed, abortable) from its claim to its ack."""

    lease: Lease
    request: asyncio.Task | None = None  # the request to the server, once sent
    abort: str = ""  # why it was aborted, once it was
    prompt: Prompt | Exception | None = None  # its data set row, read with its claim
    started: float = field(default_factory=time.monotonic)
    # A conversation's last turn: its turn.lua call, run once it is written, before its ack.
    then: scripts.Call | None = None

    def sent(self, request: asyncio.Task) -> None:
        """SGLang.chat's on_request: an abort that came before the request existed ends it."""
        self.request = request
        if self.abort:
            request.cancel()

    def cancel(self, reason: str) -> None:
        """Abort the task's request; one not sent yet is never sent (its slot checks `abort`
        before sending, and `sent` cancels it), nor is the retry of one that did not fit."""
        request = self.request
        if request is not None and not request.done():
            self.abort = reason
            request.cancel()
        else:
            self.abort = self.abort or reason

    @property
    def at_server(self) -> bool:
        """Sent and not answered yet: it holds a place at the server."""
        return self.request is not None and not self.request.done()


class TaskQueue:
    def __init__(self, client: aioredis.Redis, keys: RunKeys, *, server: str, worker: str,
                 visibility_timeout: float, life: Callable[[], tuple[str, int]],
                 conversations: bool = True) -> None:
        self.r, self.k, self.server, self.worker = client, keys, server, worker
        self.conversations = conversations  # a --turns all run's (ack.lua's A.conv)
        self.life = life  # the run's (epoch, generation) as this consumer knows it
        self.stale = False  # a claim found the run in Redis another: look at it again
        self.vt, self.run_script = visibility_timeout, scripts.ScriptRunner(client)

    async def preload(self) -> None:
        """Load every script once, so the first calls of many slots do not each reload it."""
        for source in scripts.SOURCES.values():
            await self.r.script_load(source)

    async def claim(self, n: int = 1) -> list[Lease]:
        gen = self.life()[1]
        call = scripts.claim_call(self.k, n, self.vt, self.server, self.worker,
                                  secrets.token_hex(6), self.life_token(), self.conversations)
        version, *rows = await self.run_script(call)
        self.stale = version == 0
        return [Lease(job_id=jid.decode(), index=int(idx), exec_id=ex.decode(),
                      attempt=int(att), spent=int(spent), version=int(version), gen=gen,
                      tries=int(tries), kept=bool(kept))
                for jid, idx, ex, att, spent, tries, kept in rows]

    def life_token(self) -> str:
        """The run's life as the scripts check it, "epoch|generation"; "" (not checked) for a
        run with no epoch."""
        epoch, gen = self.life()
        return f"{epoch}|{gen}" if epoch else ""

    async def renew(self, leases: list[Lease]) -> set[str]:
        """Extend these leases; returns the job ids that are no longer ours."""
        if not leases:
            return set()
        held = [(lease.job_id, lease.exec_id) for lease in leases]
        lost = await self.run_script(scripts.renew_call(self.k, self.vt, held))
        return {jid.decode() for jid in lost}

    async def ack(self, results: list[scripts.Result]) -> list[int]:
        """Per result: ACCEPTED, REFUSED (the lease was lost), SUPERSEDED (new parameters) or
        SET_ASIDE (a redo issued since covers it: kept as the previous result); both requeued."""
        return [int(code) for code in
                await self.run_script(scripts.ack_many_call(self.k, self.server, results,
                                                            self.life_token(),
                                                            self.conversations))]

    async def release(self, lease: Lease, *, refund: bool, reason: str = "",
                      unclaim: bool = False) -> bool:
        return bool(await self.run_script(scripts.release_call(
            self.k, lease.job_id, lease.index, lease.exec_id, refund=refund, reason=reason,
            unclaim=unclaim)))

    async def fail(self, lease: Lease, reason: str) -> int:
        """1 failed, 0 the lease was lost, KEPT the previous result stands instead."""
        return int(await self.run_script(scripts.fail_call(
            self.k, lease.job_id, lease.index, lease.exec_id, reason=reason, worker=self.worker)))

    async def reap(self) -> int:
        return len(await self.run_script(scripts.reap_call(self.k)))

    async def last_error(self, index: int) -> str:
        raw = await self.r.hget(self.k.errors, str(index))
        return raw.decode() if isinstance(raw, bytes) else raw or ""


MAX_AHEAD = 16
MAX_CLAIM = 128  # the most one claim takes: keeps a Lua script's arguments and run time small
IDLE_MAX_S = 1.0  # an empty queue is asked again after --poll, doubling up to this


class Prefetch:
    """Tasks claimed ahead in one call for every waiting slot plus a few spare (held, given back
    at a stop), so that a slot starts its next request without a claim's round trip."""

    def __init__(self, claim: Callable[[int], Awaitable[list[Inflight]]],
                 give_back: Callable[[Inflight, str], Awaitable[None]], *,
                 slots: Callable[[], int], poll: float, paused: Callable[[], bool],
                 stop: asyncio.Event, on_empty: Callable[[], Awaitable[None]]) -> None:
        self.claim, self.give_back_one, self.on_empty = claim, give_back, on_empty
        self.slots, self.poll, self.paused, self.stop = slots, poll, paused, stop
        self.ready: collections.deque[Inflight] = collections.deque()
        self.waiting: collections.deque[asyncio.Future[Inflight | None]] = collections.deque()
        self.wanted = asyncio.Event()  # a slot waits, the spare ones ran low, or a wake

    @property
    def ahead(self) -> int:
        return min(MAX_AHEAD, max(1, self.slots() // 4))

    async def get(self) -> Inflight | None:
        """The next task for a slot, waiting while there is none; None once stopping."""
        if self.stop.is_set():
            return None
        if self.ready:
            if len(self.ready) <= self.ahead // 2:
                self.wanted.set()
            return self.ready.popleft()
        future: asyncio.Future[Inflight | None] = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.wanted.set()
        try:
            return await future
        finally:
            if not future.done():  # the slot was cancelled while waiting
                self.waiting.remove(future)

    async def run(self) -> None:
        idle = self.poll
        try:
            while not self.stop.is_set():
                need = len(self.waiting) + self.ahead - len(self.ready)
                if need <= 0 or self.paused():
                    await self.nap(0.5 if self.paused() else None)
                    continue
                try:
                    got = await redis_retry(functools.partial(self.claim, min(need, MAX_CLAIM)),
                                            self.stop.is_set)
                except ShuttingDown:
                    break
                for inflight in got:
                    self.hand(inflight)
                if got:
                    idle = self.poll
                    continue
                await self.on_empty()
                await self.nap(idle)
                idle = min(idle * 2, max(IDLE_MAX_S, self.poll))
        finally:
            while self.waiting:
                future = self.waiting.popleft()
                if not future.done():
                    future.set_result(None)

    def hand(self, inflight: Inflight) -> None:
        """To the slot that has waited longest, or else to the spare ones."""
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_result(inflight)
                return
        self.ready.append(inflight)

    async def nap(self, seconds: float | None) -> None:
        if self.stop.is_set():
            return  # stopped meanwhile (on_empty may have halted the consumer)
        self.wanted.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.wanted.wait()

    def wake(self) -> None:
        """Look again now: at a stop the loop ends and waiting slots get None; after the last
        held task is done, a burst run may have settled."""
        self.wanted.set()

    async def give_back(self) -> None:
        """At a stop: the spare tasks return to the queue now, not when their leases expire."""
        while self.ready:
            await self.give_back_one(self.ready.popleft(), "stopping before it started")
