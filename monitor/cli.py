"""`genq monitor`: settings from flags and environment, then the service and its timers."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

import redis
import structlog

from common import log as genq_log
from common.cli import add_common
from common.errors import mask_secrets
from common.queue.keys import RUN_NAME, RunKeys
from common.queue.scripts import ScriptRunner, reap_call
from monitor.periodic import Periodic, PeriodicTask, alert_logger, progress_writer
from monitor.service import MonitorServer, StatusSource

log = structlog.get_logger("monitor")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="genq monitor", description="Serve the run's status: a web page at /, JSON at "
        "/api/status, Prometheus text at /metrics; keep a progress file current.")
    add_common(p)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (%(default)s)")
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


def periodic_tasks(s: argparse.Namespace, client: redis.Redis,
                   source: StatusSource) -> list[PeriodicTask]:
    """The progress file, alert logging, and the lease reaper: expired leases return to the
    queue even when every consumer is gone (docs/RELIABILITY.md)."""
    runner, keys = ScriptRunner(client), RunKeys(s.run)
    return [
        PeriodicTask(name="progress_file", interval_s=s.interval,
                     fn=progress_writer(s.progress_file, source.read)),
        PeriodicTask(name="alerts", interval_s=s.interval, fn=alert_logger(source.read)),
        PeriodicTask(name="reaper", interval_s=1.0, fn=lambda: runner(reap_call(keys)),
                     redis=True),
    ]


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
        server = MonitorServer((s.host, s.port), source)
    except OSError as e:
        print(f"genq: error: cannot listen on {s.host}:{s.port}: {e}", file=sys.stderr)
        client.close()
        return 1
    source.read()  # at start, Redis or run trouble gives one clear log line, then we serve on
    periodic = Periodic(periodic_tasks(s, client, source))

    def stop(signum: int, _frame: object) -> None:
        # shutdown() waits for serve_forever to return, so it cannot run on the serving thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    periodic.start()
    log.info("monitor_started", run=s.run, url=f"http://{s.host}:{s.port}/",
             progress_file=str(s.progress_file), redis=mask_secrets(s.redis_url))
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        periodic.stop()
        server.server_close()
        client.close()
        log.info("monitor_stopped", run=s.run)
    return 0
