"""The consumer follows its server: capacity and context changes within seconds, and slots of
what it runs less other clients' share (a queue lowers them at once)."""

from __future__ import annotations

import collections
import time
from typing import Any

import structlog

from genq.common.errors import ServerUnavailable
from genq.common.log import Outage
from genq.common.report.advice import HISTORY_SAMPLES, load_sample
from genq.common.sglang.client import SGLang

logger = structlog.get_logger("consumer")

HISTORY_PERIOD_S = 2.5  # load samples kept for the chart and advice: HISTORY_SAMPLES spans minutes


def others(running: int, waiting: int, ours: int) -> int:
    return max(0, running + waiting - ours)


def target_slots(running: int, waiting: int, max_running: int, ours: int) -> int:
    """The server's max less the other clients' share, at least one."""
    return min(max_running, max(1, max_running - others(running, waiting, ours)))


def withdrawn(current: int, running: int, waiting: int, max_running: int, ours: int) -> int:
    """The slot count a waiting queue asks for: the excess over the server's max withdrawn in
    proportion to our part, never below target_slots, and not again until ours drop."""
    held = running + waiting
    excess = held - max_running  # a queue while slots are free is the KV pool's, not ours
    if waiting <= 0 or excess <= 0 or ours > current:
        return current
    share = -(-excess * ours // held)  # rounded up
    return min(current, max(target_slots(running, waiting, max_running, ours), current - share))


def next_capacity(current: int, target: int, previous: int | None, lowered: int,
                  waiting: int) -> int:
    """The slot count after one sample: `lowered` at once; else moved as far as the smaller move
    of this and the previous target on the same side (one sample is noise), never raised during a
    queue."""
    if lowered < current:
        return lowered
    if previous is None or waiting > 0:
        return current
    if target > current and previous > current:
        return min(target, previous)
    if target < current and previous < current:
        return max(target, previous)
    return current


class Follower:
    """The server as last read, and the slot count it asks for (each tick: a new one, or None)."""

    def __init__(self, server: SGLang, *, capacity: int, context_length: int | None,
                 fixed: bool) -> None:
        self.server, self.fixed = server, fixed  # fixed: --concurrency set the slot count
        self.capacity, self.context_length = capacity, context_length
        self.load: dict[str, Any] | None = None
        self.history: collections.deque[list[Any]] = collections.deque(maxlen=HISTORY_SAMPLES)
        self.server_max: int | None = None  # the server's max running requests, as last read
        self.previous: int | None = None  # the previous sample's target
        self.kept_at = 0.0  # when a sample was last kept in the history
        self.info_outage = Outage("server_info")

    @property
    def unconfirmed(self) -> bool:
        """The last sample asked for another slot count that a second one must confirm."""
        return self.previous is not None and self.previous != self.capacity

    async def load_tick(self, ours: int) -> int | None:
        """Read the load, kept for the heartbeat; `ours`: our requests the server holds now."""
        self.load = await self.server.load()
        if not self.load:
            return None  # a restarting server (its slots are paused anyway) or no endpoint
        now = time.time()
        if now - self.kept_at >= HISTORY_PERIOD_S - 0.1:
            self.kept_at = now
            self.history.append(load_sample(now, self.load))
        if self.fixed or not self.load.get("max_running_requests"):
            return None
        new = self.track(self.load, ours)
        if new == self.capacity:
            return None
        self.capacity = new
        return new

    def track(self, load: dict[str, Any], ours: int) -> int:
        """One load sample moves the slot count toward the server's max less the others'."""
        max_running = int(load["max_running_requests"])
        if max_running != self.server_max:  # started, or restarted with another max
            first, self.server_max, self.previous = self.server_max is None, max_running, None
            if first and max_running == self.capacity:
                return self.capacity
            logger.info("server_capacity_changed", old=self.capacity, new=max_running)
            return max_running
        running, waiting = int(load["num_reqs"]), int(load["num_waiting_reqs"])
        target = target_slots(running, waiting, max_running, ours)
        lowered = withdrawn(self.capacity, running, waiting, max_running, ours)
        new = next_capacity(self.capacity, target, self.previous, lowered, waiting)
        self.previous = target
        if new != self.capacity:
            reason = ("others waiting" if new < self.capacity and waiting else
                      "others running" if new < self.capacity else "others gone")
            logger.info("slots_changed", old=self.capacity, new=new, reason=reason,
                        server_max=max_running, running=running, waiting=waiting, ours=ours,
                        others=others(running, waiting, ours))
        return new

    async def server_tick(self) -> bool:
        """Reread the context length; whether it changed."""
        try:
            context = await self.server.context_length()
        except ServerUnavailable as e:  # restarting, or behind a maintenance page: kept as read
            self.info_outage.seen(e)
            return False
        self.info_outage.over()
        if context == self.context_length:
            return False
        logger.info("server_context_changed", old=self.context_length, new=context)
        self.context_length = context
        return True
