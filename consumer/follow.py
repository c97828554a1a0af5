"""The consumer follows its server: a capacity or context length that changes while genq runs
(the server restarted with other flags) is picked up within seconds, and the slot count
follows what the server reports in /v1/loads, so that another client sharing the server is
left its share: no waiting queue building up on the server, no slot idle while work remains.

Tracking: every load sample says how many requests the server holds (running + waiting);
those that are not ours are the other clients'. Our slots are what the server runs at once
less theirs. A waiting queue on the server lowers the count at once, by our part of it
(requests queued there would start late and their slots would idle meanwhile); anything else
needs two consecutive samples that agree, since requests finish between the load read and our
own count."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from common.errors import ServerUnavailable
from common.report.advice import HISTORY_SAMPLES, load_sample
from consumer import presence

if TYPE_CHECKING:
    from consumer.worker import Consumer

logger = structlog.get_logger("consumer")

# The load is read every second (for tracking) but kept for the monitor's chart and the
# capacity advice only this often, so HISTORY_SAMPLES spans minutes, not seconds.
HISTORY_PERIOD_S = 2.5


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


# --- tracking: pure functions ------------------------------------------------------------
def others(running: int, waiting: int, ours: int) -> int:
    """Requests the server holds (running or waiting) that are not ours: other clients'."""
    return max(0, running + waiting - ours)


def target_slots(running: int, waiting: int, max_running: int, ours: int) -> int:
    """The slots that fill what the server runs at once, less the other clients' share;
    always at least one (a server held by others still gets our work, in its turn)."""
    return min(max_running, max(1, max_running - others(running, waiting, ours)))


def withdrawn(current: int, running: int, waiting: int, max_running: int, ours: int) -> int:
    """The slot count a waiting queue asks for: the requests the server holds beyond its max,
    withdrawn in proportion to our part of what it holds, never below target_slots. Another
    genq on the same server does the same with its part, so two of them end up sharing the
    server instead of one giving it all to the other. While our requests above a lowered
    count are still at the server (they end after their current task), nothing more is
    withdrawn: the queue they are part of is already being answered."""
    held = running + waiting
    excess = held - max_running  # a queue while slots are free is the KV pool's, not ours
    if waiting <= 0 or excess <= 0 or ours > current:
        return current
    share = -(-excess * ours // held)  # rounded up
    return min(current, max(target_slots(running, waiting, max_running, ours), current - share))


def next_capacity(current: int, target: int, previous: int | None, lowered: int,
                  waiting: int) -> int:
    """The slot count after one sample. A waiting queue lowers it at once (to `lowered`, from
    withdrawn()); otherwise it moves only when this sample's target and the previous one's are
    on the same side of the current count, and only as far as the smaller move of the two:
    one sample taken as a request ended is noise, not a new client. Never raised while the
    server has a queue."""
    if lowered < current:
        return lowered
    if previous is None or waiting > 0:
        return current
    if target > current and previous > current:
        return min(target, previous)
    if target < current and previous < current:
        return max(target, previous)
    return current


# --- tracking: wiring --------------------------------------------------------------------
@dataclass
class Tracking:
    """What tracking keeps between samples (the consumer's `tracking`)."""

    server_max: int | None = None  # the server's max running requests, as last read
    previous: int | None = None  # the previous sample's target
    kept_at: float = 0.0  # when a sample was last kept in the load history


def unconfirmed(self: Consumer) -> bool:
    """The last sample asked for another slot count that a second sample must confirm: read
    the load again at the next housekeeping tick (0.5 s) rather than a second later."""
    previous = self.tracking.previous
    return previous is not None and previous != self.capacity


def requests_at_server(self: Consumer) -> int:
    """Our requests the server holds now: those sent and not answered. A task whose answer is
    being written or acked no longer holds a place at the server."""
    return sum(1 for i in self.held.values() if i.request is not None and not i.request.done())


def set_capacity(self: Consumer, capacity: int) -> None:
    self.capacity = capacity
    resize(self)


def follow_max(self: Consumer, t: Tracking, max_running: int) -> bool:
    """A server restarted with another --max-running-requests: its max becomes the slot count
    and tracking starts over from it. True when it changed."""
    if max_running == t.server_max:
        return False
    first = t.server_max is None
    t.server_max, t.previous = max_running, None
    if first and max_running == self.capacity:
        return False  # the capacity read at start
    logger.info("server_capacity_changed", old=self.capacity, new=max_running)
    set_capacity(self, max_running)
    return True


def track(self: Consumer, load: dict[str, Any]) -> None:
    """One load sample moves the slot count toward the server's max less the others' share."""
    max_running = load.get("max_running_requests")
    if not max_running:
        return  # /get_load of a server that does not say its max: follow_server reads it
    t = self.tracking
    if follow_max(self, t, int(max_running)):
        return
    running, waiting = int(load["num_reqs"]), int(load["num_waiting_reqs"])
    ours = requests_at_server(self)
    target = target_slots(running, waiting, int(max_running), ours)
    lowered = withdrawn(self.capacity, running, waiting, int(max_running), ours)
    new = next_capacity(self.capacity, target, t.previous, lowered, waiting)
    t.previous = target
    if new == self.capacity:
        return
    reason = ("others waiting" if new < self.capacity and waiting else
              "others running" if new < self.capacity else "others gone")
    logger.info("slots_changed", old=self.capacity, new=new, reason=reason,
                server_max=max_running, running=running, waiting=waiting, ours=ours,
                others=others(running, waiting, ours))
    set_capacity(self, new)


async def follow_load(self: Consumer) -> None:
    """Read the server's load (every second): kept for the heartbeat, and the slot count
    follows it unless --concurrency fixed it."""
    self.load = await self.server.load()
    if not self.load:
        return  # a restarting server (its slots are paused anyway) or no load endpoint
    t = self.tracking
    now = time.time()
    if now - t.kept_at >= HISTORY_PERIOD_S - 0.1:
        t.kept_at = now
        self.load_history.append(load_sample(now, self.load))
    if not self.s.concurrency:
        track(self, self.load)


async def follow_server(self: Consumer) -> None:
    """Pick up a context length that changed (server restarted with other flags), or the
    capacity of a server without a load endpoint, and record them where `genq requeue`
    checks max_tokens."""
    try:
        capacity = None
        if not (self.load or {}).get("max_running_requests") and not self.s.concurrency:
            # a server whose load does not say its max (or that has no load endpoint)
            capacity = await self.server.capacity()
        context = await self.server.context_length()
    except ServerUnavailable:
        return  # a restarting server: its slots are paused anyway; try again later
    if capacity and capacity != self.capacity:
        logger.info("server_capacity_changed", old=self.capacity, new=capacity)
        set_capacity(self, capacity)
    if context != self.context_length or not self.server_recorded:
        if context != self.context_length:
            logger.info("server_context_changed", old=self.context_length, new=context)
        self.context_length = context
        server_max = self.tracking.server_max or self.capacity
        await presence.record_server(self.r, self.k, self.s.server, context, server_max)
        self.server_recorded = True
