"""Routes: SGLang's endpoints with its response shapes, plus the `/_sim/` test controls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from genq.simulator import generation, info
from genq.simulator.engine import ApiError, Engine
from genq.simulator.httpserver import Request, Response, error_body
from genq.simulator.settings import Settings

Route = Callable[[Request], Awaitable[Response]]
# What a proxy in front of a server under maintenance answers, status 200 and all.
MAINTENANCE_PAGE = b"<html><body><h1>Down for maintenance</h1></body></html>"


def _json(data: Any, status: int = 200) -> Response:
    return Response(status, orjson.dumps(data))


class App:
    """Dispatches a request to its endpoint and turns ApiError into SGLang's error object."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = Engine(settings)
        self.routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/generate"): self.generate,
            ("POST", "/detokenize"): self.detokenize,
            ("POST", "/v1/detokenize"): self.detokenize,
            ("POST", "/parse_function_call"): self.parse_function_call,
            ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health,
            ("GET", "/get_model_info"): self.info(info.model_info),
            ("GET", "/model_info"): self.info(info.model_info),
            ("GET", "/get_server_info"): self.info(info.server_info),
            ("GET", "/server_info"): self.info(info.server_info),
            ("GET", "/v1/loads"): self.info(info.loads),
            ("GET", "/v1/models"): self.info(info.models),
            ("GET", "/metrics"): self.metrics,
            ("GET", "/_sim/stats"): self.sim_stats,
            ("GET", "/_sim/faults"): self.sim_faults_get,
            ("POST", "/_sim/faults"): self.sim_faults_set,
        }
        if settings.legacy_get_load:  # a server before 0.5: /get_load, no /v1/loads
            self.routes[("GET", "/get_load")] = self.info(info.get_load)
            del self.routes[("GET", "/v1/loads")]
        self._paths = {path for _, path in self.routes}

    async def __call__(self, request: Request) -> Response:
        route = self.routes.get((request.method, request.path))
        if route is not None and request.path in ("/v1/loads", "/get_load"):
            self.engine.stats.load_reads += 1
        if route is None:
            # FastAPI's own answers, as SGLang gives them for unknown paths and methods.
            if request.path in self._paths:
                return _json({"detail": "Method Not Allowed"}, 405)
            return _json({"detail": "Not Found"}, 404)
        try:
            return await route(request)
        except ApiError as exc:
            wait = "" if exc.retry_after is None else f"retry-after: {exc.retry_after}\r\n"
            return Response(exc.status, error_body(exc.status, str(exc), exc.kind),
                            extra_head=wait)

    async def chat(self, request: Request) -> Response:
        return await self._generation(generation.chat, request)

    async def generate(self, request: Request) -> Response:
        return await self._generation(generation.generate, request)

    async def detokenize(self, request: Request) -> Response:
        return _json(generation.detokenize(self.engine, request.body))

    async def parse_function_call(self, request: Request) -> Response:
        return _json(generation.parse_function_call(request.body))

    def info(self, endpoint: Callable[[Settings, Engine], Any]) -> Route:
        async def route(request: Request) -> Response:
            while time.monotonic() < self.engine.faults.info_hang_until:  # a frozen server
                await asyncio.sleep(0.05)
            if time.monotonic() < self.engine.faults.info_html_until:  # a proxy's own page
                return Response(200, MAINTENANCE_PAGE, "text/html; charset=utf-8")
            return _json(endpoint(self.settings, self.engine))

        return route

    async def _generation(self, endpoint: Callable, request: Request) -> Response:
        self.engine.stats.received += 1
        try:
            answer = await endpoint(self.engine, request.body)
            if isinstance(answer, dict):
                return _json(answer)
            return Response(200, content_type="text/event-stream; charset=utf-8", stream=answer)
        except ApiError as exc:
            if exc.status == 400:
                self.engine.stats.bad_requests += 1
            raise

    async def health(self, request: Request) -> Response:
        # SGLang answers 503 until its warm-up request has gone through.
        warm = time.time() - self.engine.started >= self.settings.warmup
        return Response(200 if warm else 503, b"", "text/plain")

    async def metrics(self, request: Request) -> Response:
        text = info.metrics_text(self.settings, self.engine)
        return Response(200, text.encode(), "text/plain; version=0.0.4")

    async def sim_stats(self, request: Request) -> Response:
        return _json(self.engine.stats_view())

    async def sim_faults_get(self, request: Request) -> Response:
        return _json(self.engine.faults.view())

    async def sim_faults_set(self, request: Request) -> Response:
        try:
            data = orjson.loads(request.body or b"{}")
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "fault body must be a JSON object")
        apply_faults(self.engine, data)
        return _json(self.engine.faults.view())


_FAULT_KEYS = {
    "status",
    "hang",
    "info_hang",
    "stall",
    "info_html",
    "reset",
    "finish",
    "for_s",
    "error_rate",
    "hang_rate",
    "reset_rate",
    "retry_after",
    "error_marker",
    "invalid_json_rate",
    "clear",
}


def _check_faults(data: dict[str, Any]) -> None:
    unknown = set(data) - _FAULT_KEYS
    if unknown:
        raise ApiError(400, f"unknown fault keys: {sorted(unknown)}")
    for_s = data.get("for_s")
    if for_s is not None and (not _is_number(for_s) or for_s <= 0):
        raise ApiError(400, "for_s must be a positive number of seconds")
    status = data.get("status")
    if status is not None and (type(status) is not int or not 400 <= status <= 599):
        raise ApiError(400, "status must be an HTTP error status (400-599) or null")
    if data.get("finish") not in (None, "abort", "missing"):
        raise ApiError(400, 'finish must be "abort", "missing" or null')
    for key in ("error_rate", "hang_rate", "reset_rate", "invalid_json_rate"):
        if key in data and (not _is_number(data[key]) or not 0 <= data[key] <= 1):
            raise ApiError(400, f"{key} must be between 0 and 1")
    wait = data.get("retry_after")
    if wait is not None and (type(wait) is not int or wait < 0):
        raise ApiError(400, "retry_after must be a whole number of seconds >= 0, or null")
    if not isinstance(data.get("error_marker") or "", str):
        raise ApiError(400, "error_marker must be a string or null")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def apply_faults(engine: Engine, data: dict[str, Any]) -> None:
    """Apply a `POST /_sim/faults` body.

    Timed modes (`status`, `hang`, `info_hang`, `stall`, `reset`, `finish`) last `for_s` real
    seconds, or until changed when `for_s` is absent; `null`/`false` ends one. Rates last until
    changed. `clear` first restores the start-up flags. Nothing is applied when any part of the
    body is invalid.
    """
    _check_faults(data)
    if data.get("clear"):
        engine.clock()  # the decoding time an earlier stall took is kept
        engine.faults = engine.initial_faults()
    faults = engine.faults
    for_s = data.get("for_s")
    until = time.monotonic() + (for_s if for_s is not None else 1e12)
    if "status" in data:
        faults.status = data["status"]
        faults.status_until = until if data["status"] is not None else 0.0
    if "hang" in data:
        faults.hang_until = until if data["hang"] else 0.0
    if "info_hang" in data:
        faults.info_hang_until = until if data["info_hang"] else 0.0
    if "stall" in data:
        engine.clock()  # the decoding time an earlier stall took is kept
        faults.stall_from = time.monotonic()
        faults.stall_until = until if data["stall"] else 0.0
    if "info_html" in data:
        faults.info_html_until = until if data["info_html"] else 0.0
    if "reset" in data:
        faults.reset_until = until if data["reset"] else 0.0
    if "finish" in data:
        faults.finish = data["finish"] or ""
        faults.finish_until = until if data["finish"] else 0.0
    if "retry_after" in data:
        faults.retry_after = data["retry_after"]
    if "error_marker" in data:
        faults.error_marker = data["error_marker"] or ""
    for key in ("error_rate", "hang_rate", "reset_rate", "invalid_json_rate"):
        if key in data:
            setattr(faults, key, float(data[key]))
