"""Background work the monitor does on a timer: the progress file, alert logging, the reaper."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import structlog

from common.errors import REDIS_TROUBLE
from common.files import write_atomic
from common.log import REDIS_OUTAGE

log = structlog.get_logger("monitor")


@dataclass(frozen=True, kw_only=True)
class PeriodicTask:
    name: str
    interval_s: float
    fn: Callable[[], None]
    # It calls Redis itself, so a run that works ends an outage (the status reads report their
    # own trouble, once per change).
    redis: bool = False


class Periodic(threading.Thread):
    """Runs each task every interval_s on one thread; a failing task is logged, never fatal."""

    def __init__(self, tasks: list[PeriodicTask]) -> None:
        super().__init__(name="genq-monitor-periodic", daemon=True)
        self.tasks = tasks
        self._stop_event = threading.Event()

    def run(self) -> None:
        due = {t.name: 0.0 for t in self.tasks}
        while not self._stop_event.is_set():
            now = time.monotonic()
            for task in self.tasks:
                if now >= due[task.name]:
                    due[task.name] = now + task.interval_s
                    self._run_one(task)
            self._stop_event.wait(max(0.0, min(due.values()) - time.monotonic()))

    def _run_one(self, task: PeriodicTask) -> None:
        try:
            task.fn()
            if task.redis:
                REDIS_OUTAGE.over()
        except REDIS_TROUBLE as e:  # logged once per outage, not once per tick
            REDIS_OUTAGE.seen(e, task=task.name)
        except Exception as e:  # a bad tick must not stop the next one (or the other tasks)
            log.error("periodic_task_failed", task=task.name, error=repr(e))

    def stop(self, timeout: float = 10.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)


def progress_writer(path: Path, read: Callable[[], tuple[dict | None, str | None]]):
    """A task body that rewrites ``path`` with the status; an unreadable status keeps the last
    good file (its ``time`` says how old it is) rather than replacing figures with nothing."""

    def tick() -> None:
        status, _error = read()
        if status is not None:
            write_atomic(path, orjson.dumps(status, option=orjson.OPT_INDENT_2))

    return tick


def alert_logger(read: Callable[[], tuple[dict | None, str | None]]):
    """A task body that logs each alert once when it appears (with its fix command) and once
    when it clears, and the run's end once, so the log says what the page and the status table
    say."""
    active: dict[str, dict] = {}
    finished = [False]

    def tick() -> None:
        status, _error = read()
        if status is None:
            return
        if status.get("finished") and not finished[0]:  # once per end of the run
            log.info("run_finished", run=status["run"], done=status["done"],
                     failed=status["failed"], total=status["total"])
        finished[0] = bool(status.get("finished"))
        now = {f"{a['kind']}|{a.get('server', '')}": a for a in status["alerts"]}
        for key, alert in now.items():
            if key not in active:
                log.warning("alert", run=status["run"], kind=alert["kind"],
                            message=alert["message"], command=alert.get("command"))
        for key, alert in active.items():
            if key not in now:
                log.info("alert_cleared", run=status["run"], kind=alert["kind"])
        active.clear()
        active.update(now)

    return tick
