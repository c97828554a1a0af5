"""`genq monitor`: settings from flags and environment, then the service and the work it does on a
timer: the progress file, alert logging, the reaper."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import redis
import structlog
from aiohttp import web

from genq.common import log as genq_log
from genq.common.cli import add_common
from genq.common.errors import REDIS_TROUBLE, mask_secrets
from genq.common.files import write_atomic
from genq.common.log import REDIS_OUTAGE
from genq.common.queue import run as runs
from genq.common.queue.keys import RUN_NAME, RunKeys
from genq.common.queue.scripts import ScriptRunner, reap_call
from genq.monitor.service import StatusSource, make_app

log = structlog.get_logger("monitor")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="genq monitor", description="Serve the run's status: a web page at /, JSON at "
        "/api/status, Prometheus text at /metrics; keep a progress file current.")
    add_common(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (%(default)s; 0.0.0.0 for every interface: no auth)")
    p.add_argument("--port", type=int, default=int(os.environ.get("GENQ_MONITOR_PORT", 8080)),
                   help="port to listen on (%(default)s)")
    p.add_argument("--progress-file", type=Path, default=Path("progress.json"),
                   help="status JSON rewritten every --interval seconds (%(default)s)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between progress-file writes (%(default)s)")
    p.add_argument("--truncation-threshold", type=float, default=0.05,
                   help="alert when more recent completions than this hit max_tokens")
    a = p.parse_args(argv)
    if not RUN_NAME.match(a.run):
        p.error(f"run name {a.run!r} must be 1-64 letters, digits, '_' or '-'")
    if a.interval <= 0:
        p.error("--interval must be > 0")
    return a


# A periodic task: its name (in the log), the seconds between its runs, and what it does.
Task = tuple[str, float, Callable[[], None]]


class Periodic(threading.Thread):
    """Runs each task every interval on one thread; a failing task is logged, never fatal."""

    def __init__(self, tasks: list[Task]) -> None:
        super().__init__(name="genq-monitor-periodic", daemon=True)
        self.tasks = tasks
        self._stop_event = threading.Event()

    def run(self) -> None:
        due = {name: 0.0 for name, _, _ in self.tasks}
        while not self._stop_event.is_set():
            now = time.monotonic()
            for name, interval_s, fn in self.tasks:
                if now < due[name]:
                    continue
                due[name] = now + interval_s
                try:
                    fn()
                except REDIS_TROUBLE as e:  # logged once per outage, not once per tick
                    REDIS_OUTAGE.seen(e, task=name)
                except Exception as e:  # a bad tick must not stop the next one, or the others
                    log.error("periodic_task_failed", task=name, error=repr(e))
            self._stop_event.wait(max(0.0, min(due.values()) - time.monotonic()))

    def stop(self, timeout: float = 10.0) -> None:
        self._stop_event.set()
        self.join(timeout)


def alert_logger(read: Callable[[], tuple[dict | None, str | None]]):
    """A task logging each alert once as it appears (with its fix) and as it clears, and the
    run's end once."""
    active: dict[str, dict] = {}
    ends = runs.Ends()

    def tick() -> None:
        status, _error = read()
        if status is None:
            return
        if ends.new(bool(status.get("finished")), status["params_version"]):
            log.info("run_finished", run=status["run"], done=status["done"],
                     failed=status["failed"], total=status["total"])
        now = {f"{a['kind']}|{a.get('server', '')}": a for a in status["alerts"]}
        for alert in [a for key, a in now.items() if key not in active]:
            log.warning("alert", run=status["run"], kind=alert["kind"],
                        message=alert["message"], command=alert.get("command"))
        for alert in [a for key, a in active.items() if key not in now]:
            log.info("alert_cleared", run=status["run"], kind=alert["kind"])
        active.clear()
        active.update(now)

    return tick


def periodic_tasks(s: argparse.Namespace, client: redis.Redis, source: StatusSource) -> list[Task]:
    """The progress file, alert logging, and the reaper (expired leases return even with no
    consumer left)."""
    runner, keys = ScriptRunner(client), RunKeys(s.run)

    def write_progress() -> None:
        # An unreadable status keeps the last good file (its `time` says how old it is) rather
        # than replacing figures with nothing.
        status, _error = source.latest()
        if status is not None:
            write_atomic(s.progress_file, orjson.dumps(status, option=orjson.OPT_INDENT_2))

    def reap() -> None:
        runner(reap_call(keys))
        # The status reads report their own Redis trouble (once per change); this task calls
        # Redis itself, so a reap that works ends an outage.
        REDIS_OUTAGE.over()

    return [("progress_file", s.interval, write_progress),
            ("alerts", s.interval, alert_logger(source.latest)), ("reaper", 1.0, reap)]


async def serve(s: argparse.Namespace, source: StatusSource, periodic: Periodic) -> int:
    """Listen, run the periodic tasks, and serve until SIGTERM or SIGINT; 1 if it cannot listen."""
    # access_log None: a line per request would drown the log (a page polls every 2 s).
    runner = web.AppRunner(make_app(source), access_log=None, handle_signals=False,
                           shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, s.host, s.port).start()
    except OSError as e:
        print(f"genq: error: cannot listen on {s.host}:{s.port}: {e}", file=sys.stderr)
        await runner.cleanup()
        return 1
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    # At start, Redis or run trouble gives one clear log line, then we serve on.
    await asyncio.to_thread(source.latest)
    periodic.start()
    log.info("monitor_started", run=s.run, url=f"http://{s.host}:{s.port}/",
             progress_file=str(s.progress_file), redis=mask_secrets(s.redis_url))
    try:
        await stop.wait()
    finally:
        periodic.stop()
        await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    genq_log.setup()
    try:
        client = redis.Redis.from_url(s.redis_url, socket_connect_timeout=2, socket_timeout=5,
                                      health_check_interval=30)
    except ValueError as e:
        print(f"genq: error: bad --redis-url {mask_secrets(s.redis_url)}: {e}", file=sys.stderr)
        return 2
    source = StatusSource(client, s.run, url=s.redis_url,
                          truncation_threshold=s.truncation_threshold)
    try:
        code = asyncio.run(serve(s, source, Periodic(periodic_tasks(s, client, source))))
    finally:
        client.close()
    if code == 0:
        log.info("monitor_stopped", run=s.run)
    return code
