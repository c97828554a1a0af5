"""A continued answer with tools against the straight one, on the simulator and, in the
real-server tier, a real SGLang 0.5.23 launched with --tool-call-parser qwen25: greedy, by token
ids, cut at the start, the middle, the end and (where the answer made one) inside its tool
call; every field equal, the calls parsed over the whole answer by the server's own
/parse_function_call, whose shape is checked here too."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sglang_servers import KINDS, start_server
from test_continue_ids import TOOLS, fields, partial_of
from test_continue_tools import CALL

from genq.common import params
from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import continue_answer

pytestmark = pytest.mark.timeout(900)
LIMIT = 200


@pytest.fixture(scope="module", params=KINDS)
def server(request):
    started = start_server(request.param, "tools")
    yield started
    started.close()


def test_parse_function_call_shape(server):
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["tool_call_parser"] == "qwen25"
    text = "ok ok \n" + CALL + "\n<tool_call>\n{\"name\": \"count\", "
    got = httpx.post(server.url + "/parse_function_call", timeout=60,
                     json={"text": text, "tool_call_parser": "qwen25", "tools": TOOLS}).json()
    assert got == {"normal_text": "ok ok",
                   "calls": [{"tool_index": 0, "name": "count", "parameters": '{"words": 3}'}]}


def cuts(ids: list[int], raw: str, call_at: int | None) -> list[int]:
    """Where to cut: the start, the middle, the end, and inside the call when there is one."""
    chosen = {1, len(ids) // 2, len(ids) - 1}
    if call_at is not None:
        chosen |= {call_at + 1, call_at + 3, len(ids) - 3}
    return sorted(c for c in chosen if 0 < c < len(ids))


def test_a_continued_answer_with_tools_is_the_straight_one(server):
    async def main() -> None:
        client = SGLang(server.url, request_timeout=300)
        try:
            async def ask(b):
                return await client.chat(b, 0)

            tried = called = 0
            for row in range(6):
                body = params.request_body(
                    [{"role": "user", "content": f"Count the words of line {row}."}],
                    {**params.DEFAULTS, "return_token_ids": True, "temperature": 0}, "m",
                    tools=TOOLS)
                want = await ask({**body, "max_tokens": LIMIT})
                ids = want.completion_token_ids
                assert ids is not None and len(ids) == want.completion_tokens
                raw = await client.detokenize(ids, False)
                call_at = None
                if "<tool_call>" in raw:  # the id that opens the call: cut just past it
                    call_at = next(n for n in range(len(ids)) if "<tool_call>"
                                   in await client.detokenize(ids[:n + 1], False))
                    called += 1
                for cut in cuts(ids, raw, call_at):
                    part = await ask({**body, "max_tokens": cut})
                    got = await continue_answer(ask, {**body, "max_tokens": LIMIT},
                                                partial_of(part), client)
                    assert got is not None and fields(got) == fields(want), (row, cut, len(ids))
                    tried += 1
            assert tried >= 12
            print(f"{server.kind}: {tried} continuations, {called} of 6 answers called a tool")
            if server.kind == "sim":
                assert called == 6
        finally:
            await client.close()

    asyncio.run(main())
