"""`genq produce`: register the run, then enqueue its unfinished indices once or keep a
bounded window of them queued while consumers drain it."""

from __future__ import annotations

import argparse
import contextlib
import random
import threading

import redis
import structlog

from genq.common import log, params, schema
from genq.common.cli import (
    SERVICE_SOCKET_TIMEOUT_S,
    add_common,
    add_redis_wait,
    connect,
    guarded,
    risky_redis_settings,
    run_keys,
    stop_on_signals,
)
from genq.common.data.dataset import open_dataset
from genq.common.errors import REDIS_TROUBLE, RunStateLost, UsageError
from genq.common.queue import feed, heartbeats
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import text
from genq.common.queue.scripts import ScriptRunner, reap_call
from genq.common.report import runhealth
from genq.common.task import MAX_SAMPLES
from genq.producer import marks

logger = structlog.get_logger("producer")

MIN_WINDOW = 64
MAX_BACKOFF_S = 30.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, with `params` the run's generation parameters (defaults, then changes)."""
    p = argparse.ArgumentParser(prog="genq produce", description=__doc__)
    p.add_argument("dataset", help="JSONL or Parquet; rows have `messages` or `prompt`")
    p.add_argument("--max-tokens", type=int, help="generation limit (default 4096)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 0.6)")
    p.add_argument("--model", help="model name sent to the server (default: the server's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other known generation parameter; repeatable")
    p.add_argument("--raw", action="append", default=[], metavar="KEY=VALUE",
                   help="a server-specific parameter genq does not know, sent as-is "
                        "(value parsed as JSON where it parses); repeatable")
    p.add_argument("--schema", metavar="FILE", help="a JSON Schema every answer must match: sent "
                   "as response_format, checked, asked again when not matched")
    p.add_argument("--token-ids", action="store_true",
                   help="keep the server's prompt_token_ids and completion_token_ids in every "
                        "record (return_token_ids; whole answers only: not with --stream)")
    p.add_argument("--window", type=int, default=0,
                   help="jobs kept queued (default: twice the live consumers' capacity, "
                        f"at least {MIN_WINDOW})")
    p.add_argument("--once", action="store_true",
                   help="enqueue every unfinished index, then exit")
    p.add_argument("--interval", type=float, default=0.5, help="top-up period, seconds")
    p.add_argument("--samples", type=int, default=1, metavar="K",
                   help="answers a prompt, each its own task and seed (default 1)")
    p.add_argument("--turns", choices=(runs.LAST, runs.ALL), default=runs.LAST,
                   help="which assistant turns to make: `last` (default) makes a row's final "
                        "assistant turn anew, or answers a row ending with a user or tool "
                        "message; `all` makes every assistant turn in order, each given the "
                        "turns made before it (docs/REFERENCE.md, \"Turns\")")
    add_redis_wait(p, "--once")
    add_common(p)
    a = p.parse_args(argv)
    named = {"max_tokens": a.max_tokens, "temperature": a.temperature, "model": a.model,
             "return_token_ids": "true" if a.token_ids else None}
    sets = [*a.set, *(f"{key}={value}" for key, value in named.items() if value is not None)]
    a.params = {**params.DEFAULTS, **params.parse_sets(sets, a.raw)}
    if a.schema and a.turns == runs.ALL:  # a UsageError, not p.error: one line, as every refusal
        raise UsageError("--schema with --turns all: a conversation's turns call tools and "
                         "answer in text, so no one schema fits them; drop one of the two")
    if a.schema:
        a.params["response_format"] = schema.response_format(a.schema)
    if a.window < 0:
        p.error("--window must be >= 0")
    if not 1 <= a.samples <= MAX_SAMPLES:  # beyond it, two samples of a row could share a seed
        p.error(f"--samples must be 1-{MAX_SAMPLES}")
    return a


@guarded
def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    log.setup()
    k = run_keys(s.run)
    ds = open_dataset(s.dataset)
    ds.check_prompts()  # before Redis: nothing registered for a data set that cannot run
    # Nor for one whose first rows show it of a shape no server takes.
    ds.check_shape(s.turns == runs.ALL)
    # --once stays interruptible as any command; the windowed producer stops cleanly.
    stop = threading.Event() if s.once else stop_on_signals()
    r = connect(s.redis_url, socket_timeout=SERVICE_SOCKET_TIMEOUT_S, wait=True, stop=stop,
                give_up_after=s.redis_wait if s.once else None)
    # None, or False: stopped while waiting for Redis or for the run it lost. Redis just
    # (re)started is waited out only where this machine registered the run on it before (its
    # mark): a fresh deployment's run registers at once.
    if r is None or not runhealth.lost_run_back(r, k, stop, "producer", "registering it anew",
                                                settle=marks.seen(s.redis_url, s.run)):
        logger.info("producer_stopped", run=s.run)
        return 0
    info = runs.register(r, k, s.dataset, ds.fingerprint, ds.total, s.samples, ds.version,
                         turns=s.turns)
    marks.leave(s.redis_url, s.run, info.epoch)
    for risk in risky_redis_settings(r):
        logger.warning("redis_settings", risk=risk)
    ds.close()
    if not params.init_version_one(r, k, s.params):
        version, current = params.current(r, k)
        if any(current.get(key) != value for key, value in s.params.items()):
            logger.warning("parameters_not_changed", version=version,
                           hint="the run has parameters already; change them with "
                                "`genq requeue --set KEY=VALUE`")
    runner = ScriptRunner(r)
    logger.info("run_registered", run=s.run, dataset=info.dataset, total=info.total)
    if s.once:
        return enqueue_once(r, k, s, info, runner)
    return keep_window(r, k, s, info, runner, stop)


def enqueue_once(r: redis.Redis, k: RunKeys, s: argparse.Namespace, info: runs.RunInfo,
                 runner: ScriptRunner) -> int:
    """Every unfinished index, or only a window while consumers work the run (a million jobs is
    gigabytes of Redis)."""
    live = live_capacity(r, k) > 0 or int(r.zcard(k.leases)) > 0
    want = max(0, window_size(r, k, s.window) - int(r.llen(k.rq_queue))) if live else info.total
    added = feed.top_up(r, k, info.total, want, runner, epoch=info.epoch) if want else 0
    logger.info("enqueued", run=s.run, jobs=added, live=live)
    print(f"enqueued {added} of {info.total} prompts in run {s.run!r}")
    if live:
        print(f"the run is live: only a window was queued; consumers top the queue up "
              f"themselves, and `genq produce {s.dataset}` (without --once) keeps it full")
    return 0


def window_size(r: redis.Redis, k: RunKeys, fixed: int) -> int:
    """Enough queued jobs that every live consumer can refill all its slots at once, twice."""
    return fixed or max(MIN_WINDOW, 2 * live_capacity(r, k))


def live_capacity(r: redis.Redis, k: RunKeys) -> int:
    """Requests the consumers with a live heartbeat keep in flight, together."""
    return sum(b.get("capacity", 0) for b in heartbeats.read(r, k).values())


def keep_window(r: redis.Redis, k: RunKeys, s: argparse.Namespace, info: runs.RunInfo,
                runner: ScriptRunner, stop: threading.Event) -> int:
    logger.info("producer_started", run=s.run, window=s.window or "auto")
    backoff, state, ends = 0.0, runs.OK, runs.Ends()
    while not stop.is_set():
        try:
            state = watch_run(r, k, info, state)
            if state == runs.REPLACED:
                return 1
            if state == runs.OK:
                top_up_window(r, k, s, info, runner)
                version = int(r.get(k.params_version) or 1)
                if ends.new(runs.finished(r, k, info.total), version):
                    logger.info("run_finished", run=s.run, total=info.total, version=version,
                                reason="every prompt is done or failed; waiting for a requeue")
            if backoff:
                log.REDIS_OUTAGE.over()
                logger.info("producer_resumed", run=s.run)
                backoff = 0.0
        except REDIS_TROUBLE as e:
            # Wait it out with jittered exponential backoff; every step is idempotent, so the
            # next round simply continues. A full Redis (noeviction) gets its own clear line.
            backoff = min(max(1.0, backoff * 2), MAX_BACKOFF_S)
            pause = round(backoff * (0.5 + random.random()), 2)
            if isinstance(e, redis.exceptions.OutOfMemoryError):
                logger.warning("redis_full", error=str(e), retry_in_s=pause,
                               hint="Redis is at maxmemory and refuses new jobs (noeviction: "
                                    "nothing is evicted or lost); enqueueing resumes once "
                                    "memory is freed or maxmemory is raised")
            else:
                log.REDIS_OUTAGE.seen(e, retry_in_s=pause)
            stop.wait(pause)
        stop.wait(s.interval)
    logger.info("producer_stopped", run=s.run)
    return 0


def top_up_window(r: redis.Redis, k: RunKeys, s: argparse.Namespace, info: runs.RunInfo,
                  runner: ScriptRunner) -> None:
    runner(reap_call(k))
    want = window_size(r, k, s.window) - int(r.llen(k.rq_queue))
    with contextlib.suppress(RunStateLost):  # gone since this round's check; the next says so
        if want > 0 and feed.top_up(r, k, info.total, want, runner, epoch=info.epoch):
            logger.debug("topped_up", queued=r.llen(k.rq_queue))


def watch_run(r: redis.Redis, k: RunKeys, info: runs.RunInfo, was: str) -> str:
    """Queue nothing while Redis does not hold the run this producer registered."""
    raw = r.hget(k.meta, "epoch")
    current = None if raw is None else text(raw)
    state = runs.judge(current, info.epoch)
    if state != was:
        runhealth.report_change(logger, state, run=k.run, mine=info.epoch, current=current,
                                service="producer", duty="queueing",
                                command=runhealth.lost_recover(k.run, runhealth.waiting(
                                    r, k, (runs.LOST,)))[0], then="this producer stops")
    return state
