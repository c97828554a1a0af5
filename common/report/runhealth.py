"""What status and the monitor say about the run's state itself: that Redis lost it (and the
command that rebuilds it), and that Redis keeps it without persistence (so a restart would)."""

from __future__ import annotations

import redis

from common.queue import heartbeats
from common.queue.keys import RunKeys

NO_PERSISTENCE = "redis_no_persistence"


def recover_command(run: str, dirs: list[str]) -> str:
    shards = " ".join(dirs) if dirs else "DIR…"
    return f"genq recover --shards {shards}" + ("" if run == "default" else f" --run {run}")


def persistence_alert(r: redis.Redis, k: RunKeys, out_dirs: list[str]) -> dict | None:
    """An alert while Redis has no append-only file: a restart forgets the run's state. None
    when it has one, or when CONFIG is not allowed (managed Redis keeps its own)."""
    try:
        appendonly = r.config_get("appendonly").get("appendonly")
    except redis.ResponseError:
        return None
    if appendonly in (None, "yes"):
        return None
    return {
        "kind": NO_PERSISTENCE,
        "message": ("Redis runs without persistence (appendonly no): a restart forgets the "
                    "run's state. Nothing is lost (the results are in the shards), but the "
                    f"run must then be rebuilt with `{recover_command(k.run, out_dirs)}`; turn "
                    "the append-only file on (also in redis.conf)"),
        "command": "redis-cli CONFIG SET appendonly yes",
        "recover_command": recover_command(k.run, out_dirs),
    }


def missing_run_message(r: redis.Redis, k: RunKeys) -> str:
    """Why the run is not in Redis, as far as Redis can still tell, and what to run."""
    waiting = [b for b in heartbeats.read(r, k).values()
               if b.get("run_state") in ("lost", "replaced")]
    if not waiting:
        return (f"unknown run {k.run!r}: no genq:{k.run}:meta in Redis (start it with "
                "`genq produce DATASET`, or pick --run/GENQ_RUN; if Redis lost it, rebuild it "
                "with `genq recover --shards DIR…`)")
    dirs = sorted({b["out"] for b in waiting if b.get("out")})
    return (f"run {k.run!r} lost its state in Redis (restarted without persistence, or "
            f"flushed); {len(waiting)} consumer(s) wait for it, writing nothing. Rebuild it "
            f"from the output: {recover_command(k.run, dirs)}")
