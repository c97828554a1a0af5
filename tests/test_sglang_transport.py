"""The SGLang client's transport (httpx on aiohttp) still sorts every way a server can fail
into ServerUnavailable, the verdict that gives the task back: real sockets, no mocks."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import ServerUnavailable
from common.net import free_port
from common.sglang.client import SGLang

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def serve_raw(reply: bytes | None):
    """A TCP server that reads the request head, then writes `reply` (or nothing) and closes."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if reply is not None:
            writer.write(reply)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", free_port())


@pytest.mark.parametrize("reply", [
    b"garbage that is not HTTP\r\n\r\n",                               # malformed head
    None,                                                               # closed, no answer
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"choices\":",    # body cut short
])
def test_broken_server_reply_is_server_unavailable(reply: bytes | None) -> None:
    async def go() -> None:
        server = await serve_raw(reply)
        port = server.sockets[0].getsockname()[1]
        client = SGLang(f"http://127.0.0.1:{port}", request_timeout=10.0, connections=4)
        try:
            with pytest.raises(ServerUnavailable):
                await client.chat(BODY, 0)
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    asyncio.run(go())


def test_nothing_listening_is_server_unavailable() -> None:
    async def go() -> None:
        client = SGLang(f"http://127.0.0.1:{free_port()}", request_timeout=10.0, connections=4)
        try:
            with pytest.raises(ServerUnavailable):
                await client.chat(BODY, 0)
            assert await client.load() is None
        finally:
            await client.close()

    asyncio.run(go())
