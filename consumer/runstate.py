"""The run's state as one consumer follows it, by the epoch it started with: ok, lost (Redis
forgot it) or replaced (a new run of its name); and the manifest kept beside its shards."""

from __future__ import annotations

import asyncio
import os

import redis
import redis.asyncio as aioredis
import structlog

from genq.common.data import manifest as manifests
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import OK, REPLACED, judge
from genq.common.report import runhealth

logger = structlog.get_logger("consumer")


class RunState:
    """The run by its epoch: ok, lost (Redis restarted empty) or replaced (a new run of its name).
    Until it is back nothing is claimed, queued or written: the cached run describes neither."""

    def __init__(self, keys: RunKeys, epoch: str, out_dir: str, gen: int = 0) -> None:
        self.keys, self.epoch, self.out_dir, self.gen = keys, epoch, out_dir, gen
        self.state = OK
        self.recovered = False  # rebuilt by `genq recover` while this consumer did not look
        self.failure = ""  # set when the consumer must stop: the run was replaced
        # The run's output directories as the manifest here lists them when it was last lost or
        # replaced (None: no manifest); the heartbeat carries them, for a whole recover command.
        self.out_dirs: list[str] | None = None

    async def check(self, r: aioredis.Redis) -> str:
        """Read the run's epoch; log each change of state once, with what fixes it."""
        raw, gen = await r.hmget(self.keys.meta, ["epoch", "gen"])
        epoch = raw.decode() if isinstance(raw, bytes) else raw
        now = judge(epoch, self.epoch)
        if now == OK and int(gen or 0) != self.gen:
            if self.state == OK:  # lost and recovered while this consumer slept (a pause, a
                # partition): its claims are of the run before, and every ack of them refused
                logger.warning("run_recovered_unseen", generation=int(gen or 0),
                               consequence="the tasks held are given up; claiming goes on")
                self.recovered = True
            self.gen = int(gen or 0)
        if now != self.state:
            self.out_dirs = (manifests.find(self.out_dir, self.keys.run) or {}).get("out_dirs")
            here = os.path.abspath(self.out_dir)
            fix, _ = runhealth.lost_recover(self.keys.run, [{"out": here,
                                                             "out_dirs": self.out_dirs}])
            reason = runhealth.report_change(
                logger, now, run=self.keys.run, mine=self.epoch, current=epoch,
                service="consumer", duty="claiming and writing", command=fix,
                then=(f"its output in {self.out_dir} is of the earlier run: `"
                      f"{fix or runhealth.recover_command(self.keys.run, [here])} --replace` "
                      "brings that one back, or restart this consumer: it writes the new one "
                      f"beside it, in {self.out_dir}/{self.keys.run}-EPOCH"))
            if now == REPLACED:
                self.failure = reason
        self.state = now
        return now

    async def keep_manifest(self, sync: redis.Redis) -> None:
        """Rewrite the manifest beside the shards if the run or its parameters changed."""
        if self.state != OK:
            return
        if await asyncio.to_thread(manifests.upkeep, sync, self.keys, [self.out_dir], self.epoch):
            logger.debug("manifest_written", path=str(manifests.path(self.out_dir, self.keys.run)))
