"""`--turns last`: a row that ends with the data set's own assistant answer has that answer
generated anew, never answered after; its record says which assistant turn it is."""

from __future__ import annotations

import json

import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl

from genq.simulator import tokens

TOOLS = [{"type": "function", "function": {
    "name": "run_shell", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "run_shell", "arguments": "{\"cmd\": \"ls\"}"}}
# Two assistant turns: a tool call, then the data set's own final answer.
TWO_TURNS = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py b.py"},
    {"role": "assistant", "content": "The data set's own answer: a.py and b.py."},
]


@pytest.mark.timeout(120)
def test_a_trailing_assistant_answer_is_regenerated_not_answered_after(
        tmp_path, redis_url, run_name, sim_factory):
    data = tmp_path / "conversations.jsonl"
    rows = [{"id": "ends-with-answer", "messages": TWO_TURNS, "tools": TOOLS},
            {"id": "ends-with-tool", "messages": TWO_TURNS[:-1], "tools": TOOLS}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sim = sim_factory(time_scale=400)
    genq("produce", str(data), "--once", "--max-tokens", "300", "--token-ids",
         redis_url=redis_url, run=run_name)
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--burst")
    try:
        assert consumer.wait(90) == 0, consumer.log()[-3000:]
    finally:
        consumer.cleanup()
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    by_id = {rec["id"]: rec for rec in read_jsonl(out)}
    # The prompt the server saw (its own prompt ids) is the conversation up to the tool's
    # result, in both rows: the trailing answer is not in it.
    expected = tokens.render(TWO_TURNS[:-1], TOOLS, thinking=True)
    for rec in by_id.values():
        assert rec["prompt_token_ids"] == expected
        assert "own answer" not in tokens.decode(rec["prompt_token_ids"])
        assert rec["turn"] == 2  # the second assistant turn of the row, made anew
