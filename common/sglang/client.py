"""The HTTP client (aiohttp) for SGLang 0.5.x (docs/SGLANG.md): capacity, load, context length,
and a chat answer under a stall watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from base64 import b64encode
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
import structlog
from yarl import URL

from genq.common.errors import ServerStalled, ServerUnavailable, ServerUnreachable
from genq.common.sglang.stream import (
    Answer,
    Completion,
    ContextExceeded,
    error_message,
    load_moved,
    parse_load,
    status_error,
    thinking_on,
    whole_answer,
)

logger = structlog.get_logger("consumer")

# A load older than this is read again for the watchdog (the follower reads it every second).
LOAD_MAX_AGE_S = 1.5
# No answer, a broken one or none in time: the server's trouble, never the task's.
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)
# The server's own endpoints (health, load, what it is) answer at once when it is alive.
GET_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
# Under SGLang's (uvicorn's) 5 s: a connection the server closed idle is never reused.
KEEPALIVE_S = 4.0


def _malformed(url: str, path: str, answer: object) -> ServerUnavailable:
    """An answer of status 200 that is not what the endpoint gives: the server's trouble (an
    HTML page from a proxy in front of it), waited out like a server that is down."""
    return ServerUnavailable(f"{url}{path}: HTTP 200 but not the answer SGLang gives "
                             f"({str(answer)[:80]!r})")


@dataclass
class Progress:
    """When the answer last showed life: a streamed chunk, or (whole) the server's load moving
    while it holds it."""
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    chunks: int = 0


class SGLang:
    def __init__(self, url: str, *, request_timeout: float, stall_timeout: float = 60.0,
                 connections: int | None = None, stream: bool = False) -> None:
        self.url, self.stream = url.rstrip("/"), stream
        self.request_timeout, self.stall_timeout = request_timeout, stall_timeout
        self.connections = connections
        base = URL(self.url)
        self.headers = {"content-type": "application/json"}
        if base.user is not None:
            # aiohttp refuses credentials in the URL beside an Authorization header: they go
            # once, as basic auth, to the URL without them.
            userpass = f"{base.user}:{base.password or ''}".encode()
            self.headers["authorization"] = f"Basic {b64encode(userpass).decode()}"
            base = base.with_user(None)
        self.base = str(base)
        self.chat_url = self.base + "/v1/chat/completions"
        # Silence is policed by chat()'s watchdog, so the socket timeout only backs it up.
        self.chat_timeout = aiohttp.ClientTimeout(sock_connect=10.0, sock_read=request_timeout)
        self._session: aiohttp.ClientSession | None = None  # made on first use, in the loop
        self._load: tuple[float, dict[str, Any] | None] = (0.0, None)  # (read at, load)
        self._reading: asyncio.Future[dict[str, Any] | None] | None = None  # the read under way
        # /v1/loads answers without a load (a gateway's 404, an older server): whole answers
        # get no sign of life, so only --request-timeout ends a hung one.
        self.blind = self.said_blind = False
        self.live: dict[int, Progress] = {}  # the requests in flight, oldest first
        # --reasoning-parser and --tool-call-parser, "" for none; None: not read yet.
        self._parsers: dict[str, str] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # One connection per request in flight: a pool smaller than the server's capacity
            # would queue requests here, where the stall watchdog would take them for a hang.
            connector = aiohttp.TCPConnector(limit=self.connections or 0,
                                             keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        # aiohttp waits for each connection to close; one that never does must not hold up exit.
        if self._session is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._session.close(), timeout=5.0)

    async def _get(self, path: str) -> tuple[int, bytes]:
        """A GET's status and body."""
        try:
            async with self.session.get(self.base + path, headers=self.headers,
                                        timeout=GET_TIMEOUT, allow_redirects=False) as resp:
                return resp.status, await resp.read()
        except TRANSPORT_ERRORS as e:
            raise ServerUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None

    async def _get_json(self, path: str) -> Any:
        status, content = await self._get(path)
        if status != 200:
            raise ServerUnavailable(f"{self.url}{path}: HTTP {status}")
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError:  # a proxy's maintenance page: the server is away
            raise _malformed(self.url, path, content) from None

    # --- what the server is ----------------------------------------------------------------
    async def health(self) -> None:
        """Returns once /health says 200; SGLang answers 503 until its warm-up is over."""
        status, _ = await self._get("/health")
        if status != 200:
            raise ServerUnavailable(f"{self.url}/health: HTTP {status} (still starting?)")

    async def capacity(self) -> int | None:
        """Requests the server runs at once, in force whatever its launch flags (/v1/loads; its
        /get_server_info says null without --max-running-requests)."""
        if (load := await self.load()) is None:
            raise ServerUnavailable(f"{self.url}/v1/loads: no load to read")
        return load["max_running_requests"]

    async def context_length(self) -> int | None:
        """Prompt + completion tokens one request may use (max_model_len in /v1/models)."""
        models = await self._get_json("/v1/models")
        try:
            value = (models.get("data") or [{}])[0].get("max_model_len")
        except (LookupError, TypeError, AttributeError):
            raise _malformed(self.url, "/v1/models", models) from None
        if not value:
            info = await self._get_json("/get_server_info")
            value = info.get("context_length") if isinstance(info, dict) else None
        return int(value) if value else None

    async def model(self) -> str:
        models = await self._get_json("/v1/models")
        try:
            return str(models["data"][0]["id"])
        except (LookupError, TypeError):
            raise _malformed(self.url, "/v1/models", models) from None

    async def load(self) -> dict[str, Any] | None:
        """Running and waiting requests summed over DP ranks, with the capacity in force; None
        when unknown. Each read is kept for the stall watchdog: one poll per server, and one
        read at a time, shared by whoever asks while it is under way (the follower, every whole
        answer's watchdog); a caller cancelled leaves it to the others."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._load_now())
        return await asyncio.shield(self._reading)

    async def _load_now(self) -> dict[str, Any] | None:
        previous, load = self._load[1], await self._read_load()
        self._load = (time.monotonic(), load)
        if not self.stream and load and previous and load_moved(previous, load):
            # The server holds its newest requests; ours beyond that many (the oldest) are not
            # there, and get no sign of life from it.
            held = load["num_reqs"] + load["num_waiting_reqs"]
            for progress in list(self.live.values())[-held:] if held else ():
                progress.last = self._load[0]
        return load

    async def _read_load(self) -> dict[str, Any] | None:
        try:
            status, content = await self._get("/v1/loads")
        except ServerUnavailable:
            return None  # the server's trouble (a hang, a restart): silence means something
        try:
            if status != 200:
                raise ValueError(f"HTTP {status}")
            load, self.blind = parse_load(orjson.loads(content)), False
            return load
        except (LookupError, TypeError, ValueError, AttributeError) as e:
            if status < 500:  # a 5xx is the server's trouble too
                self._no_load(str(e) if status != 200 else f"no load in {content[:100]!r}")
            return None

    def _no_load(self, why: str) -> None:
        self.blind = not self.stream
        if self.blind and not self.said_blind:
            self.said_blind = True
            logger.warning("stall_watch_off", reason=f"{self.url}/v1/loads: {why}",
                           consequence="a hung server is noticed only at --request-timeout; "
                                       "--stream notices it within --stall-timeout")

    async def recent_load(self) -> dict[str, Any] | None:
        at, load = self._load
        fresh = time.monotonic() - at <= min(LOAD_MAX_AGE_S, self.stall_timeout / 4)
        return load if fresh else await self.load()

    async def queued(self) -> bool:
        load = await self.recent_load()
        return bool(load and load["num_waiting_reqs"] > 0)

    async def _parser(self, key: str) -> str | None:
        """One of the server's parsers named in /get_server_info, read once."""
        if self._parsers is None:
            info = await self._get_json("/get_server_info")
            self._parsers = {name: str((info.get(name) if isinstance(info, dict) else None)
                                       or "")
                             for name in ("reasoning_parser", "tool_call_parser")}
        return self._parsers[key] or None

    async def reasoning_parser(self) -> str | None:
        """The server's --reasoning-parser."""
        return await self._parser("reasoning_parser")

    async def tool_call_parser(self) -> str | None:
        """The server's --tool-call-parser: without one its answers carry no tool_calls."""
        return await self._parser("tool_call_parser")

    async def _post_json(self, path: str, payload: dict[str, Any]) -> Any:
        """A POST to one of the server's own endpoints; anything but a JSON object of status
        200 is the server's trouble."""
        try:
            async with self.session.post(self.base + path, data=orjson.dumps(payload),
                                         headers=self.headers, timeout=self.chat_timeout,
                                         allow_redirects=False) as resp:
                status, content = resp.status, await resp.read()
        except TRANSPORT_ERRORS as e:
            raise ServerUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        try:
            answer = orjson.loads(content) if status == 200 else None
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise ServerUnavailable(f"{self.url}{path}: HTTP {status} {content[:200]!r}")
        return answer

    async def parse_function_call(self, text: str, tools: list[Any], parser: str
                                  ) -> tuple[str, list[dict[str, Any]]]:
        """The text before the calls and the calls SGLang's parser finds in an answer's text
        (/parse_function_call), the calls in the shape a chat answer gives them: a fresh id
        each, `index` their order, arguments a JSON string."""
        answer = await self._post_json("/parse_function_call", {
            "text": text, "tool_call_parser": parser, "tools": tools})
        try:
            normal, calls = answer["normal_text"], answer["calls"]
            return str(normal), [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "index": n, "type": "function",
                 "function": {"name": str(call["name"]), "arguments": str(call["parameters"])}}
                for n, call in enumerate(calls)]
        except (LookupError, TypeError):
            raise _malformed(self.url, "/parse_function_call", answer) from None

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text the server's tokenizer makes of these ids (SGLang's /detokenize)."""
        answer = await self._post_json("/detokenize", {"tokens": ids,
                                                       "skip_special_tokens": skip_special_tokens})
        if not isinstance(texts := answer.get("text"), str):
            raise _malformed(self.url, "/detokenize", answer)
        return texts

    # --- one generation ------------------------------------------------------------------
    async def chat(self, body: dict[str, Any], index: int,
                   on_request: Callable[[asyncio.Task], None] | None = None) -> Completion:
        """One chat completion, retried with the max_tokens that fit when it overflows the
        context; cancelling a task passed to on_request aborts the request."""
        try:
            return await self._watched(body, index, on_request)
        except ContextExceeded as e:
            room = e.context - e.input_tokens
            logger.info("max_tokens_lowered", asked=body.get("max_tokens"), used=room,
                        context=e.context, prompt_tokens=e.input_tokens)
            completion = await self._watched({**body, "max_tokens": room}, index, on_request)
            return replace(completion, max_tokens=room)

    async def _watched(self, body: dict[str, Any], index: int,
                       on_request: Callable[[asyncio.Task], None] | None) -> Completion:
        """Ask for the answer while a watchdog ends it once it has been silent too long."""
        progress = Progress()
        send = self._stream if self.stream else self._whole
        task = asyncio.ensure_future(send(body, index, progress))
        if on_request is not None:
            on_request(task)
        self.live[id(progress)] = progress
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(1.0, self.stall_timeout / 4))
                if done:
                    try:
                        return task.result()
                    except aiohttp.ClientConnectorError as e:
                        raise ServerUnreachable(f"{self.url}: {type(e).__name__}: {e}") from None
                    except TRANSPORT_ERRORS as e:  # raised by _whole or _stream
                        # A socket timeout is a hang, not a refusal its slot would resend.
                        kind = ServerStalled if isinstance(e, TimeoutError) else ServerUnavailable
                        raise kind(f"{self.url}: {type(e).__name__}: {e or 'no detail'}") from None
                if not self.stream:
                    await self.recent_load()  # read by the follower already, most of the time
                now = time.monotonic()
                if now - progress.started > self.request_timeout:
                    raise ServerStalled(f"{self.url}: no whole answer within "
                                        f"--request-timeout {self.request_timeout:g} s")
                silent = now - progress.last
                # A stream before its first chunk may wait in the server's queue: not a hang. A
                # whole answer waiting there is alive while the load moves (load() says so).
                if (silent >= self.stall_timeout and not self.blind
                        and (progress.chunks or not self.stream or not await self.queued())):
                    raise ServerStalled(f"{self.url}: answer silent for {silent:.1f} s "
                                        f"(--stall-timeout {self.stall_timeout:g})")
        finally:
            del self.live[id(progress)]
            task.cancel()  # closes the connection, which aborts the request on the server
            # Also when it ended meanwhile (a paused process wakes with the request and its
            # socket timed out together): its error is read here, not logged as unretrieved.
            await asyncio.gather(task, return_exceptions=True)

    async def _whole(self, body: dict[str, Any], index: int, progress: Progress) -> Completion:
        async with self.session.post(self.chat_url, data=orjson.dumps(body), headers=self.headers,
                                     timeout=self.chat_timeout, allow_redirects=False) as resp:
            content = await resp.read()
        if resp.status != 200:
            raise status_error(resp.status, error_message(content), index, self.url,
                               resp.headers.get("retry-after"))
        done = whole_answer(content, self.url, thinking=thinking_on(body))
        if body.get("return_token_ids") and done.completion_token_ids is None:
            # Never a text-only record in a run that keeps ids: the task goes back.
            raise ServerUnavailable(f"{self.url}: answered without token ids (return_token_ids)")
        return done

    async def _stream(self, body: dict[str, Any], index: int, progress: Progress) -> Completion:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with self.session.post(self.chat_url, data=orjson.dumps(body), headers=self.headers,
                                     timeout=self.chat_timeout, allow_redirects=False) as resp:
            if resp.status != 200:
                raise status_error(resp.status, error_message(await resp.read()), index,
                                   self.url, resp.headers.get("retry-after"))
            # Raw bytes split into lines here, as they come: a chunk comes for every token.
            answer, rest = Answer(), b""
            async for data in resp.content.iter_any():
                progress.last = time.monotonic()
                progress.chunks += 1
                *lines, rest = (rest + data).split(b"\n")
                if any(answer.feed(line, index, self.url) for line in lines):
                    break
            else:
                answer.feed(rest, index, self.url)  # a last line without its newline
        return answer.completion(self.url, thinking=thinking_on(body))
