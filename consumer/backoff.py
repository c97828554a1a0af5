"""How a consumer rides through trouble: pausing new requests while the server or disk is in
trouble, retrying Redis, and a loop per housekeeping duty so that none waits on another."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from genq.common.cli import RETRY_FIRST_S, RETRY_MAX_S
from genq.common.errors import REDIS_TROUBLE, ServerStalled, ServerUnavailable, mask_secrets
from genq.common.log import REDIS_OUTAGE

logger = structlog.get_logger("consumer")
T = TypeVar("T")

FIRST_PAUSE_S = 0.1  # a 503 now and then costs the refused request a moment, not a second
RETRIES_IN_SLOT = 3  # refusals in a row retried by their slot; more pause every new request
MAX_BACKOFF_S = 10.0  # the longest pause: a server that comes back is used again within this
# A server's Retry-After is obeyed up to this (--max-retry-after): a load balancer asking a day
# (86400) must not stop a consumer for a day once its backend is back.
MAX_RETRY_AFTER_S = 60.0
LOGGED_PAUSE_S = 0.5  # pauses this long are logged each; shorter ones, summed every minute
REFUSALS_EVERY_S = 60.0


class ClaimPause:
    """Jittered pause of new requests: as long as the server asks (Retry-After, at most
    max_retry_after), or doubled per failure in a row; failures during a pause do not
    lengthen it."""

    def __init__(self, max_retry_after: float = MAX_RETRY_AFTER_S) -> None:
        self.max_retry_after = max_retry_after
        self.until = 0.0
        self.failures = 0  # in a row, since the last success
        self.said = False  # a pause was logged: its end is logged too
        self.refused, self.refused_said = 0, -REFUSALS_EVERY_S  # short pauses, summed

    def remaining(self) -> float:
        return max(0.0, self.until - time.monotonic())

    def in_slot(self, e: Exception) -> float | None:
        """The moment a refused request waits before its slot resends it, as a plain client
        would; None (give the task back) unless a lone server refusal asking at most a second."""
        if not isinstance(e, ServerUnavailable) or isinstance(e, ServerStalled):
            return None
        wait = e.retry_after
        if self.failures >= RETRIES_IN_SLOT or self.remaining() or (wait or 0) > 1.0:
            return None
        self.failures += 1
        self.count(mask_secrets(str(e)), time.monotonic())
        return wait if wait is not None else FIRST_PAUSE_S * (1 + 2 * random.random())

    def trouble(self, error: str, retry_after: float | None = None) -> None:
        now = time.monotonic()
        if self.until > now:
            return
        self.failures += 1
        backoff = min(FIRST_PAUSE_S * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        pause = (min(retry_after, self.max_retry_after) if retry_after is not None
                 else backoff * (0.5 + random.random()))
        self.until = now + pause
        if pause >= LOGGED_PAUSE_S:
            logger.warning("claiming_paused", error=error, pause_s=round(pause, 2),
                           failures_in_a_row=self.failures)
            self.said = True
            return
        self.count(error, now)

    def count(self, error: str, now: float) -> None:
        # A refusal between successes is the ordinary cost of a busy server: said at most once
        # a minute, with how many there were since.
        self.refused += 1
        if now - self.refused_said >= REFUSALS_EVERY_S:
            logger.info("requests_refused", count=self.refused, error=error,
                        every_s=REFUSALS_EVERY_S)
            self.refused, self.refused_said = 0, now

    def recovered(self) -> None:
        self.failures = 0
        if self.said:
            logger.info("claiming_resumed")
            self.said = False


class ShuttingDown(Exception):
    """Redis stayed away while stopping: stop waiting; what is held comes back as leases expire."""


async def redis_retry(op: Callable[[], Awaitable[T]],
                      give_up: Callable[[], bool] = lambda: False) -> T:
    """Retry a Redis operation through outages; ShuttingDown once `give_up()` says to stop."""
    delay = RETRY_FIRST_S
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
            delay = min(delay * 2, RETRY_MAX_S)


@dataclass(frozen=True)
class Duty:
    name: str
    body: Callable[[], Awaitable[None]]
    period: Callable[[], float]  # seconds from the end of one run to the start of the next
    redis: bool = True  # each run talks to Redis: a run that works ends an outage


async def run_duty(duty: Duty, on_crash: Callable[[str], None]) -> None:
    """Run the duty every period until cancelled, riding out Redis trouble; anything else is a
    bug: logged, and the consumer stops."""
    while True:
        try:
            await duty.body()
            if duty.redis:
                REDIS_OUTAGE.over()
        except REDIS_TROUBLE as e:
            REDIS_OUTAGE.seen(e, duty=duty.name)
        except Exception:
            logger.exception("background_task_crashed", task=duty.name,
                             consequence="the consumer stops and gives its tasks back")
            on_crash(duty.name)
            return
        await asyncio.sleep(duty.period())
