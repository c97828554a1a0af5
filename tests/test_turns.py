"""`--turns last`: a row that ends with the data set's own assistant answer has that answer
generated anew, never answered after; its record says which assistant turn it is."""

from __future__ import annotations

import json

import orjson
import pytest
from conftest import genq
from pipeline import consume_to_the_end, read_jsonl

from genq.common.errors import UsageError
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys
from genq.common.turns import splice as turns
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
            {"id": "ends-with-tool", "messages": TWO_TURNS[:-1], "tools": TOOLS},
            {"id": "answer-alone", "messages": TWO_TURNS[-1:]}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sim = sim_factory(time_scale=400)
    genq("produce", str(data), "--once", "--max-tokens", "300", "--token-ids",
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    by_id = {rec["id"]: rec for rec in read_jsonl(out)}
    assert sorted(by_id) == ["ends-with-answer", "ends-with-tool"]
    # The prompt the server saw (its own prompt ids) is the conversation up to the tool's
    # result, in both rows: the trailing answer is not in it.
    expected = tokens.render(TWO_TURNS[:-1], TOOLS, thinking=True)
    for rec in by_id.values():
        assert rec["prompt_token_ids"] == expected
        assert "own answer" not in tokens.decode(rec["prompt_token_ids"])
        assert rec["turn"] == 2  # the second assistant turn of the row, made anew
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert status["turns"] == "last" and (status["done"], status["failed"]) == (2, 1)
    # A row of one assistant message has nothing to prompt with: it fails alone, saying so.
    (reason,) = status["failure_reasons"]
    assert reason["reason"] == ("row N: its only message is an assistant turn: there is no "
                                "prompt to make it anew from")  # status groups by reason
    assert (reason["count"], reason["example_index"]) == (1, 2)
    assert "turns last" in genq("status", redis_url=redis_url, run=run_name).stdout
    # Parquet types the turn; --format tokens (one line per generation) carries it too.
    import pyarrow.parquet as pq

    genq("export", "--out", str(tmp_path / "e.parquet"), redis_url=redis_url, run=run_name)
    assert pq.read_table(tmp_path / "e.parquet").column("turn").to_pylist() == [2, 2]
    lines = tmp_path / "tokens.jsonl"
    genq("export", "--out", str(lines), "--format", "tokens", redis_url=redis_url, run=run_name)
    assert [line["turn"] for line in read_jsonl(lines)] == [2, 2]


def test_turns_all_with_a_schema_is_refused_in_one_line_and_a_run_keeps_its_turns(
        tmp_path, redis_url, r, run_name):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"messages": TWO_TURNS}) + "\n")
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    proc = genq("produce", str(data), "--once", "--turns", "all", "--schema", str(schema),
                redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--schema with --turns all" in proc.stderr
    assert not r.exists(RunKeys(run_name).meta)  # refused before anything was registered
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    # The setting is the run's: registering it again with other turns is refused.
    k = RunKeys(run_name)
    info = runs.load(r, k)
    assert info.turns == runs.LAST
    with pytest.raises(UsageError, match="makes --turns last, not all"):
        runs.register(r, k, str(data), info.fingerprint, 1, turns=runs.ALL)


def regenerated(content: str | None, *calls: str) -> dict:
    """An assistant turn as the model made it, calling these tools."""
    return {"role": "assistant", "content": content, "reasoning_content": "thought",
            "tool_calls": [{"id": f"call_{n}", "type": "function",
                            "function": {"name": name, "arguments": "{}"}}
                           for n, name in enumerate(calls)] or None}


# The row's result for the call, as it follows the regenerated call: with that call's id and name.
ANSWERED = {**TWO_TURNS[3], "tool_call_id": "call_0", "name": "run_shell"}


def test_turns_are_the_assistant_messages_and_each_prompt_is_what_comes_before():
    assert turns.assistant_turns(TWO_TURNS) == [2, 4]
    assert turns.prompt(TWO_TURNS, 1, []) == TWO_TURNS[:2]
    made = regenerated(None, "run_shell")
    # Turn 2 is given the regenerated turn 1, with the row's tool result after it.
    assert turns.prompt(TWO_TURNS, 2, [made]) == [*TWO_TURNS[:2], made, ANSWERED]
    assert turns.prompt(TWO_TURNS, 3, [made, TWO_TURNS[4]]) == [
        *TWO_TURNS[:2], made, ANSWERED, TWO_TURNS[4]]
    with pytest.raises(ValueError, match="turn 2 needs the 1 turns before it, not 0"):
        turns.prompt(TWO_TURNS, 2, [])


def test_last_drops_a_trailing_assistant_turn_and_answers_anything_else_whole():
    assert turns.last(TWO_TURNS) == (TWO_TURNS[:-1], 2)
    assert turns.last(TWO_TURNS[:-1]) == (TWO_TURNS[:-1], 2)
    assert turns.last(TWO_TURNS[:3]) == (TWO_TURNS[:2], 1)
    follow_up = [*TWO_TURNS, {"role": "user", "content": "And tests?"}]
    assert turns.last(follow_up) == (follow_up, 3)
    assert turns.last(TWO_TURNS[:2]) == (TWO_TURNS[:2], 1)


def test_the_rows_tool_results_follow_a_turn_that_calls_the_same_tools_else_it_stops():
    assert turns.after(TWO_TURNS, 1, "tool_calls", regenerated(None, "run_shell")["tool_calls"]
                       ) == [ANSWERED]
    assert turns.after(TWO_TURNS, 2, "stop", None) == []  # the last turn: nothing follows
    assert turns.after(TWO_TURNS, 1, "length", None) == turns.Stop(
        turns.TRUNCATED, "turn 1 reached max_tokens")
    assert turns.after(TWO_TURNS, 1, "stop", None) == turns.Stop(
        turns.DIVERGED, "turn 1 called no tool; the row's called run_shell × 1")
    twice = regenerated(None, "run_shell", "run_shell")["tool_calls"]
    assert turns.after(TWO_TURNS, 1, "tool_calls", twice) == turns.Stop(
        turns.DIVERGED, "turn 1 called run_shell × 2; the row's called run_shell × 1")
    other = regenerated(None, "read_file")["tool_calls"]
    assert turns.after(TWO_TURNS, 1, "tool_calls", other).reason == turns.DIVERGED
    assert turns.after(TWO_TURNS, 2, "tool_calls", other) == turns.Stop(
        turns.DIVERGED, "turn 2 called read_file × 1; the row's called no tool")


def test_a_made_call_the_server_would_not_take_back_stops_the_conversation():
    """SGLang refuses an assistant turn whose call's arguments are no JSON object in the next
    prompt ("function.arguments must be a JSON object"; a named tool_choice without `strict`
    writes `""`): the conversation stops at that turn, diverged, rather than fail the row at the
    next (docs/SGLANG.md)."""
    for arguments in ('""', "[1]", "{not json", None):
        made = regenerated(None, "run_shell")["tool_calls"]
        made[0]["function"]["arguments"] = arguments
        assert turns.after(TWO_TURNS, 1, "tool_calls", made) == turns.Stop(
            turns.DIVERGED, "turn 1 called run_shell with arguments that are not a JSON object")


def test_calls_of_one_name_get_the_result_of_the_row_call_with_their_arguments() -> None:
    """Among calls of one name: the same arguments where they match, else in order; a result
    names the call it answers by id, whatever order the row lists the results in."""
    def read(path: str, id_: str) -> dict:
        return {"id": id_, "type": "function",
                "function": {"name": "run_shell", "arguments": json.dumps({"cmd": path})}}

    row = [{"role": "user", "content": "Look."},
           {"role": "assistant", "content": None,
            "tool_calls": [read("ls", "r1"), read("pwd", "r2"), read("date", "r3")]},
           {"role": "tool", "tool_call_id": "r2", "content": "/home"},
           {"role": "tool", "tool_call_id": "r1", "content": "a.py"},
           {"role": "tool", "tool_call_id": "r3", "content": "Sunday"},
           {"role": "assistant", "content": "Done."}]
    made = [read("pwd", "m1"), read("cat x", "m2"), read("ls", "m3")]
    spliced = turns.after(row, 1, "tool_calls", made)
    assert [(m["tool_call_id"], m["name"], m["content"]) for m in spliced] == [
        ("m1", "run_shell", "/home"), ("m2", "run_shell", "Sunday"), ("m3", "run_shell", "a.py")]
    made_turn = {"role": "assistant", "content": None, "tool_calls": made}
    assert turns.prompt(row, 2, [made_turn]) == [row[0], made_turn, *spliced]
    # Three calls, one result: a made call whose row call has no result stops there.
    stop = turns.after(row[:3] + row[5:], 1, "tool_calls", made)
    assert stop == turns.Stop("unanswered", "turn 1 called run_shell; the row has no result "
                                            "for it")


def test_how_a_conversation_ended_reads_the_same_in_a_bitfield_an_older_genq_wrote() -> None:
    """conv_end had 2 bits for complete/diverged/truncated above a 14-bit turn; `unanswered`
    took a third bit, and the old values keep their meaning."""
    from genq.common.turns.state import END_NAMES, TURN_BITS, Standing

    for code, end in ((1, "complete"), (2, "diverged"), (3, "truncated")):
        old = code << 14 | 7
        assert Standing(end=end, last=7).ended() == old
        assert (END_NAMES[old >> TURN_BITS], old & ((1 << TURN_BITS) - 1)) == (end, 7)
    ended = Standing(end="unanswered", last=7).ended()
    assert END_NAMES[ended >> TURN_BITS] == "unanswered" and ended & 0x1FFF == 7


def test_a_prompt_extended_turn_by_turn_is_the_one_spliced_from_the_row() -> None:
    """The consumer extends each turn's prompt from the one before (splice.extend) rather than
    splicing every made turn again: the same prompt as splice.prompt's, on rows with tool
    chains, several calls a turn, results not right after their turn, and a trailing user
    message."""
    def call(name: str, id_: str) -> dict:
        return {"id": id_, "type": "function",
                "function": {"name": name, "arguments": json.dumps({"cmd": id_})}}

    row = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
           {"role": "assistant", "content": None, "tool_calls": [call("run_shell", "a")]},
           {"role": "tool", "tool_call_id": "a", "content": "ra"},
           {"role": "assistant", "content": None,
            "tool_calls": [call("run_shell", "b"), call("read_file", "c")]},
           {"role": "tool", "tool_call_id": "c", "content": "rc"},
           {"role": "tool", "tool_call_id": "b", "content": "rb"},
           {"role": "user", "content": "u2"},
           {"role": "assistant", "content": "done"}, {"role": "user", "content": "u3"}]
    made: list[dict] = []
    before = turns.prompt(row, 1, [])
    for turn in range(1, turns.count(row)):
        asked = row[turns.assistant_turns(row)[turn - 1]].get("tool_calls") or []
        calls = [call(c["function"]["name"], f"m{turn}{n}") for n, c in enumerate(asked)]
        message = {"role": "assistant", "content": f"made {turn}",
                   **({"tool_calls": calls} if calls else {})}
        follow = turns.after(row, turn, "tool_calls" if calls else "stop", calls or None)
        assert isinstance(follow, list)
        before = turns.extend(row, turn, before, message, follow)
        made.append(message)
        assert before == turns.prompt(row, turn + 1, made)
