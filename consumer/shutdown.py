"""Bounds on a consumer's shutdown: slots stuck after the --grace drain are cancelled
FORCE_AFTER_S later, and a watchdog logs every stack after that."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any

import redis
import structlog

from genq.common.cli import explain
from genq.common.errors import REDIS_TROUBLE, GenqError

logger = structlog.get_logger("consumer")

FORCE_AFTER_S = 5.0  # after the grace: slots still running then are cancelled
WATCHDOG_AFTER_S = 15.0  # after the grace: dump every stack (FORCE_AFTER_S has long passed)
WITHDRAW_TIMEOUT_S = 5.0  # the last goodbye to Redis; the heartbeat keys expire anyway


def dump_stuck(loop: asyncio.AbstractEventLoop) -> None:
    """Log where every task and thread is, so a hang in the field is diagnosed from the log."""
    tasks = asyncio.all_tasks(loop)
    logger.error("shutdown_stuck", tasks=len(tasks), where=[where(t) for t in tasks])
    with contextlib.suppress(OSError, ValueError):  # stderr gone (a dead pipe): say no more
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def where(task: asyncio.Task) -> list[str]:
    """The whole chain of awaits a task is suspended in, innermost last."""
    chain: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain


def arm_watchdog(grace: float) -> None:
    watchdog = threading.Timer(grace + WATCHDOG_AFTER_S, dump_stuck, [asyncio.get_running_loop()])
    watchdog.daemon = True  # never keeps a finished process alive
    watchdog.start()


async def bounded(slots: Sequence[asyncio.Task]) -> None:
    if not slots:
        return
    _, pending = await asyncio.wait(slots, timeout=FORCE_AFTER_S)
    if pending:
        logger.warning("shutdown_forced", slots=len(pending),
                       reason="still waiting on Redis after the grace; their leases expire "
                              "and the tasks return to the queue")
        await cancel_and_wait(pending)


async def cancel_and_wait(tasks: Iterable[asyncio.Task], bound: float = FORCE_AFTER_S) -> None:
    """Cancel the tasks until they are done, for at most `bound` seconds: on Python 3.11
    redis-py's `asyncio.wait_for` drops about one cancellation in three on a busy loop."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + bound
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.01)  # a lost one: again in 10 ms
    if pending:
        logger.error("shutdown_forced", tasks=[where(t) for t in pending],
                     reason="tasks that would not end; the process exits without them")


async def withdraw(body: Callable[[], Awaitable[None]]) -> None:
    """The consumer's deregistration, bounded in time: failing leaves a stale entry to expire."""
    try:
        async with asyncio.timeout(WITHDRAW_TIMEOUT_S):
            await body()
    except REDIS_TROUBLE as e:  # includes TimeoutError
        logger.warning("deregister_failed", error=str(e) or type(e).__name__)


async def to_the_end(main: Coroutine[Any, Any, int]) -> int:
    """Run the consumer, then end every task it left (asyncio.run's cleanup cancels once and
    waits for ever); one that will not end is left behind, and the process exits."""
    rc, error = 1, None
    try:
        rc = await main
        return rc
    except (GenqError, redis.RedisError) as e:
        error = e
        raise
    finally:
        await cancel_and_wait(asyncio.all_tasks() - {asyncio.current_task()})
        if len(asyncio.all_tasks()) > 1:
            if error is not None:  # the exit skips the command's own report of it
                rc = explain(error)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
