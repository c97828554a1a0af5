"""`--tool-call-rate R`: an answer to a request with tools calls its first tool with
probability R, else answers in text; the same request (prompt ids, seeds) decides the same way
every time, whole or streamed."""

from __future__ import annotations

import orjson
import pytest
from test_simulator import FAST, chat
from test_simulator_v05 import stream

pytest_plugins = ["sim_fixtures"]

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {}}},
         {"type": "function", "function": {"name": "write_file", "parameters": {}}}]
RATE = 0.5
PROMPTS = [f"Task number {i}: fix the bug." for i in range(100)]


def _calls(url: str, **body) -> list[bool]:
    called = []
    for text in PROMPTS:
        choice = chat(url, text, tools=TOOLS, **body).json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert (choice["finish_reason"] == "tool_calls") == bool(calls)
        if calls:
            (call,) = calls
            assert call["function"]["name"] == "read_file"  # the request's first tool
            assert isinstance(orjson.loads(call["function"]["arguments"]), dict)
        else:
            assert choice["finish_reason"] == "stop" and choice["message"]["content"]
        called.append(bool(calls))
    return called


@pytest.mark.slow  # a statistical sample
def test_a_share_of_requests_with_tools_call_one_and_the_same_request_decides_alike(sim_factory):
    sim = sim_factory(**FAST, tool_call_rate=RATE)
    called = _calls(sim.url)
    # 100 draws at 0.5: three standard deviations (0.15) either side.
    assert abs(sum(called) / len(called) - RATE) < 0.15
    assert _calls(sim.url) == called  # the prompt's ids decide, not the moment
    assert _calls(sim.url, seed=7) != called  # the request's seed takes part in the draw
    again = sim_factory(**FAST, tool_call_rate=RATE)
    assert _calls(again.url) == called  # and the same on another server with the same --seed
    # A streamed answer decides as the whole one and streams the call as SGLang does.
    text = PROMPTS[called.index(True)]
    _, events = stream(sim.url, text, tools=TOOLS)
    deltas = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert any(d["delta"].get("tool_calls") for d in deltas)
    _, events = stream(sim.url, PROMPTS[called.index(False)], tools=TOOLS)
    finish = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict)
              and e["choices"]]
    assert finish[-1] == "stop"


@pytest.mark.slow  # a statistical sample
def test_rate_zero_never_calls_and_the_default_always_does(sim_factory):
    assert not any(_calls(sim_factory(**FAST, tool_call_rate=0).url))
    assert all(_calls(sim_factory(**FAST).url))


def test_a_call_decodes_as_written_after_a_prompt_piece_with_the_same_id(sim_factory):
    """The toy tokenizer hashes pieces it does not know into ids: " word23" and the call's
    " 2458}}" (arguments {"words": 2458}) share one. A prompt seen first must not turn the
    call's text into its own word (the call would no longer parse: no call, content "")."""
    sim = sim_factory(**FAST)
    assert chat(sim.url, "say word23").status_code == 200
    choice = chat(sim.url, " ".join(["word"] * 2458), tools=TOOLS).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert orjson.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "words": 2458}
