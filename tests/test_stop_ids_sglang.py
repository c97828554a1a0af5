"""A `stop` finish's ids and text, on the simulator and, in the real-server tier, a real SGLang
0.5.23: the completion ids end with the end token the server matched (the tokens export trains
it), the text leaves it out, and an answer continued by its ids from a cut is the straight one,
field for field, with and without tools (docs/REFERENCE.md, Token ids). Greedy, one request at
a time, so the straight answer is the reference."""

from __future__ import annotations

import asyncio

import pytest
from pipeline import request_of
from sglang_servers import server_fixture
from test_continue_ids import TOOLS, fields, partial_of

from genq.common import params
from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import continue_answer, retexted
from genq.common.task import request_body

LIMIT = 300  # room to stop: the tier's tiny model writes its end token within it on some rows


server = server_fixture("tuned")


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_stop_finish_keeps_its_end_token_in_the_ids_only(server, tools):
    async def main() -> None:
        client = SGLang(server.url, request_timeout=300)
        try:
            async def ask(b):
                return await client.chat(b, 0)

            stopped = []
            for row in range(12):
                body = request_body(
                    [{"role": "user", "content": f"Write program number {row}."}],
                    {**params.DEFAULTS, "return_token_ids": True, "temperature": 0}, "m",
                    tools=tools)
                want = await ask({**body, "max_tokens": LIMIT})
                if want.finish_reason != "length":
                    stopped.append((body, want))
            assert len(stopped) >= 2, "too few answers stopped by themselves"
            for body, want in stopped[:3]:
                ids = want.completion_token_ids
                assert ids is not None and len(ids) == want.completion_tokens
                if want.finish_reason == "stop":  # a tool_calls finish names no match
                    assert ids[-1] == want.matched_stop
                assert await client.detokenize(ids[-1:], True) == ""  # a special token
                again = await retexted(want, body, client)
                assert (again.reasoning_content, again.content) == (want.reasoning_content,
                                                                    want.content)
                for cut in (1, len(ids) // 2, len(ids) - 1):
                    part = await ask({**body, "max_tokens": cut})
                    got = await continue_answer(ask, request_of({**body, "max_tokens": LIMIT}),
                                                partial_of(part), client)
                    assert got is not None and fields(got) == fields(want), (cut, len(ids))
        finally:
            await client.close()

    asyncio.run(main())
