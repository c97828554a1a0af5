"""Admission to the decode batch, as SGLang does it: at most `limit` requests run at once and
the KV-cache pool (`--max-total-tokens`) must hold every running request's tokens.

A request reserves its prompt plus the tokens it will generate when it is admitted; the
simulator knows that length up front, so the pool can never overflow and no request is ever
retracted (real SGLang estimates and retracts; the effect on admission is the same). What
`/v1/loads` reports as `num_used_tokens` is the tokens actually written so far (the engine
computes it), which is what a person reads as KV usage.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    """FIFO admission limited by a slot count and a token pool; waiters never overtake."""

    def __init__(self, limit: int, pool_tokens: int | None = None) -> None:
        self.limit = limit
        self.pool_tokens = pool_tokens
        self.running = 0
        self.reserved = 0
        self.max_running_seen = 0
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, cost: int) -> bool:
        if self.running >= self.limit:
            return False
        # A request larger than the whole pool runs alone rather than waiting forever.
        pool = self.pool_tokens
        return pool is None or self.reserved + cost <= pool or self.running == 0

    def _admit(self, cost: int) -> None:
        self.running += 1
        self.reserved += cost
        self.max_running_seen = max(self.max_running_seen, self.running)

    async def acquire(self, cost: int = 0) -> None:
        if not self._waiters and self._fits(cost):
            self._admit(cost)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (fut, cost)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # Admitted just as the client left: give the slot and the tokens back.
                self.release(cost)
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()  # a large head leaving may let smaller ones in
            raise

    def release(self, cost: int = 0) -> None:
        self.running -= 1
        self.reserved -= cost
        self._wake()

    def _wake(self) -> None:
        # Admit from the head in order, as long as each fits; the head blocks the rest (FIFO).
        while self._waiters:
            fut, cost = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(cost):
                return
            self._waiters.popleft()
            self._admit(cost)
            fut.set_result(None)
