"""Tasks claimed ahead for the slots: one loop claims, in one Redis call, for every slot that
waits plus a few spare (a quarter of the slots, at most MAX_AHEAD), so that a slot whose answer
just came starts its next request without a claim's round trip. Spare tasks are held like
running ones (renewed, abortable) and given back at a stop. While the queue is empty only this
loop asks Redis, at a slowing pace: idle slots cost nothing."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Awaitable, Callable

from consumer.backoff import ShuttingDown, redis_retry
from consumer.leases import Inflight

MAX_AHEAD = 16
MAX_CLAIM = 128  # the most one claim takes: keeps a Lua script's arguments and run time small
IDLE_MAX_S = 1.0  # an empty queue is asked again after --poll, doubling up to this


class Prefetch:
    def __init__(self, claim: Callable[[int], Awaitable[list[Inflight]]],
                 give_back: Callable[[Inflight, str], Awaitable[None]], *,
                 slots: Callable[[], int], poll: float, paused: Callable[[], bool],
                 stop: asyncio.Event, on_empty: Callable[[], Awaitable[None]]) -> None:
        self.claim, self.give_back_one = claim, give_back
        self.slots, self.poll, self.paused, self.stop = slots, poll, paused, stop
        self.on_empty = on_empty
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
        """Until wanted (a slot waits, a wake) or `seconds` pass."""
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
