"""The consumer follows its server: a capacity or context length that changes while genq runs
(the server restarted with other flags) is picked up within seconds."""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

import structlog

from common.advice import HISTORY_SAMPLES, load_sample
from common.errors import ServerUnavailable
from consumer import presence

if TYPE_CHECKING:
    from consumer.worker import Consumer

logger = structlog.get_logger("consumer")


def new_history() -> collections.deque[list[Any]]:
    """The server's recent loads, sent with each heartbeat for the monitor's chart and advice."""
    return collections.deque(maxlen=HISTORY_SAMPLES)


def resize(self: Consumer) -> None:
    """One slot per request the server runs at once. Slots above a lowered capacity end after
    their current task (Consumer.claim_and_process checks); a raised one gets new slots here."""
    if self.tg is None or self.stop.is_set():
        return
    for n in range(self.capacity):
        if n not in self.slots:
            self.slots[n] = self.tg.create_task(slot(self, n))


async def slot(self: Consumer, n: int) -> None:
    try:
        await self.slot(n)
    finally:
        self.slots.pop(n, None)


async def follow_server(self: Consumer) -> None:
    """Pick up a capacity or context length that changed (server restarted with other
    flags), and record them where `genq requeue` checks max_tokens."""
    self.load = await self.server.load()
    if self.load:
        self.load_history.append(load_sample(time.time(), self.load))
    try:
        capacity = (self.load or {}).get("max_running_requests")
        if not capacity and not self.s.concurrency:  # a server without /v1/loads
            capacity = await self.server.capacity()
        context = await self.server.context_length()
    except ServerUnavailable:
        return  # a restarting server: its slots are paused anyway; try again later
    if capacity and not self.s.concurrency and capacity != self.capacity:
        logger.info("server_capacity_changed", old=self.capacity, new=capacity)
        self.capacity = capacity
        resize(self)
    if context != self.context_length or not self.server_recorded:
        if context != self.context_length:
            logger.info("server_context_changed", old=self.context_length, new=context)
        self.context_length = context
        await presence.record_server(self.r, self.k, self.s.server, context, self.capacity)
        self.server_recorded = True
