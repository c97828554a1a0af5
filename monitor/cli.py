"""`genq monitor`: settings from flags and environment, then the service and its timers."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

from common import log as genq_log
from common.cli import add_common
from common.queue.keys import RUN_NAME, RunKeys
from common.queue.scripts import ScriptRunner, reap_call
from monitor.periodic import Periodic, PeriodicTask, alert_logger, progress_writer
from monitor.service import MonitorServer, StatusSource, redact

log = structlog.get_logger("monitor")


@dataclass(frozen=True, kw_only=True)
class Settings:
    redis_url: str
    run: str
    host: str
    port: int
    progress_file: Path
    interval_s: float
    truncation_threshold: float


def parse(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="genq monitor",
        description=(
            "Serve the run's status: a web page at /, JSON at /api/status, Prometheus text at "
            "/metrics; keep a progress file current."
        ),
    )
    add_common(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (%(default)s)")
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("GENQ_MONITOR_PORT", 8080)),
        help="port to listen on (%(default)s)",
    )
    parser.add_argument(
        "--progress-file",
        type=Path,
        default=Path("progress.json"),
        help="status JSON rewritten every --interval seconds (%(default)s)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help="seconds between progress-file writes (%(default)s)",
    )
    parser.add_argument(
        "--truncation-threshold",
        type=float,
        default=0.05,
        help="alert when more recent completions than this hit max_tokens",
    )
    a = parser.parse_args(argv)
    if not RUN_NAME.match(a.run):
        parser.error(f"run name {a.run!r} must be 1-64 letters, digits, '_' or '-'")
    if a.interval <= 0:
        parser.error("--interval must be > 0")
    return Settings(
        redis_url=a.redis_url,
        run=a.run,
        host=a.host,
        port=a.port,
        progress_file=a.progress_file,
        interval_s=a.interval,
        truncation_threshold=a.truncation_threshold,
    )


def periodic_tasks(
    settings: Settings, client: redis.Redis, source: StatusSource
) -> list[PeriodicTask]:
    """Everything the monitor does on a timer: the progress file, and the lease reaper, so
    expired leases return to the queue even when every consumer is gone (DESIGN.md)."""
    runner = ScriptRunner(client)
    keys = RunKeys(settings.run)
    return [
        PeriodicTask(
            name="progress_file",
            interval_s=settings.interval_s,
            fn=progress_writer(settings.progress_file, source.read),
        ),
        PeriodicTask(name="alerts", interval_s=settings.interval_s, fn=alert_logger(source.read)),
        PeriodicTask(name="reaper", interval_s=1.0, fn=lambda: runner(reap_call(keys))),
    ]


def main(argv: list[str] | None = None) -> int:
    settings = parse(argv)
    genq_log.setup()
    try:
        client = redis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=2, socket_timeout=5, health_check_interval=30
        )
    except ValueError as e:
        print(f"genq: error: bad --redis-url {redact(settings.redis_url)}: {e}", file=sys.stderr)
        return 2
    source = StatusSource(
        client,
        settings.run,
        url=settings.redis_url,
        truncation_threshold=settings.truncation_threshold,
    )
    try:
        server = MonitorServer((settings.host, settings.port), source)
    except OSError as e:
        print(
            f"genq: error: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr
        )
        client.close()
        return 1
    source.read()  # at start, Redis or run trouble gives one clear log line, then we serve on
    periodic = Periodic(periodic_tasks(settings, client, source))
    _serve(server, periodic, settings)
    client.close()
    return 0


def _serve(server: MonitorServer, periodic: Periodic, settings: Settings) -> None:
    def stop(signum: int, _frame: object) -> None:
        # shutdown() waits for serve_forever to return, so it cannot run on the serving thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    periodic.start()
    log.info(
        "monitor_started",
        run=settings.run,
        url=f"http://{settings.host}:{settings.port}/",
        progress_file=str(settings.progress_file),
        redis=redact(settings.redis_url),
    )
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        periodic.stop()
        server.server_close()
        log.info("monitor_stopped", run=settings.run)
