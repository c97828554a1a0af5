"""What every genq command shares: --redis-url/--run, connecting, and turning errors into one
clear line on stderr with a non-zero exit instead of a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import redis

from common.errors import GenqError, UsageError
from common.keys import RunKeys

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# Long-running services (producer, consumer) give every Redis reply this long: without a read
# timeout a command sent into a network partition would wait for the TCP stack, for many minutes.
SERVICE_SOCKET_TIMEOUT_S = 10.0


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


def connect(url: str, socket_timeout: float | None = None) -> redis.Redis:
    """A client that has answered PING, or one clear error naming the URL."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30,
                                      socket_timeout=socket_timeout)
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, ValueError) as e:
        raise GenqError(f"cannot reach Redis at {url}: {e}") from None
    return client


def risky_redis_settings(r: redis.Redis) -> list[str]:
    """What in this Redis's configuration can lose a run's state (DESIGN.md: appendonly yes,
    maxmemory-policy noeviction). Empty when CONFIG is not allowed (managed Redis)."""
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


def guarded(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a command's main: GenqError and Redis trouble become one line and an exit code."""

    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UsageError as e:
            print(f"genq: error: {e}", file=sys.stderr)
            return 2
        except GenqError as e:
            print(f"genq: error: {e}", file=sys.stderr)
            return 1
        except (redis.ConnectionError, redis.TimeoutError) as e:
            print(f"genq: error: lost Redis: {e}", file=sys.stderr)
            return 1
        except redis.exceptions.OutOfMemoryError as e:
            print(f"genq: error: Redis is full (maxmemory reached, noeviction refuses writes): "
                  f"{e}; free memory or raise maxmemory, then run the command again",
                  file=sys.stderr)
            return 1
        except redis.RedisError as e:
            print(f"genq: error: Redis refused a command: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130

    wrapper.__name__ = main.__name__
    wrapper.__doc__ = main.__doc__
    return wrapper
