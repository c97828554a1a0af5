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


class Outage:
    """Log Redis trouble once when it starts, then at a slowing pace (the 2nd, 4th, 8th...
    failure in a row), and once when it ends: a days-long run's log does not drown in it."""

    def __init__(self, event: str) -> None:
        self.event, self.failures, self.started = event, 0, 0.0

    def seen(self, error: BaseException) -> None:
        self.failures += 1
        if self.failures == 1:
            self.started = time.monotonic()
        if self.failures & (self.failures - 1) == 0:  # a power of two
            logger.warning(self.event, error=str(error) or type(error).__name__,
                           failures=self.failures)

    def over(self) -> None:
        if self.failures:
            logger.info(self.event.replace("_unavailable", "_back"), failures=self.failures,
                        lasted_s=round(time.monotonic() - self.started, 1))
            self.failures = 0


class ShuttingDown(Exception):
    """Redis stayed unreachable while the consumer was stopping: stop waiting for it. Whatever
    the consumer still holds comes back through the lease's expiry."""


def _never() -> bool:
    return False


async def redis_retry(op: Callable[[], Awaitable[T]], give_up: Callable[[], bool] = _never) -> T:
    """Run a Redis operation, riding through outages (0.2 s to 5 s between tries), until it
    succeeds or `give_up()` says the consumer is stopping and must not wait any longer (a
    consumer told to stop during an outage must not wait for Redis forever)."""
    delay, outage = 0.2, Outage("redis_unavailable")
    while True:
        try:
            result = await op()
            outage.over()
            return result
        except REDIS_TROUBLE as e:
            if give_up():
                raise ShuttingDown(str(e)) from None
            outage.seen(e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
