"""`genq requeue --redo truncated --continue` in a run that keeps token ids: the partial's ids
go back as chat `input_ids` after the prompt's, and the whole answer (ids, tokens, and its
text split into thinking and content) is the one the prompt gets straight at the larger limit,
wherever the partial was cut: inside the thinking, on `</think>`, after it. On the simulator,
with and without a reasoning parser; the real tier's run is in test_continue_ids_sglang.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, request_of, write_dataset

from genq.common import params
from genq.common.queue.keys import RunKeys
from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import continuable, continue_answer, retexted
from genq.common.task import request_body

NATURAL = 40  # every answer: 27 thinking ids (`<think>` first), `</think>` at 27, then content
CLOSE = int(NATURAL * 0.7) - 1


def partial_of(c, version: int = 1) -> dict:
    """A truncated answer's record fields, as the requeue keeps them."""
    return {"reasoning_content": c.reasoning_content, "content": c.content,
            "completion_tokens": c.completion_tokens, "prompt_tokens": c.prompt_tokens,
            "params_version": version, "attempt": 1, "finish_reason": c.finish_reason,
            "prompt_token_ids": c.prompt_token_ids, "completion_token_ids": c.completion_token_ids}


@pytest.mark.parametrize("parser", ["qwen3", None])
def test_continued_by_ids_is_the_straight_answer_wherever_cut(sim_factory, parser):
    sim = sim_factory(time_scale=1000, reasoning_parser=parser, length_dist=f"fixed:{NATURAL}")
    body = request_body([{"role": "user", "content": "Write a poem."}],
                        {**params.DEFAULTS, "return_token_ids": True}, "m")

    async def main() -> None:
        server = SGLang(sim.url, request_timeout=60)
        try:
            async def ask(b):
                return await server.chat(b, 0)

            straight = {limit: await ask({**body, "max_tokens": limit})
                        for limit in (NATURAL - 5, NATURAL + 10)}
            for cut in range(1, NATURAL - 5):
                part = await ask({**body, "max_tokens": cut})
                assert part.finish_reason == "length" and continuable(partial_of(part))
                for limit, want in straight.items():
                    got = await continue_answer(ask, request_of({**body, "max_tokens": limit}),
                                                partial_of(part), server)
                    assert got is not None
                    where = f"cut at {cut} (</think> at {CLOSE}), limit {limit}"
                    assert got.completion_token_ids == want.completion_token_ids, where
                    assert got.prompt_token_ids == want.prompt_token_ids, where
                    assert (got.reasoning_content, got.content, got.completion_tokens,
                            got.finish_reason) == (want.reasoning_content, want.content,
                                                   want.completion_tokens,
                                                   want.finish_reason), where
                    assert got.continued_from == {"version": 1, "attempt": 1, "tokens": cut}
        finally:
            await server.close()

    asyncio.run(main())


def test_a_run_with_ids_continues_by_them(tmp_path, redis_url, r, run_name, sim_factory):
    """Through the requeue and a consumer at its normal concurrency; some answers were cut
    inside their thinking, some after `</think>`."""
    n, small, large = 120, 400, 1200
    data = write_dataset(tmp_path / "d.jsonl", n)
    runs = {"cont": run_name, "straight": run_name + "-straight"}
    sim = sim_factory(time_scale=1000, reasoning_parser="qwen3",
                      length_dist="lognormal:300:0.8")
    for run, limit in ((runs["cont"], small), (runs["straight"], large)):
        genq("produce", str(data), "--once", "--token-ids", "--max-tokens", str(limit),
             redis_url=redis_url, run=run)
        consumer = ConsumerProcess(redis_url, run, sim.url, tmp_path / run, "--burst")
        assert consumer.wait(120) == 0, consumer.log()[-2000:]
        consumer.cleanup()

    def export(run):
        out = tmp_path / f"{run}.jsonl"
        genq("export", "--out", str(out), redis_url=redis_url, run=run)
        return {rec["index"]: rec for rec in read_jsonl(out)}

    first = export(runs["cont"])
    cut = {i for i, rec in first.items() if rec["finish_reason"] == "length"}
    inside = {i for i in cut if not first[i]["content"]}
    assert len(inside) >= 5 and len(cut - inside) >= 5  # cut inside the thinking, and after
    out = genq("requeue", "--set", f"max_tokens={large}", "--redo", "truncated", "--continue",
               redis_url=redis_url, run=runs["cont"]).stdout
    assert f"partials kept for --continue: {len(cut)}" in out
    consumer = ConsumerProcess(redis_url, runs["cont"], sim.url, tmp_path / "again", "--burst")
    assert consumer.wait(120) == 0, consumer.log()[-2000:]
    consumer.cleanup()
    cont, straight = export(runs["cont"]), export(runs["straight"])
    for i in cut:
        old, new, want = first[i], cont[i], straight[i]
        assert new["completion_token_ids"][:small] == old["completion_token_ids"]
        assert new["continued_from"]["tokens"] == small
        for key in ("prompt_token_ids", "completion_token_ids", "completion_tokens",
                    "reasoning_content", "content", "finish_reason"):
            assert new[key] == want[key], (i, key)
    assert r.exists(RunKeys(runs["cont"]).partials) == 0
    st = orjson.loads(genq("status", "--json", redis_url=redis_url, run=runs["cont"]).stdout)
    assert st["continued"] == {"2": {"continued": len(cut),
                                     "decode_tokens_saved": small * len(cut)}}


TOOLS = [{"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}]


def body_with_tools(tools=TOOLS) -> dict:
    return request_body([{"role": "user", "content": "Count the words."}],
                        {**params.DEFAULTS, "return_token_ids": True}, "m", tools=tools)


def fields(c) -> tuple:
    """What a record keeps of an answer; a tool call's id is the server's fresh one each time."""
    calls = [{**call, "id": None} for call in c.tool_calls or ()]
    return (c.reasoning_content, c.content, calls, c.prompt_token_ids, c.completion_token_ids,
            c.completion_tokens, c.finish_reason)


@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("parser", ["qwen3", None])
def test_continued_answer_with_tools_is_the_straight_one(sim_factory, parser, tools):
    """A row with tools: the server keeps special tokens in its text and trims the matched stop
    token from it; the continued answer's text, calls, ids and finish are the straight ones,
    cut inside the thinking, on `</think>`, after it."""
    sim = sim_factory(time_scale=1000, reasoning_parser=parser, length_dist=f"fixed:{NATURAL}")
    body = body_with_tools(tools)

    async def main() -> None:
        server = SGLang(sim.url, request_timeout=60)
        try:
            async def ask(b):
                return await server.chat(b, 0)

            want = await ask({**body, "max_tokens": NATURAL + 10})
            assert want.finish_reason == ("tool_calls" if tools else "stop")
            for cut in range(1, NATURAL - 1):
                part = await ask({**body, "max_tokens": cut})
                got = await continue_answer(ask, request_of({**body, "max_tokens": NATURAL + 10}),
                                            partial_of(part), server)
                assert got is not None
                assert fields(got) == fields(want), f"cut at {cut} (</think> at {CLOSE})"
        finally:
            await server.close()

    asyncio.run(main())


def test_text_made_again_ends_where_a_stop_string_matched(sim_factory):
    """SGLang cuts its text at the first match of a `stop` string (the ids run on past it);
    the simulator stops on its end token only, so the server's match is given here."""
    sim = sim_factory(time_scale=1000, reasoning_parser="qwen3", length_dist=f"fixed:{NATURAL}")
    body = request_body([{"role": "user", "content": "Write a poem."}],
                        {**params.DEFAULTS, "return_token_ids": True}, "m")

    async def main() -> None:
        server = SGLang(sim.url, request_timeout=60)
        try:
            whole = await server.chat({**body, "max_tokens": NATURAL}, 0)
            again = await retexted(replace(whole, matched_stop=" ok"), body, server)
            assert whole.content.count(" ok") > 1
            assert again.content == whole.content[:whole.content.index(" ok")]
            assert again.reasoning_content == whole.reasoning_content
        finally:
            await server.close()

    asyncio.run(main())


def test_a_continued_answer_says_the_whole_budget_it_had(sim_factory):
    """`max_tokens` lowered to fit the context: the continued answer's `max_tokens_used` is the
    straight answer's (the partial's tokens and the continuation's room), not the room alone."""
    body = request_body([{"role": "user", "content": "Write a poem."}],
                        {**params.DEFAULTS, "return_token_ids": True}, "m")

    async def answers(url: str, limit: int, cut: int):
        server = SGLang(url, request_timeout=60)
        try:
            async def ask(b):
                return await server.chat(b, 0)

            part = await ask({**body, "max_tokens": cut})
            whole = await continue_answer(ask, request_of({**body, "max_tokens": limit}),
                                          partial_of(part), server)
            return part, whole, await ask({**body, "max_tokens": limit})
        finally:
            await server.close()

    probe = sim_factory(time_scale=1000, length_dist=f"fixed:{NATURAL}")
    prompt = asyncio.run(answers(probe.url, NATURAL, 5))[0].prompt_tokens
    sim = sim_factory(time_scale=1000, length_dist=f"fixed:{NATURAL}",
                      context_length=prompt + NATURAL + 3)
    part, whole, want = asyncio.run(answers(sim.url, 4 * NATURAL, 10))
    assert want.max_tokens == NATURAL + 3 and whole is not None
    assert (whole.max_tokens, whole.completion_token_ids) == (want.max_tokens,
                                                              want.completion_token_ids)


NAMED = {"type": "function", "function": {"name": "count"}}


@pytest.mark.parametrize("grammar", [
    {"tool_choice": NAMED}, {"tool_choice": "required"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
    {"regex": "[a-z]+"}])
def test_an_answer_under_a_grammar_is_not_continued_by_ids(sim_factory, grammar):
    """A forced call, a response_format or a raw grammar holds the answer from its first token:
    sent `input_ids`, SGLang starts the grammar again after the partial (a second `<tool_call>`
    inside a cut one, on the real tier: test_conversations_sglang.py), so such an answer is
    generated again (None), and nothing is asked; a tool_choice that forces nothing continues."""
    sim = sim_factory(time_scale=1000, length_dist=f"fixed:{NATURAL}")
    body = body_with_tools()
    asked: list[dict] = []

    async def main() -> None:
        server = SGLang(sim.url, request_timeout=60)
        try:
            async def ask(b):
                asked.append(b)
                return await server.chat(b, 0)

            part = partial_of(await ask({**body, "max_tokens": 10}))
            asked.clear()
            whole = {**body, "max_tokens": NATURAL + 10}
            assert await continue_answer(ask, request_of({**whole, **grammar}), part,
                                         server) is None
            assert not asked
            got = await continue_answer(ask, request_of({**whole, "tool_choice": "auto"}), part,
                                        server)
            assert got is not None and len(asked) == 1
        finally:
            await server.close()

    asyncio.run(main())
