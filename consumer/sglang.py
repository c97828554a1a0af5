"""The SGLang HTTP client: one shared httpx.AsyncClient, and the one place where a failed
request is classified as a bad task (fail it) or infrastructure trouble (give it back)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from common.errors import BadTask, ServerUnavailable

# Statuses that say "try again later", not "this request is wrong".
RETRYABLE_STATUS = {408, 425, 429}
# The aiohttp transport maps aiohttp's connection and timeout errors to httpx's; anything else
# aiohttp raises (a malformed response head, say) is still the server's trouble, not the task's.
TRANSPORT_ERRORS = (httpx.TransportError, aiohttp.ClientError)


@dataclass(frozen=True, kw_only=True)
class Completion:
    finish_reason: str
    content: str
    reasoning_content: str | None
    prompt_tokens: int
    completion_tokens: int


class SGLang:
    def __init__(self, url: str, *, request_timeout: float, connections: int) -> None:
        self.url = url.rstrip("/")
        # The read timeout must outlast the longest generation; httpx's default 5 s would
        # kill every long completion.
        timeout = httpx.Timeout(connect=10.0, read=request_timeout, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=connections + 8,
                              max_keepalive_connections=connections + 8)
        # httpx's API on aiohttp's connection pool: a fifth of the client CPU per request of
        # httpx's own transport at 64 in flight (bench/http_transport.py, bench/README.md).
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits,
                                      transport=AiohttpTransport(limits=limits))

    async def close(self) -> None:
        # aiohttp's close waits for every connection to report closed; a connection that
        # never does must not keep a finished consumer from exiting.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.http.aclose(), timeout=5.0)

    async def _get_json(self, path: str) -> Any:
        try:
            response = await self.http.get(path, timeout=10.0)
        except TRANSPORT_ERRORS as e:
            raise ServerUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise ServerUnavailable(f"{self.url}{path}: HTTP {response.status_code}")
        return orjson.loads(response.content)

    async def capacity(self) -> int | None:
        info = await self._get_json("/get_server_info")
        value = info.get("max_running_requests") if isinstance(info, dict) else None
        return int(value) if value else None

    async def model(self) -> str:
        models = await self._get_json("/v1/models")
        return str(models["data"][0]["id"])

    async def load(self) -> dict[str, int] | None:
        """Running and waiting requests on the server, summed over its DP ranks."""
        try:
            data = await self._get_json("/get_load")
        except ServerUnavailable:
            return None
        ranks = data if isinstance(data, list) else [data]
        return {key: sum(int(rank.get(key, 0)) for rank in ranks)
                for key in ("num_reqs", "num_waiting_reqs")}

    async def chat(self, body: dict[str, Any], index: int) -> Completion:
        try:
            response = await self.http.post("/v1/chat/completions", content=orjson.dumps(body),
                                             headers={"content-type": "application/json"})
        except TRANSPORT_ERRORS as e:
            raise ServerUnavailable(f"{self.url}: {type(e).__name__}: {e or 'no detail'}") \
                from None
        return parse_completion(response, index, self.url)


def parse_completion(response: httpx.Response, index: int, url: str) -> Completion:
    status = response.status_code
    if status >= 500 or status in RETRYABLE_STATUS:
        raise ServerUnavailable(f"{url}: HTTP {status}: {_message(response)}")
    if status != 200:
        raise BadTask(index, f"server refused the request (HTTP {status}): {_message(response)}")
    try:
        data = orjson.loads(response.content)
        choice = data["choices"][0]
        message = choice.get("message") or {}
        usage = data.get("usage") or {}
        return Completion(
            finish_reason=str(choice.get("finish_reason") or "other"),
            content=message.get("content") or "",
            reasoning_content=message.get("reasoning_content"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ServerUnavailable(f"{url}: malformed completion ({type(e).__name__}: {e})") \
            from None


def _message(response: httpx.Response) -> str:
    try:
        data = orjson.loads(response.content)
        if isinstance(data, dict):
            return str(data.get("message") or data.get("error") or data)[:500]
    except orjson.JSONDecodeError:
        pass
    return response.text[:500]
