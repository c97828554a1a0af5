"""What every genq command shares: --redis-url/--run, connecting, and turning errors into one
clear line on stderr with a non-zero exit instead of a traceback."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import overload

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from genq.common.errors import GenqError, UsageError, mask_secrets
from genq.common.log import Outage, say
from genq.common.queue.keys import RunKeys

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# Long-running services (producer, consumer) give every Redis reply this long: without a read
# timeout a command sent into a network partition would wait for the TCP stack, for many minutes.
SERVICE_SOCKET_TIMEOUT_S = 10.0


def add_redis_wait(parser: argparse.ArgumentParser, mode: str) -> None:
    """--redis-wait: how long a run-to-the-end command (--once, --burst) waits for Redis."""
    parser.add_argument("--redis-wait", type=float, default=30.0, metavar="S",
                        help=f"with {mode}: give up after S seconds without Redis, with one "
                             "line and exit 1 (default 30); without it a service waits for "
                             "Redis as long as it takes")


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                        help="Redis holding the run (env REDIS_URL; default %(default)s)")
    parser.add_argument("--run", default=os.environ.get("GENQ_RUN", "default"),
                        help="run name (env GENQ_RUN; default %(default)s)")


def run_keys(run: str) -> RunKeys:
    try:
        return RunKeys(run)
    except ValueError as e:
        raise UsageError(str(e)) from None


# redis-py's own retries would hold a call for a minute, deaf to SIGTERM and silent; services
# retry with their own logged backoff, so the client retries once: enough to reconnect.
def service_retry() -> Retry:
    return Retry(NoBackoff(), 1)


# Backoff while Redis is unreachable or loading: the consumer's (consumer/backoff.py) as well.
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 5.0


def stop_on_signals() -> threading.Event:
    """An event SIGTERM and SIGINT set, so a service stopped while it starts exits cleanly."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


@overload
def connect(url: str, socket_timeout: float | None = None, *, wait: bool = False,
            stop: None = None, give_up_after: float | None = None) -> redis.Redis: ...
@overload
def connect(url: str, socket_timeout: float | None = None, *, wait: bool = False,
            stop: threading.Event, give_up_after: float | None = None) -> redis.Redis | None: ...
def connect(url: str, socket_timeout: float | None = None, *, wait: bool = False,
            stop: threading.Event | None = None,
            give_up_after: float | None = None) -> redis.Redis | None:
    """A client that answered PING, or one clear error naming the URL (masked); `wait=True` waits
    for Redis, logging the outage (None once `stop` is set; at most `give_up_after` s)."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30,
                                      socket_timeout=socket_timeout, retry=service_retry())
    except ValueError as e:
        raise UsageError(f"bad Redis URL {mask_secrets(url)}: {e}") from None
    delay, started = RETRY_FIRST_S, time.monotonic()
    pause = stop or threading.Event()  # an event nobody sets: sleeps the whole delay
    outage = Outage("redis", ("waiting_for_redis", "still_waiting_for_redis", "redis_available"))
    while True:
        try:
            client.ping()
            break
        except redis.AuthenticationError as e:  # a wrong password never fixes itself
            raise GenqError(f"Redis at {mask_secrets(url)} refused the credentials: {e}") \
                from None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            waited_s = time.monotonic() - started
            if not wait or (give_up_after is not None and waited_s >= give_up_after):
                after = f" after {give_up_after:g} s (--redis-wait)" if wait else ""
                raise GenqError(f"cannot reach Redis at {mask_secrets(url)}{after}: {e}") \
                    from None
            outage.seen(e, redis=mask_secrets(url), hint="retrying with backoff " + (
                "until Redis answers" if give_up_after is None else
                f"for up to {give_up_after:g} s (--redis-wait), then giving up"))
            if pause.wait(delay):
                client.close()
                return None
            delay = min(delay * 2, RETRY_MAX_S)
    outage.over(redis=mask_secrets(url))
    return client


def risky_redis_settings(r: redis.Redis) -> list[str]:
    """What in this Redis's configuration can lose a run's state (docs/RELIABILITY.md); empty
    when CONFIG is not allowed."""
    try:
        config = r.config_get("appendonly")
        config.update(r.config_get("maxmemory-policy"))
    except redis.ResponseError:
        return []
    risks = []
    if config.get("appendonly") != "yes":
        risks.append("appendonly is not yes: a Redis restart forgets acknowledged results")
    policy = config.get("maxmemory-policy", "noeviction")
    if policy != "noeviction":
        risks.append(f"maxmemory-policy is {policy}: Redis may evict leases, jobs or bitmaps")
    return risks


def guarded(main: Callable[[list[str] | None], int]) -> Callable[..., int]:
    """Wrap a command's main: GenqError and Redis trouble become one line and an exit code."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except (GenqError, redis.RedisError) as e:
            return explain(e)
        except KeyboardInterrupt:
            return 130

    return wrapper


def explain(e: GenqError | redis.RedisError) -> int:
    """Say what ended the command, in one line; its exit code."""
    if isinstance(e, GenqError):
        say(f"genq: error: {e}")
        return 2 if isinstance(e, UsageError) else 1
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
        say(f"genq: error: lost Redis: {e}")
    elif isinstance(e, redis.exceptions.OutOfMemoryError):
        say(f"genq: error: Redis is full (maxmemory reached, noeviction refuses writes): "
            f"{e}; free memory or raise maxmemory, then run the command again")
    else:
        say(f"genq: error: Redis refused a command: {e}")
    return 1
