"""A row's tools are part of its prompt and an answer's tool calls part of its answer: rows with
`tools` and tool-call turns are sent whole, the calls the server parses out of an answer are
kept in its record (whole and streamed), and a row whose `tools` is malformed fails alone."""

from __future__ import annotations

import json

import orjson
import pytest
from conftest import genq
from pipeline import consume_to_the_end, read_jsonl

from genq.common.data.rows import _row_to_prompt
from genq.common.errors import BadTask

TOOLS = [{"type": "function", "function": {
    "name": "run_shell", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
# An agentic turn: the assistant called a tool (content null), the tool answered.
CONVERSATION = [
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "run_shell", "arguments": "{\"cmd\": \"ls\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py b.py"},
]


def test_rows_with_tools_and_tool_call_turns_are_prompts():
    prompt = _row_to_prompt(3, {"id": "t3", "messages": CONVERSATION, "tools": TOOLS})
    assert prompt.tools == TOOLS and prompt.messages == CONVERSATION
    empty = [*CONVERSATION[:1], {**CONVERSATION[1], "content": ""}, CONVERSATION[2]]
    assert _row_to_prompt(4, {"messages": empty}).tools is None
    with pytest.raises(BadTask, match=r"row 5: 'tools' is not a list of objects"):
        _row_to_prompt(5, {"messages": CONVERSATION, "tools": {"name": "run_shell"}})
    with pytest.raises(BadTask, match=r"row 6: 'messages'"):  # no content and no tool call
        _row_to_prompt(6, {"messages": [{"role": "assistant"}]})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_tools_reach_the_server_and_its_tool_calls_are_kept(
        mode, tmp_path, redis_url, run_name, sim_factory):
    data = tmp_path / "agentic.jsonl"
    rows = [{"id": "with-tools", "messages": CONVERSATION, "tools": TOOLS},
            {"id": "plain", "messages": [{"role": "user", "content": "Say hi."}]},
            {"id": "bad-tools", "messages": CONVERSATION, "tools": "run_shell"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sim = sim_factory(time_scale=400)
    # A high limit: every answer stops by itself, so the tool call is parsed out of it.
    genq("produce", str(data), "--once", "--max-tokens", "7000",
         redis_url=redis_url, run=run_name)
    flags = ["--stream"] if mode == "stream" else []
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out", *flags)
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), "--include-failed", redis_url=redis_url, run=run_name)
    records = read_jsonl(out)
    by_id = {rec["id"]: rec for rec in records if "id" in rec}
    called = by_id["with-tools"]
    # The simulator, like SGLang with --tool-call-parser, calls the request's first tool: the
    # tools were sent, and the call it made is in the record, not lost with the text.
    assert called["finish_reason"] == "tool_calls"
    (call,) = called["tool_calls"]
    assert call["function"]["name"] == "run_shell" and call["id"].startswith("call_")
    assert orjson.loads(call["function"]["arguments"])["words"] > 0
    assert by_id["plain"]["finish_reason"] == "stop" and "tool_calls" not in by_id["plain"]
    (failed,) = [rec for rec in records if rec["index"] == 2]
    assert "'tools' is not a list of objects" in json.dumps(failed)
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert status["done"] == 2 and status["failed"] == 1
    assert status["finish_reasons"]["tool_calls"] == 1


@pytest.mark.timeout(120)
def test_a_runs_tool_choice_goes_only_beside_tools(tmp_path, redis_url, run_name, sim_factory):
    """`--raw tool_choice=required` chooses among a row's tools; a server (SGLang, and the
    simulator as it) refuses it beside none, so neither a row without tools nor the consumer's
    own --token-ids probe may carry it."""
    data = tmp_path / "rows.jsonl"
    rows = [{"id": "with-tools", "messages": CONVERSATION, "tools": TOOLS},
            {"id": "plain", "messages": [{"role": "user", "content": "Say hi."}]}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sim = sim_factory(time_scale=400)
    genq("produce", str(data), "--once", "--max-tokens", "7000", "--token-ids",
         "--raw", "tool_choice=required", redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), "--include-failed", redis_url=redis_url, run=run_name)
    by_id = {rec["id"]: rec for rec in read_jsonl(out)}
    assert by_id["with-tools"]["finish_reason"] == "tool_calls"
    assert by_id["plain"]["finish_reason"] == "stop"
