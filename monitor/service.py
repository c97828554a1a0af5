"""The read-only HTTP service (aiohttp, one event loop): the page, /api/status and /metrics, over
one status source."""

from __future__ import annotations

import asyncio
import threading
import time
from importlib import resources

import orjson
import redis
import structlog
from aiohttp import web

from genq.common.errors import GenqError, mask_secrets
from genq.common.report import runhealth
from genq.common.report.status import read_status
from genq.monitor import metrics

log = structlog.get_logger("monitor")

PAGE = resources.files("genq.monitor").joinpath("page.html").read_bytes()
# A status is served for this long: pages polling and scrapers cost Redis one read a second.
KEEP_S = 1.0


class StatusSource:
    """Reads the status on demand and remembers whether the last read worked, to log changes."""

    def __init__(self, client: redis.Redis, run: str, *, url: str,
                 truncation_threshold: float) -> None:
        self.client, self.run, self.url = client, run, mask_secrets(url)
        self.threshold = truncation_threshold
        self._lock = threading.Lock()
        self._last_error: str | None = ""  # "" = not read yet, None = last read worked
        self._epoch: str | None = None  # the run's identity when first seen
        self._replaced: dict | None = None
        self._reading = threading.Lock()
        # The last read: when it began and ended (monotonic), and its answer.
        self._answer: tuple[float, float, tuple[dict | None, str | None]] = (
            -KEEP_S, -KEEP_S, (None, "not read yet"))

    def latest(self) -> tuple[dict | None, str | None]:
        """read()'s answer, reused: a status read under KEEP_S ago is served again, and callers
        that waited for a read take its answer, so any number of callers in a second read Redis
        once."""
        asked = time.monotonic()
        with self._reading:
            began, ended, answer = self._answer
            if ended >= asked or (answer[0] is not None and asked - began < KEEP_S):
                return answer
            began = time.monotonic()
            answer = self.read()
            self._answer = (began, time.monotonic(), answer)
            return answer

    def read(self) -> tuple[dict | None, str | None]:
        """(status, None) or (None, one-line reason), read now; never raises for Redis or run
        trouble."""
        try:
            status = read_status(self.client, self.run, truncation_threshold=self.threshold)
        except GenqError as e:
            return None, self._note("status_unavailable", str(e))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            return None, self._note("redis_unreachable", f"cannot reach Redis at {self.url}: {e}")
        except redis.RedisError as e:
            return None, self._note("status_unavailable", f"Redis error at {self.url}: {e}")
        self._note("status_available", None)
        self._check_identity(status)
        return status, None

    def _check_identity(self, status: dict) -> None:
        """A run re-created under its name is another run: say so while this monitor runs."""
        epoch = status.get("epoch")
        with self._lock:
            if self._epoch is None:
                self._epoch = epoch
            elif epoch != self._epoch and self._replaced is None:
                self._replaced = {
                    "kind": "run_replaced",
                    "message": (f"{runhealth.replaced(self.run, epoch, self._epoch, 'monitor')}"
                                ": Redis lost the earlier run and its figures restarted; if the "
                                "earlier run's output should continue, recover it with "
                                f"`{runhealth.recover_command(self.run, [])} --replace`"),
                }
            replaced = self._replaced
        if replaced:
            status["alerts"].append(replaced)

    def _note(self, event: str, error: str | None) -> str | None:
        # One log line per change of state, not one per request: a page polls every 2 s.
        with self._lock:
            changed, self._last_error = error != self._last_error, error
        if changed and error:
            log.warning(event, run=self.run, error=error)
        elif changed:
            log.info(event, run=self.run, redis=self.url)
        return error


SOURCE = web.AppKey("source", StatusSource)
HEADERS = {"Cache-Control": "no-store", "Server": "genq-monitor"}


def _send(code: int, body: bytes, content_type: str, **headers: str) -> web.Response:
    # HEAD gets the same headers, Content-Length included, and no body (aiohttp drops it).
    return web.Response(status=code, body=body,
                        headers={**HEADERS, "Content-Type": content_type, **headers})


def _json(code: int, obj: object, **headers: str) -> web.Response:
    return _send(code, orjson.dumps(obj), "application/json", **headers)


async def handle(request: web.Request) -> web.Response:
    """Every request: the page, the status JSON, Prometheus text; 404 elsewhere, 405 for any
    method but GET and HEAD."""
    source = request.app[SOURCE]
    if request.method not in ("GET", "HEAD"):
        # The monitor only reads: changing a run is `genq requeue`'s job, on purpose.
        return _json(405, {"error": f"{request.method} not allowed: the monitor is read-only"},
                     Allow="GET, HEAD")
    if request.path in ("/", "/index.html"):
        return _send(200, PAGE, "text/html; charset=utf-8")
    if request.path not in ("/api/status", "/metrics"):
        return _json(404, {"error": f"no such page {request.path}"})
    # Redis is read by the blocking client genq status uses too, on a worker thread.
    status, error = await asyncio.to_thread(source.latest)
    if request.path == "/api/status":
        return _json(503 if status is None else 200, status or {"error": error, "run": source.run})
    text = (metrics.render(status) if status is not None
            else metrics.render_down(source.run, error or "unknown"))
    return _send(200, text.encode(), metrics.CONTENT_TYPE)


def make_app(source: StatusSource) -> web.Application:
    app = web.Application()
    app[SOURCE] = source
    app.router.add_route("*", "/{tail:.*}", handle)
    return app
