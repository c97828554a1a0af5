"""What a producer leaves on its machine when it registers a run: a small file named by the Redis
and the run, that outlives a Redis restart. On a Redis just started without the run, it is the
evidence that this run was there before and may have been lost; without it, the Redis is a
fresh deployment's and the run registers at once."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import structlog

logger = structlog.get_logger("producer")


def marks_dir() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "genq"


def path(redis_url: str, run: str) -> Path:
    # Hashed: a URL may hold a password, which has no business on disk.
    name = hashlib.sha256(f"{redis_url}\n{run}".encode()).hexdigest()[:24]
    return marks_dir() / "runs" / name


def seen(redis_url: str, run: str) -> bool:
    """Whether a producer on this machine registered `run` on this Redis before."""
    return path(redis_url, run).exists()


def leave(redis_url: str, run: str, epoch: str) -> None:
    """Mark `run` registered on this Redis; a machine that cannot keep it only loses the mark
    (a producer started here again on a restarted Redis then needs the consumers' word)."""
    target = path(redis_url, run)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"run": run, "epoch": epoch, "at": time.time()}) + "\n")
    except OSError as e:
        logger.warning("run_mark_not_kept", run=run, path=str(target), error=str(e),
                       consequence="a producer started here again on this Redis, restarted "
                                   "empty, waits only for consumers that have already said "
                                   "they follow a lost run")
