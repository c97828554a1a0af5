"""`--tool-chains`: an answer to a request with tools calls its first tool while the tool
results after the last user message number fewer than `chain_length(that message, --seed)`,
then answers in text, as an agent closes a chain with its final answer; a new user message
starts a new chain."""

from __future__ import annotations

import httpx
from test_simulator import FAST

from genq.simulator.toolcalls import CHAIN_MAX, chain_length

pytest_plugins = ["sim_fixtures"]

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {}}},
         {"type": "function", "function": {"name": "write_file", "parameters": {}}}]
REQUESTS = [f"Request {i}: find the bug in module {i} and fix it." for i in range(12)]


def answer(url: str, messages: list[dict]) -> dict:
    body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 200}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10).json()["choices"][0]


def results(n: int) -> list[dict]:
    """n tool turns: a call and its result each."""
    out: list[dict] = []
    for i in range(n):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": "{}"}}
        out += [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i}"}]
    return out


def test_chain_length_is_a_pure_draw_of_the_text_and_seed() -> None:
    lengths = [chain_length(text, 0) for text in REQUESTS * 20]
    assert lengths == [chain_length(text, 0) for text in REQUESTS * 20]
    assert [chain_length(t, 1) for t in REQUESTS] != lengths[:len(REQUESTS)]
    many = [chain_length(f"request {i}", 0) for i in range(2000)]
    assert min(many) == 1 and max(many) <= CHAIN_MAX and 1.5 < sorted(many)[1000] < 3.5


def test_calls_until_the_chain_length_then_answers_in_text(sim_factory) -> None:
    sim = sim_factory(**FAST, tool_chains=True, seed=5)
    for text in REQUESTS:
        head = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": text}]
        length = chain_length(text, 5)
        for done in range(length + 1):
            choice = answer(sim.url, head + results(done))
            if done < length:
                assert choice["finish_reason"] == "tool_calls", (text, done, length)
                assert choice["message"]["tool_calls"][0]["function"]["name"] == "read_file"
            else:  # the chain is as long as the request's: the final answer, in text
                assert choice["finish_reason"] == "stop" and not choice["message"]["tool_calls"]
                assert choice["message"]["content"]
        # The next request counts its own chain from its own message.
        again = head + results(length) + [{"role": "assistant", "content": "Fixed."},
                                          {"role": "user", "content": REQUESTS[0]}]
        first = chain_length(REQUESTS[0], 5)
        assert answer(sim.url, again)["finish_reason"] == "tool_calls"
        assert answer(sim.url, again + results(first))["finish_reason"] == "stop"


def test_parallel_calls_call_every_tool_the_last_first(sim_factory) -> None:
    sim = sim_factory(**FAST, parallel_calls=True)
    choice = answer(sim.url, [{"role": "user", "content": REQUESTS[0]}])
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["write_file", "read_file"]
    assert len({c["id"] for c in calls}) == 2
