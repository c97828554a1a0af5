"""The SGLang client's transport (aiohttp) sorts every way a server can fail into
ServerUnavailable, the verdict that gives the task back, and sends the URL's credentials: real
sockets, no mocks."""

from __future__ import annotations

import asyncio
import base64

import orjson
import pytest
from conftest import free_port

from genq.common.errors import Retryable, ServerUnavailable, ServerUnreachable, classify
from genq.common.sglang.client import SGLang
from genq.common.sglang.stream import Answer

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
            with pytest.raises(ServerUnreachable):  # never sent: its claim is not counted
                await client.chat(BODY, 0)
            assert await client.load() is None
        finally:
            await client.close()

    asyncio.run(go())


def test_credentials_in_the_url_go_as_basic_auth() -> None:
    """A server behind basic auth gets its credentials on the chat request as on the others, to
    the URL without them."""
    async def go() -> list[bytes]:
        heads: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", free_port())
        port = server.sockets[0].getsockname()[1]
        client = SGLang(f"http://gpu:s%40cret@127.0.0.1:{port}/pre", request_timeout=10.0)
        try:
            with pytest.raises(ServerUnavailable):
                await client.chat(BODY, 0)
            assert await client.load() is None
        finally:
            await client.close()
            server.close()
            await server.wait_closed()
        return heads

    chat, load = (head.decode().lower() for head in asyncio.run(go()))
    auth = "authorization: basic " + base64.b64encode(b"gpu:s@cret").decode().lower()
    assert chat.startswith("post /pre/v1/chat/completions ") and auth in chat
    assert load.startswith("get /pre/v1/loads ") and auth in load


def answered(usage: dict) -> tuple[bytes, list[bytes]]:
    """A finished chat answer carrying `usage`: whole (an HTTP reply), and as stream lines."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok"},
              "finish_reason": "stop"}
    body = orjson.dumps({"choices": [choice], "usage": usage})
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}],
             "usage": usage}
    return reply, [b"data: " + orjson.dumps(chunk), b"data: [DONE]"]


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 5, "completion_tokens": -3},
    {"prompt_tokens": -1, "completion_tokens": 3},
    {"prompt_tokens": 5, "completion_tokens": 2.5},
    {"prompt_tokens": 5, "completion_tokens": "3"},
    {"prompt_tokens": 5, "completion_tokens": "many"},
    {"prompt_tokens": 5, "completion_tokens": True},
    {"prompt_tokens": 5, "completion_tokens": 2**32 + 3},  # wraps the u32 counters to 3
    {"prompt_tokens": 2**31, "completion_tokens": 3},
])
def test_a_token_count_no_server_could_mean_is_server_trouble_never_a_record(usage) -> None:
    # Counts written as sent would wrap Redis's u32 fields and skew the run's token sums; the
    # task goes back instead, as for any malformed answer.
    reply, lines = answered(usage)

    async def go() -> None:
        server = await serve_raw(reply)
        port = server.sockets[0].getsockname()[1]
        client = SGLang(f"http://127.0.0.1:{port}", request_timeout=10.0, connections=4)
        try:
            with pytest.raises(ServerUnavailable) as caught:
                await client.chat(BODY, 0)
            assert classify(caught.value) is Retryable
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    asyncio.run(go())
    answer = Answer()
    with pytest.raises(ServerUnavailable):
        for line in lines:
            answer.feed(line, 0, "http://gpu0")
        answer.completion("http://gpu0", thinking=False)


def test_plausible_token_counts_are_read_as_sent() -> None:
    answer = Answer()
    for line in answered({"prompt_tokens": 5, "completion_tokens": 3})[1]:
        answer.feed(line, 0, "http://gpu0")
    done = answer.completion("http://gpu0", thinking=False)
    assert (done.prompt_tokens, done.completion_tokens) == (5, 3)
