"""Routes: SGLang's endpoints with its response shapes, plus the `/_sim/` test controls."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from simulator import generation
from simulator.engine import ApiError, Engine
from simulator.httpserver import Request, Response, error_body
from simulator.settings import Settings

VERSION = "0.4.9-sim"

Route = Callable[[Request], Awaitable[Response]]


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
            ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health,
            ("GET", "/get_model_info"): self.model_info,
            ("GET", "/get_server_info"): self.server_info,
            ("GET", "/get_load"): self.load,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/_sim/stats"): self.sim_stats,
            ("GET", "/_sim/faults"): self.sim_faults_get,
            ("POST", "/_sim/faults"): self.sim_faults_set,
        }
        self._paths = {path for _, path in self.routes}

    async def __call__(self, request: Request) -> Response:
        route = self.routes.get((request.method, request.path))
        if route is None:
            if request.path in self._paths:
                return Response(405, error_body(405, "method not allowed", "BadRequestError"))
            return Response(404, error_body(404, f"no route {request.path}", "NotFoundError"))
        try:
            return await route(request)
        except ApiError as exc:
            return Response(exc.status, error_body(exc.status, str(exc), exc.kind))

    async def chat(self, request: Request) -> Response:
        return await self._generation(generation.chat, request)

    async def generate(self, request: Request) -> Response:
        return await self._generation(generation.generate, request)

    async def _generation(self, endpoint: Callable, request: Request) -> Response:
        self.engine.stats.received += 1
        try:
            return _json(await endpoint(self.engine, request.body))
        except ApiError as exc:
            if exc.status == 400:
                self.engine.stats.bad_requests += 1
            raise

    async def health(self, request: Request) -> Response:
        return Response(200, b"", "text/plain")

    async def model_info(self, request: Request) -> Response:
        m = self.settings.model
        return _json(
            {
                "model_path": m,
                "tokenizer_path": m,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
        )

    async def server_info(self, request: Request) -> Response:
        s = self.settings
        return _json(
            {
                "model_path": s.model,
                "tokenizer_path": s.model,
                "served_model_name": s.model,
                "host": s.host,
                "port": s.port,
                "max_running_requests": s.max_running_requests,
                "max_queued_requests": None,
                "reasoning_parser": "qwen3",
                "enable_metrics": True,
                "version": VERSION,
                "simulator": {
                    "decode_tps": s.decode_tps,
                    "ttft": s.ttft,
                    "time_scale": s.time_scale,
                    "length_dist": str(s.length_dist),
                    "seed": s.seed,
                },
            }
        )

    async def load(self, request: Request) -> Response:
        # One entry per data-parallel rank, as SGLang reports it; the simulator has one rank.
        slots = self.engine.slots
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": slots.running,
                    "num_waiting_reqs": slots.waiting,
                    "num_tokens": self.engine.tokens_in_use(),
                }
            ]
        )

    async def models(self, request: Request) -> Response:
        m = self.settings.model
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": m,
                        "object": "model",
                        "created": int(self.engine.started),
                        "owned_by": "sglang",
                        "root": m,
                    },
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(200, self._metrics_text().encode(), "text/plain; version=0.0.4")

    def _metrics_text(self) -> str:
        e = self.engine
        model = self.settings.model.replace('"', "")
        label = f'{{model_name="{model}"}}'
        rows = [
            ("num_running_reqs", "gauge", "The number of running requests.", e.slots.running),
            (
                "num_queue_reqs",
                "gauge",
                "The number of requests in the waiting queue.",
                e.slots.waiting,
            ),
            ("num_used_tokens", "gauge", "The number of used tokens.", e.tokens_in_use()),
            (
                "prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                e.stats.prompt_tokens,
            ),
            (
                "generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                e.stats.output_tokens,
            ),
            ("num_requests_total", "counter", "Number of requests processed.", e.stats.completed),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [
                f"# HELP sglang:{name} {help_text}",
                f"# TYPE sglang:{name} {kind}",
                f"sglang:{name}{label} {float(value)}",
            ]
        return "\n".join(lines) + "\n"

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


_FAULT_KEYS = {"status", "hang", "reset", "for_s", "error_rate", "hang_rate", "reset_rate", "clear"}


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
    for key in ("error_rate", "hang_rate", "reset_rate"):
        if key in data and (not _is_number(data[key]) or not 0 <= data[key] <= 1):
            raise ApiError(400, f"{key} must be between 0 and 1")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def apply_faults(engine: Engine, data: dict[str, Any]) -> None:
    """Apply a `POST /_sim/faults` body.

    Timed modes (`status`, `hang`, `reset`) last `for_s` real seconds, or until changed when
    `for_s` is absent; `null`/`false` ends one. Rates last until changed. `clear` first restores
    the start-up flags. Nothing is applied when any part of the body is invalid.
    """
    _check_faults(data)
    if data.get("clear"):
        engine.faults = engine.initial_faults()
    faults = engine.faults
    for_s = data.get("for_s")
    until = time.monotonic() + (for_s if for_s is not None else 1e12)
    if "status" in data:
        faults.status = data["status"]
        faults.status_until = until if data["status"] is not None else 0.0
    if "hang" in data:
        faults.hang_until = until if data["hang"] else 0.0
    if "reset" in data:
        faults.reset_until = until if data["reset"] else 0.0
    for key in ("error_rate", "hang_rate", "reset_rate"):
        if key in data:
            setattr(faults, key, float(data[key]))
