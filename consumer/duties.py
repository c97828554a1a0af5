"""A consumer's housekeeping duties, each its own loop beside the slots: renewing task leases,
the heartbeat, the queue's upkeep, the parameter watch, the run check and following the
server. No duty waits on another, so a slow server (its load read can take seconds) never
delays a heartbeat or a lease renewal. Redis trouble is ridden out inside each loop and
logged once per process when it starts, at a slowing pace while it lasts, and once when it
ends (common/log.py Outage); anything else is a bug: the duty's crash is logged with its
traceback and the consumer stops, giving its work back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from common.errors import REDIS_TROUBLE
from common.log import REDIS_OUTAGE

logger = structlog.get_logger("consumer")


@dataclass(frozen=True)
class Duty:
    name: str
    body: Callable[[], Awaitable[None]]
    period: Callable[[], float]  # seconds from the end of one run to the start of the next
    redis: bool = True  # each run talks to Redis: a run that works ends an outage


async def run(duty: Duty, on_crash: Callable[[str], None]) -> None:
    """Run the duty every period, forever (it is cancelled when the consumer ends)."""
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
