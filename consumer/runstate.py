"""Is the run this consumer started on still in Redis? Redis restarted without persistence (or
flushed) forgets the run; a producer started afterwards registers a new run under the same
name. Either way the consumer's cached parameters, data set and size no longer describe what
Redis holds, so it must not claim, queue or write anything until the run is back.

The run's identity is its epoch (common/run.py): a fresh token at every registration, restored
as it was by `genq recover`. ``RunState`` checks it every housekeeping tick and keeps the run
manifest beside the consumer's shards current.
"""

from __future__ import annotations

import asyncio
import os

import redis
import redis.asyncio as aioredis
import structlog

from common.data import manifest as manifests
from common.errors import GenqError
from common.queue.keys import RunKeys
from common.queue.run import OK, REPLACED, judge
from common.report import runhealth

logger = structlog.get_logger("consumer")


def recover_command(run: str, out_dirs: list[str]) -> str:
    return runhealth.recover_command(run, [os.path.abspath(d) for d in out_dirs])


def check_outdir(sync: redis.Redis, k: RunKeys, out_dir: str, epoch: str) -> None:
    """Refuse to write a new run's shards beside an earlier run's of the same name: its manifest
    would be overwritten and its results mixed into this run's export."""
    found = manifests.find(out_dir, k.run)
    if found is None or found["epoch"] == epoch:
        return
    raise GenqError(
        f"{out_dir} holds the output of an earlier run {k.run!r} (epoch {found['epoch']}, "
        f"parameters v{found['params_version']}) that Redis no longer has; recover it with "
        f"`{recover_command(k.run, [out_dir])}`, or give this run another --out"
    )


class RunState:
    """The consumer's view of its run: ok, lost (Redis forgot it) or replaced (re-created)."""

    def __init__(self, keys: RunKeys, epoch: str, out_dir: str) -> None:
        self.keys, self.epoch, self.out_dir = keys, epoch, out_dir
        self.state = OK
        self.failure = ""  # set when the consumer must stop: the run was replaced

    @property
    def paused(self) -> bool:
        return self.state != OK

    async def check(self, r: aioredis.Redis) -> str:
        """Read the run's epoch; log each change of state once, with what fixes it."""
        raw = await r.hget(self.keys.meta, "epoch")
        epoch = raw.decode() if isinstance(raw, bytes) else raw
        now = judge(epoch, self.epoch)
        if now != self.state:
            self._changed(now, epoch)
        self.state = now
        return now

    def _changed(self, now: str, epoch: str | None) -> None:
        fix = recover_command(self.keys.run, [self.out_dir])
        reason = runhealth.report_change(
            logger, now, run=self.keys.run, mine=self.epoch, current=epoch, service="consumer",
            duty="claiming and writing", command=fix,
            then=(f"its output in {self.out_dir} is of the earlier run: `{fix} --replace` "
                  "brings that one back, or restart this consumer with another --out for the "
                  "new one"))
        if now == REPLACED:
            self.failure = reason

    async def keep_manifest(self, sync: redis.Redis) -> None:
        """Rewrite the manifest beside the shards if the run or its parameters changed."""
        if self.state != OK:
            return
        if await asyncio.to_thread(manifests.upkeep, sync, self.keys, [self.out_dir],
                                   self.epoch):
            logger.debug("manifest_written", path=str(manifests.path(self.out_dir,
                                                                     self.keys.run)))
