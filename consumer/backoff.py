"""How a consumer rides through trouble: pausing claims while a server or the disk is in
trouble, and retrying Redis operations until Redis answers again."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from common.errors import REDIS_TROUBLE
from common.log import REDIS_OUTAGE

logger = structlog.get_logger("consumer")
T = TypeVar("T")

# Longest pause of claiming while trouble lasts: a dead server costs one round of claims and
# releases per pause, and a server that comes back is used again within this.
MAX_BACKOFF_S = 10.0


class ClaimPause:
    """Jittered exponential pause of claiming. Requests already in flight that fail during a
    pause do not lengthen it; only a failed try after it does."""

    def __init__(self) -> None:
        self.until = 0.0
        self.backoff = 1.0

    def remaining(self) -> float:
        return max(0.0, self.until - time.monotonic())

    def trouble(self, error: str) -> None:
        now = time.monotonic()
        if self.until > now:
            return
        pause = self.backoff * (0.5 + random.random())
        logger.warning("claiming_paused", error=error, pause_s=round(pause, 2))
        self.until = now + pause
        self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)

    def recovered(self) -> None:
        if self.backoff > 1.0:
            logger.info("claiming_resumed")
            self.backoff = 1.0


class ShuttingDown(Exception):
    """Redis stayed unreachable while the consumer was stopping: stop waiting for it. Whatever
    the consumer still holds comes back through the lease's expiry."""


def _never() -> bool:
    return False


async def redis_retry(op: Callable[[], Awaitable[T]], give_up: Callable[[], bool] = _never) -> T:
    """Run a Redis operation, riding through outages (0.2 s to 5 s between tries), until it
    succeeds or `give_up()` says the consumer is stopping and must not wait any longer (a
    consumer told to stop during an outage must not wait for Redis forever)."""
    delay = 0.2
    while True:
        try:
            result = await op()
            REDIS_OUTAGE.over()
            return result
        except REDIS_TROUBLE as e:
            if give_up():
                raise ShuttingDown(str(e)) from None
            REDIS_OUTAGE.seen(e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
