"""The consumer's side of the task queue: a claimed task (Lease, Inflight) and claim, renew,
ack, release, fail and reap over the shared Lua scripts, on one redis.asyncio client."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from common.data.rows import Prompt
from common.queue import scripts
from common.queue.keys import RunKeys

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


@dataclass(eq=False)
class Inflight:
    """A claimed task, held (its lease renewed, abortable) from its claim to its ack."""

    lease: Lease
    request: asyncio.Task | None = None  # the request to the server, once sent
    abort: str = ""  # why it was aborted, once it was
    prompt: Prompt | Exception | None = None  # its data set row, read with its claim
    started: float = field(default_factory=time.monotonic)

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
                 visibility_timeout: float) -> None:
        self.r, self.k, self.server, self.worker = client, keys, server, worker
        self.vt, self.run_script = visibility_timeout, scripts.ScriptRunner(client)

    async def preload(self) -> None:
        """Load every script once, so the first calls of many slots do not each reload it."""
        for source in scripts.SOURCES.values():
            await self.r.script_load(source)

    async def claim(self, n: int = 1) -> list[Lease]:
        call = scripts.claim_call(self.k, n, self.vt, self.server, self.worker,
                                  secrets.token_hex(6))
        version, *rows = await self.run_script(call)
        return [Lease(job_id=jid.decode(), index=int(idx), exec_id=ex.decode(),
                      attempt=int(att), spent=int(spent), version=int(version))
                for jid, idx, ex, att, spent in rows]

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
                await self.run_script(scripts.ack_many_call(self.k, self.server, results))]

    async def release(self, lease: Lease, *, refund: bool, reason: str = "") -> bool:
        return bool(await self.run_script(scripts.release_call(
            self.k, lease.job_id, lease.index, lease.exec_id, refund=refund, reason=reason)))

    async def fail(self, lease: Lease, reason: str) -> int:
        """1 failed, 0 the lease was lost, KEPT the previous result stands instead."""
        return int(await self.run_script(scripts.fail_call(
            self.k, lease.job_id, lease.index, lease.exec_id, reason=reason, worker=self.worker)))

    async def reap(self) -> int:
        return len(await self.run_script(scripts.reap_call(self.k)))

    async def last_error(self, index: int) -> str:
        raw = await self.r.hget(self.k.errors, str(index))
        return raw.decode() if isinstance(raw, bytes) else raw or ""
