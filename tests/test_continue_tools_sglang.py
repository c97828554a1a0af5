"""A continued answer with tools against the straight one, on the simulator and, in the
real-server tier, a real SGLang 0.5.23 launched with --tool-call-parser qwen25: greedy, by token
ids, cut at the start, the middle, the end and (where the answer made one) inside its tool
call; every field equal, the calls parsed over the whole answer by the server's own
/parse_function_call, whose shape is checked here too. The tier's tiny random model makes no
tool call of its own, so on the real server a partial that holds a whole call (the call's text
tokenized by the server) shows the call is kept when the continuation's new text has none."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pipeline import request_of
from sglang_servers import server_fixture
from test_continue_ids import TOOLS, fields, partial_of
from test_continue_tools import CALL

from genq.common import params
from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import continue_answer
from genq.common.task import request_body

LIMIT = 200
RUN_ON = 40  # answers made to run to max_tokens (ignore_eos): long enough to cut anywhere


server = server_fixture("tools")


def body_of(row: int, thinking: bool = True) -> dict:
    body = request_body([{"role": "user", "content": f"Count the words of line {row}."}],
                        {**params.DEFAULTS, "return_token_ids": True, "temperature": 0},
                        "m", tools=TOOLS)
    return body if thinking else {**body, "chat_template_kwargs": {"enable_thinking": False}}


def test_parse_function_call_shape(server):
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["tool_call_parser"] == "qwen"  # launched with qwen25: 0.5.23's name for it
    text = "ok ok \n" + CALL + "\n<tool_call>\n{\"name\": \"count\", "
    got = httpx.post(server.url + "/parse_function_call", timeout=60,
                     json={"text": text, "tool_call_parser": "qwen", "tools": TOOLS}).json()
    assert got == {"normal_text": "ok ok",
                   "calls": [{"tool_index": 0, "name": "count", "parameters": '{"words": 3}'}]}


async def call_starts(client: SGLang, ids: list[int]) -> int | None:
    """The position of the id that opens the answer's call, None without one."""
    if "<tool_call>" not in await client.detokenize(ids, False):
        return None
    for n in range(len(ids)):
        if "<tool_call>" in await client.detokenize(ids[:n + 1], False):
            return n
    return None


def test_a_continued_answer_with_tools_is_the_straight_one(server):
    async def main() -> None:
        client = SGLang(server.url, request_timeout=300)
        try:
            async def ask(b):
                return await client.chat(b, 0)

            tried = called = 0
            for row in range(6):
                for limit, extra in ((LIMIT, {}), (RUN_ON, {"ignore_eos": True})):
                    body = {**body_of(row), **extra}
                    want = await ask({**body, "max_tokens": limit})
                    ids = want.completion_token_ids
                    assert ids is not None and len(ids) == want.completion_tokens
                    chosen = {1, len(ids) // 4, len(ids) // 2, len(ids) - 1}
                    if (at := await call_starts(client, ids)) is not None:
                        called += 1
                        chosen |= {at + 1, at + 3, len(ids) - 3}
                    for cut in sorted(c for c in chosen if 0 < c < len(ids)):
                        part = await ask({**body, "max_tokens": cut})
                        got = await continue_answer(ask, request_of({**body, "max_tokens": limit}),
                                                    partial_of(part), client)
                        assert got is not None and fields(got) == fields(want), (row, cut)
                        tried += 1
            print(f"{server.kind}: {tried} continuations equal, {called} answers called")
            assert tried >= 24 and (called >= 6 or server.kind == "real")
        finally:
            await client.close()

    asyncio.run(main())


def test_a_call_the_partial_holds_is_kept(server):
    """The continuation's new text holds no call; the whole answer's does."""
    if server.kind == "sim":
        pytest.skip("the simulator continues its own answers only (covered cut by cut above)")

    async def main() -> None:
        client = SGLang(server.url, request_timeout=300)
        try:
            async def ask(b):
                return await client.chat(b, 0)

            body = body_of(1, thinking=False)
            start = await ask({**body, "max_tokens": 1})
            ids = httpx.post(server.url + "/tokenize", json={"prompt": CALL},
                             timeout=60).json()["tokens"]
            partial = {**partial_of(start), "content": "", "completion_tokens": len(ids),
                       "completion_token_ids": ids}
            got = await continue_answer(ask, request_of({**body, "max_tokens": len(ids) + 20}),
                                        partial, client)
            assert got is not None and got.completion_token_ids[:len(ids)] == ids
            assert [{**c, "id": None} for c in got.tool_calls or ()] == [
                {"id": None, "index": 0, "type": "function",
                 "function": {"name": "count", "arguments": '{"words": 3}'}}]
            assert got.content == "" and got.reasoning_content is None
            assert got.finish_reason == ("tool_calls" if got.completion_tokens < len(ids) + 20
                                         else "length")
        finally:
            await client.close()

    asyncio.run(main())
