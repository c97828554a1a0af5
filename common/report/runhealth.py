"""What every service says about the run's state itself: lost by Redis (and the command that
rebuilds it), replaced by a run of its name, back, or kept without persistence."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import redis

from genq.common.errors import REDIS_TROUBLE
from genq.common.queue import heartbeats
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import LOST, REPLACED, SETTLE_S, unsettled_s

NO_PERSISTENCE = "redis_no_persistence"
LOST_CAUSE = "restarted without persistence, flushed or evicted"


def recover_command(run: str, dirs: list[str]) -> str:
    shards = " ".join(dirs) if dirs else "DIR…"
    return f"genq recover --shards {shards}" + ("" if run == "default" else f" --run {run}")


def lost_recover(run: str, waiting: list[dict[str, Any]]) -> tuple[str | None, str]:
    """For a run Redis lost, from the heartbeats of the consumers waiting for it: (the recover
    command, only when it is whole, each of them knowing from its manifest every output directory
    the run had; the sentence saying what to run, or what is missing)."""
    outs = {b["out"] for b in waiting if b.get("out")}
    listed = [b.get("out_dirs") for b in waiting]
    if waiting and None not in listed:
        every = {*outs, *(d for dirs in listed for d in dirs or ())}
        # One gone with its node cannot be given (recover refuses a missing directory): the
        # command names what exists, and --partial, since those results can only run again.
        gone = sorted(d for d in every - outs if not os.path.isdir(d))
        command = recover_command(run, sorted(every - {*gone})) + (" --partial" if gone else "")
        lost = f" ({', '.join(gone)} no longer there: their results run again)" if gone else ""
        return command, f"rebuild it from the output{lost}: {command}"
    known = f" (known here: {' '.join(sorted(outs))})" if outs else ""
    return None, ("rebuild it with `genq recover --shards` followed by every consumer's output "
                  f"directory (their --out){known}")


def persistence_alert(r: redis.Redis, k: RunKeys, out_dirs: list[str]) -> dict | None:
    """An alert while Redis has no append-only file (a restart forgets the run); None when CONFIG
    is not allowed."""
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


def replaced(run: str, current: str | None, mine: str, service: str) -> str:
    return (f"run {run!r} was registered again: it is epoch {current} now, this {service} "
            f"was following epoch {mine}")


def report_change(log: Any, state: str, *, run: str, mine: str, current: str | None,
                  service: str, duty: str, command: str | None, then: str) -> str:
    """Log once that the run changed to `state` (run.judge); the reason. `duty` stops while it is
    lost; `then` happens if replaced; without a whole `command`, the reason says what to give."""
    if state == LOST:
        reason = (f"run {run!r} is no longer in Redis ({LOST_CAUSE}); {duty} stopped until "
                  "it is back" + ("" if command else f"; {lost_recover(run, [])[1]}"))
        log.error("run_state_lost", run=run, epoch=mine, reason=reason, command=command)
    elif state == REPLACED:
        reason = f"{replaced(run, current, mine, service)}; {then}"
        log.error("run_replaced", run=run, epoch=current, was=mine, reason=reason)
    else:
        reason = f"run {run!r} is in Redis again; {duty} resumes"
        log.info("run_state_back", run=run, epoch=mine, reason=reason)
    return reason


def waiting(r: redis.Redis, k: RunKeys, states: tuple[str, ...] = (LOST, REPLACED)) -> list[dict]:
    """The heartbeats of the consumers that wait for the run, having seen it lost or replaced."""
    return [b for b in heartbeats.read(r, k).values() if b.get("run_state") in states]


def missing_run_message(r: redis.Redis, k: RunKeys) -> str:
    """Why the run is not in Redis, as far as Redis can still tell, and what to run."""
    beats = waiting(r, k)
    _, advice = lost_recover(k.run, beats)
    if not beats:
        return (f"unknown run {k.run!r}: no genq:{k.run}:meta in Redis (start it with "
                f"`genq produce DATASET`, or pick --run/GENQ_RUN; if Redis lost it, {advice})")
    return (f"run {k.run!r} lost its state in Redis ({LOST_CAUSE}); {len(beats)} "
            f"consumer(s) wait for it, writing nothing. R{advice[1:]}")


def lost_run_back(r: redis.Redis, k: RunKeys, stop: threading.Event, service: str,
                  instead: str, settle: bool = True) -> bool:
    """A service started while Redis has lost its run (consumers' heartbeats wait for it, or,
    with `settle`, Redis started too recently for them to have said so) waits for `genq
    recover` rather than `instead` (a producer: registering the run anew, whose new epoch would
    make every consumer exit; a consumer: exiting on an unknown run). False if stopped while
    waiting."""
    import structlog  # here: `genq status` imports this module and starts without structlog

    log = structlog.get_logger(service)
    if r.exists(k.meta):
        return True
    lost = waiting(r, k, (LOST,))
    unsettled = unsettled_s(r)
    if not lost and unsettled and settle:  # Redis just (re)started: consumers may not have looked
        log.info("run_absent_after_restart", run=k.run, wait_s=unsettled, reason=(
            f"run {k.run!r} is not in Redis, which started under {SETTLE_S} s ago: "
            "waiting for its consumers to say whether they follow a run it lost"))
        until = time.monotonic() + unsettled
        while not r.exists(k.meta) and not waiting(r, k, (LOST,)):  # whichever says it first
            if stop.wait(min(0.2, max(0.0, until - time.monotonic()))):
                return False
            if time.monotonic() >= until:
                break
        if r.exists(k.meta):
            return True
        lost = waiting(r, k, (LOST,))
    if not lost:
        return True
    command, advice = lost_recover(k.run, lost)
    log.error("run_state_lost", run=k.run, reason=(
        f"run {k.run!r} is no longer in Redis ({LOST_CAUSE}) and {len(lost)} consumer(s) wait "
        f"for it: this {service} waits for the recover, not {instead}; {advice}"),
        command=command)
    while not stop.wait(1.0):
        with contextlib.suppress(*REDIS_TROUBLE):
            if r.exists(k.meta):
                return True
    return False
