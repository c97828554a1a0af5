"""A continued answer to a request with tools is the straight one, its tool calls too, wherever
the partial was cut: inside the thinking, after it, inside the tool call's own text. The calls
are parsed over the whole answer (SGLang's /parse_function_call), never from the
continuation's new text alone. On the simulator, whose answers hold their calls as Qwen2.5's
`<tool_call>` text (its ids too), as the qwen25 parser reads them; the real tier is in
test_continue_tools_sglang.py."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from pipeline import request_of
from test_continue_ids import NATURAL, TOOLS, body_with_tools, fields, partial_of

from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import continue_answer

CALL = '<tool_call>\n{"name": "count", "arguments": {"words": 3}}\n</tool_call>'


def test_the_simulators_answer_holds_its_call_as_text(sim_factory):
    """The ids hold the call's text; the chat answer's content does not, its tool_calls do."""
    sim = sim_factory(time_scale=1000, reasoning_parser="qwen3", length_dist=f"fixed:{NATURAL}")
    choice = httpx.post(sim.url + "/v1/chat/completions", timeout=30,
                        json={**body_with_tools(), "max_tokens": NATURAL + 10}
                        ).json()["choices"][0]
    raw = httpx.post(sim.url + "/detokenize", timeout=30,
                     json={"tokens": choice["response_token_ids"], "skip_special_tokens": False}
                     ).json()["text"]
    assert raw.endswith(CALL + "<|im_end|>")
    assert "<tool_call>" not in choice["message"]["content"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "count", "arguments": '{"words": 3}'}
    assert (call["index"], call["type"], choice["finish_reason"]) == (0, "function", "tool_calls")
    assert choice["matched_stop"] is None


def test_parse_function_call_as_sglang_answers_it(sim_factory):
    """SGLang's POST /parse_function_call: the text before the first call, stripped, and the
    complete calls (an unfinished one is dropped); the client gives them in OpenAI's shape."""
    sim = sim_factory(time_scale=1000)
    text = "ok ok \n" + CALL + "\n<tool_call>\n{\"name\": \"count\", "
    got = httpx.post(sim.url + "/parse_function_call", timeout=30,
                     json={"text": text, "tool_call_parser": "qwen25", "tools": TOOLS}).json()
    assert got == {"normal_text": "ok ok",
                   "calls": [{"tool_index": 0, "name": "count", "parameters": '{"words": 3}'}]}
    plain = httpx.post(sim.url + "/parse_function_call", timeout=30,
                       json={"text": " ok ", "tool_call_parser": "qwen25", "tools": TOOLS}).json()
    assert plain == {"normal_text": " ok ", "calls": []}

    async def main() -> None:
        server = SGLang(sim.url, request_timeout=60)
        try:
            assert await server.tool_call_parser() == "qwen"  # SGLang 0.5.23's name for qwen25
            normal, calls = await server.parse_function_call(text, TOOLS, "qwen")
            assert normal == "ok ok" and [{**c, "id": None} for c in calls] == [
                {"id": None, "index": 0, "type": "function",
                 "function": {"name": "count", "arguments": '{"words": 3}'}}]
            assert calls[0]["id"].startswith("call_")
        finally:
            await server.close()

    asyncio.run(main())


@pytest.mark.parametrize("parser", ["qwen3", None])
def test_a_cut_inside_the_call_continues_to_the_same_calls(sim_factory, parser):
    """Every cut, the last ones inside the call's text: the partial has no call (an unfinished
    one is no call), the continuation's new text no whole one; the whole answer has it."""
    sim = sim_factory(time_scale=1000, reasoning_parser=parser, length_dist=f"fixed:{NATURAL}")
    body = body_with_tools()

    async def main() -> None:
        server = SGLang(sim.url, request_timeout=60)
        try:
            async def ask(b):
                return await server.chat(b, 0)

            want = await ask({**body, "max_tokens": NATURAL + 10})
            assert want.finish_reason == "tool_calls" and want.tool_calls
            ids = want.completion_token_ids
            raw = await server.detokenize(ids, False)
            assert raw.endswith(CALL + "<|im_end|>")
            inside = 0
            for cut in range(1, len(ids)):
                part = await ask({**body, "max_tokens": cut})
                seen = await server.detokenize(part.completion_token_ids, False)
                inside += "<tool_call>" in seen and "</tool_call>" not in seen
                got = await continue_answer(ask, request_of({**body, "max_tokens": NATURAL + 10}),
                                            partial_of(part), server)
                assert got is not None
                assert fields(got) == fields(want), f"cut at {cut}: {seen[-40:]!r}"
                assert orjson.loads(got.tool_calls[0]["function"]["arguments"]) == {"words": 3}
            assert inside >= 5
        finally:
            await server.close()

    asyncio.run(main())
