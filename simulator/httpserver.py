"""A small asyncio HTTP/1.1 server: keep-alive, Content-Length bodies, and abort on disconnect.

The simulator must hold hundreds of open requests on a 2-core machine without being the
bottleneck, so this speaks just the HTTP/1.1 subset httpx and curl use, and nothing more.
A request in progress is cancelled the moment its client's connection reaches EOF, which is
how SGLang frees the slot of a client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import orjson
import structlog

log = structlog.get_logger()

MAX_HEAD = 64 * 1024
MAX_BODY = 256 * 1024 * 1024
READ_SIZE = 256 * 1024


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    # A streamed answer: sent with chunked transfer encoding as its pieces come.
    stream: AsyncIterator[bytes] | None = None
    extra_head: str = ""  # further header lines, each ending in CRLF (a fault's Retry-After)


class ResetConnection(Exception):
    """Raised by a handler to have the connection reset in the middle of its response."""


class _Malformed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Handler = Callable[[Request], Awaitable[Response]]

# A response that promises more body than it sends, so the client sees a torn reply.
_PARTIAL = (
    b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4096\r\n\r\n{"id":"'
)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def error_body(status: int, message: str, kind: str) -> bytes:
    """SGLang's OpenAI-style error object."""
    return orjson.dumps(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    )


class _Connection:
    """One client connection: reads requests in turn and answers each one."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.handler = handler
        self.buf = bytearray()

    async def serve(self) -> None:
        try:
            while (request := await self._read_request()) is not None:
                if not await self._dispatch(request):
                    break
        except _Malformed as exc:
            await self._write(
                Response(exc.status, error_body(exc.status, str(exc), "BadRequestError")), False
            )
        except ConnectionError:
            pass
        finally:
            self.writer.close()

    async def _fill(self) -> bool:
        data = await self.reader.read(READ_SIZE)
        self.buf += data
        return bool(data)

    async def _read_request(self) -> Request | None:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise _Malformed(431, "request head too large")
            if not await self._fill():
                return None
        head = bytes(self.buf[:end]).decode("latin-1")
        del self.buf[: end + 4]
        method, target, headers = _parse_head(head)
        length = _content_length(headers)
        if headers.get("expect", "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(self.buf) < length:
            if not await self._fill():
                return None
        body = bytes(self.buf[:length])
        del self.buf[:length]
        path, _, query = target.partition("?")
        return Request(method, path, query, headers, body)

    async def _watch_eof(self) -> None:
        """Return when the client closes; keep any early bytes of its next request."""
        try:
            while await self._fill():
                pass
        except ConnectionError:
            pass

    async def _dispatch(self, request: Request) -> bool:
        # Handling and writing run together, watched for EOF: a client that leaves at any
        # time, even in the middle of a streamed answer, aborts its request.
        task = asyncio.create_task(self._respond(request))
        watch = asyncio.create_task(self._watch_eof())
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The client left (or we are shutting down): abort the work, which frees its slot.
            if not task.done():
                task.cancel()
            watch.cancel()
            # Wait for both to finish: the watcher must let go of the reader before the next read.
            await asyncio.gather(task, watch, return_exceptions=True)
        if task.cancelled():
            return False
        try:
            return task.result()
        except ResetConnection as exc:
            await self._reset(torn_head=not exc.args)
            return False

    async def _respond(self, request: Request) -> bool:
        try:
            response = await self.handler(request)
        except ResetConnection:
            raise
        except Exception:
            log.exception("sim_handler_failed", path=request.path)
            response = Response(500, error_body(500, "internal error", "InternalServerError"))
        if response.stream is not None:
            return await self._write_stream(response, _keep_alive(request))
        return await self._write(response, _keep_alive(request))

    async def _write_stream(self, response: Response, keep: bool) -> bool:
        assert response.stream is not None
        head = (
            f"HTTP/1.1 {response.status} {_reason(response.status)}\r\n"
            f"content-type: {response.content_type}\r\n"
            "transfer-encoding: chunked\r\n"
            f"{'' if keep else 'connection: close' + chr(13) + chr(10)}\r\n"
        )
        try:
            self.writer.write(head.encode("latin-1"))
            async for piece in response.stream:
                self.writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await self.writer.drain()
            self.writer.write(b"0\r\n\r\n")
            await self.writer.drain()
        except ConnectionError:
            return False
        except ResetConnection:
            raise ResetConnection("mid-stream") from None
        finally:
            await response.stream.aclose()  # type: ignore[attr-defined]
        return keep

    async def _write(self, response: Response, keep: bool) -> bool:
        head = (
            f"HTTP/1.1 {response.status} {_reason(response.status)}\r\n"
            f"content-type: {response.content_type}\r\n"
            f"content-length: {len(response.body)}\r\n{response.extra_head}"
            f"{'' if keep else 'connection: close' + chr(13) + chr(10)}\r\n"
        )
        try:
            self.writer.write(head.encode("latin-1") + response.body)
            await self.writer.drain()
        except ConnectionError:
            return False
        return keep

    async def _reset(self, torn_head: bool = True) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            # Linger 0 makes close() send a TCP RST instead of an orderly FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            if torn_head:  # a streamed answer is torn by the reset alone
                self.writer.write(_PARTIAL)
                await self.writer.drain()
        except ConnectionError:
            pass
        self.writer.transport.abort()


def _parse_head(head: str) -> tuple[str, str, dict[str, str]]:
    lines = head.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _Malformed(400, "malformed request line")
    headers = {"_version": parts[2]}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise _Malformed(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], headers


def _content_length(headers: dict[str, str]) -> int:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _Malformed(501, "chunked request bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise _Malformed(400, "bad Content-Length") from None
    if length < 0:
        raise _Malformed(400, "bad Content-Length")
    if length > MAX_BODY:
        raise _Malformed(413, "request body too large")
    return length


def _keep_alive(request: Request) -> bool:
    connection = request.headers.get("connection", "").lower()
    if request.headers["_version"] == "HTTP/1.0":
        return connection == "keep-alive"
    return connection != "close"


async def start(handler: Handler, host: str, port: int) -> asyncio.Server:
    """Listen on host:port and serve every connection with `handler`."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Shutdown cancels open connections. This is the task's outermost frame, and on
        # Python 3.11 a cancelled connection task makes asyncio log a spurious traceback.
        with contextlib.suppress(asyncio.CancelledError):
            await _Connection(reader, writer, handler).serve()

    return await asyncio.start_server(on_connect, host, port, backlog=2048)
