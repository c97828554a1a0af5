"""`--turns all` on messy rows, as people's logs hold them: a row genq cannot make a prompt of
fails alone at its first claim, naming its fault (message and field), before it costs a request;
it never crashes or stalls a consumer, nor touches the conversations beside it. A call the row
has no result for stops the conversation there; one whose last made turn calls says so."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, consume_to_the_end, read_jsonl
from test_conversations import TOOLS, by_conversation, call, check_chains, conversation, export

from genq.common.queue.keys import RunKeys
from genq.common.queue.run import failure_reasons
from genq.simulator import tokens

HEAD = [{"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Read f1.py and fix it."}]
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "def parse_1(text): ..."}
CALLS = {"role": "assistant", "content": None, "tool_calls": [call(1)]}
DONE = {"role": "assistant", "content": "Fixed."}
BAD_ARGS = {**call(1), "function": {"name": "read_file", "arguments": "{path: f1.py"}}

# Each broken row, with the words its failure must hold (the message index, the field).
BROKEN = {
    "calls-object": ([*HEAD, {**CALLS, "tool_calls": call(1)}, RESULT, DONE],
                     "message 2: 'tool_calls' is an object, not a list"),
    "orphan-result": ([*HEAD, RESULT, DONE],
                      "message 2: a tool result with no call before it to answer"),
    "unknown-role": ([*HEAD, {"role": "observation", "content": "ls: a.py"}, DONE],
                     "message 2: unknown role 'observation'"),
    "args-not-json": ([*HEAD, {**CALLS, "tool_calls": [BAD_ARGS]}, RESULT, DONE],
                      "message 2: tool_calls[0].function.arguments is not a JSON object"),
    "no-tools": ([*HEAD, CALLS, RESULT, DONE], "message 2 calls tools but the row has no 'tools'"),
}
# A call the row never answered, then more turns: the conversation stops at that call.
UNANSWERED = [*HEAD, CALLS, {"role": "user", "content": "Go on."}, DONE]


def write(path: Path, good: int) -> tuple[Path, dict[int, tuple[str, str]], list[list[dict]]]:
    """The good conversations with a broken row after every other one, then a row whose last
    turn the model makes as a call (it always calls), and the unanswered row last: (data set,
    broken rows by index -> (name, words), every row's messages)."""
    lines: list[dict] = []
    broken: dict[int, tuple[str, str]] = {}
    names = iter(BROKEN)
    for i in range(good):
        lines.append({"id": f"c{i}", "messages": conversation(i), "tools": TOOLS})
        if i % 2 and (name := next(names, None)):
            messages, words = BROKEN[name]
            broken[len(lines)] = (name, words)
            lines.append({"id": name, "messages": messages,
                          **({} if name == "no-tools" else {"tools": TOOLS})})
    lines.append({"id": "ends-on-call", "messages": [*HEAD, CALLS, RESULT, DONE], "tools": TOOLS})
    lines.append({"id": "unanswered", "messages": UNANSWERED, "tools": TOOLS})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, broken, [line["messages"] for line in lines]


@pytest.mark.timeout(180)
def test_each_broken_row_fails_alone_naming_its_fault_beside_good_conversations(
        tmp_path, redis_url, r, run_name, sim_factory):
    data, broken, rows = write(tmp_path / "messy.jsonl", good=12)
    assert len(broken) == len(BROKEN)
    sim = sim_factory(time_scale=100, length_dist="fixed:20")
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "100", "--token-ids",
         redis_url=redis_url, run=run_name)
    consumers = [ConsumerProcess(redis_url, run_name, sim.url, tmp_path / name, "--burst",
                                 "--visibility-timeout", "5") for name in ("a", "b")]
    try:
        for consumer in consumers:
            assert consumer.wait(120) == 0, consumer.log()[-3000:]
        logs = [consumer.log() for consumer in consumers]
    finally:
        for consumer in consumers:
            consumer.cleanup()
    assert not any("Traceback" in log for log in logs), [log[-3000:] for log in logs]

    k = RunKeys(run_name)
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert (status["done"], status["failed"]) == (len(rows) - len(broken), len(broken))
    # Each broken row failed once, at its first claim, with its own reason; never a request.
    failed = [rec for name in ("a", "b") for path in (tmp_path / name).glob("*.jsonl")
              for rec in read_jsonl(path) if rec.get("status") == "failed"]
    assert sorted(rec["index"] for rec in failed) == sorted(broken)
    for rec in failed:
        name, words = broken[rec["index"]]
        assert rec["id"] == name and words in rec["error"], rec
        assert rec["attempt"] == 1, rec
    for index, reason in zip(broken, failure_reasons(r, k, list(broken)), strict=True):
        assert reason.startswith("row N: message N"), (broken[index], reason)
    # Every good conversation whole: turns 1..m once, each made from the turns before it.
    records = export(tmp_path, redis_url, run_name, "all.jsonl")
    good = [i for i in range(len(rows)) if i not in broken]
    chains = by_conversation(records)
    assert sorted(chains) == good
    check_chains(rows, records, only=good)
    # The unanswered call: its turn is made (the model called read_file as the row did), then
    # the conversation stops there, as a divergence does.
    (last,) = chains[len(rows) - 1]
    assert (last["turn"], last["ended"], last["stopped"]) == (1, "unanswered", "unanswered")
    assert last["stopped_detail"] == "turn 1 called read_file; the row has no result for it"
    # The simulator calls whenever it may: a conversation that reached its row's last turn
    # ended on a call no one answers, and says so; status counts both.
    first, last = chains[len(rows) - 2]
    assert "tool_calls" in first and (last["turn"], last["ended"]) == (2, "unanswered")
    assert "stopped" not in last and last["tool_calls"]
    ends = [chain[-1]["ended"] for chain in chains.values()]
    assert "complete" not in ends and ends.count("unanswered") >= 2, ends
    assert status["conversations"]["stopped"]["unanswered"] == ends.count("unanswered")


@pytest.mark.parametrize("turns", ["all", "last"])
def test_produce_refuses_tools_not_in_the_openai_function_shape_in_one_line(
        tmp_path, redis_url, r, run_name, turns):
    """A benchmark's raw function docs as `tools` ({name, description, parameters}, no
    {type: function, function: ...}): the server would refuse every row, mid-run."""
    raw = [{"name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    data = tmp_path / "bench.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "tools": raw, "messages": [
        {"role": "user", "content": f"The weather in city {i}?"}]}) + "\n" for i in range(5)))
    refused = genq("produce", str(data), "--once", "--turns", turns, redis_url=redis_url,
                   run=run_name, check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "row 0: 'tools'[0] is not an OpenAI function tool" in refused.stderr, refused.stderr
    assert not r.exists(RunKeys(run_name).meta)  # nothing registered


def test_parallel_calls_made_in_another_order_get_their_own_results_and_ids(
        tmp_path, redis_url, run_name, sim_factory):
    """The row calls read_file then write_file at once; the model calls write_file first. Each
    made call gets the result of the row's call of its name, with the made call's id."""
    read = {"id": "row_r", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "f1.py"}'}}
    wrote = {"id": "row_w", "type": "function",
             "function": {"name": "write_file", "arguments": '{"path": "f2.py"}'}}
    messages = [*HEAD, {"role": "assistant", "content": None, "tool_calls": [read, wrote]},
                {"role": "tool", "tool_call_id": "row_r", "content": "the text of f1.py"},
                {"role": "tool", "tool_call_id": "row_w", "content": "wrote f2.py"},
                DONE]
    data = tmp_path / "parallel.jsonl"
    data.write_text(json.dumps({"id": "p", "messages": messages, "tools": TOOLS}) + "\n")
    sim = sim_factory(time_scale=200, length_dist="fixed:20", parallel_calls=True)
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "100", "--token-ids",
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    first, second = by_conversation(export(tmp_path, redis_url, run_name, "all.jsonl"))[0]
    made = first["tool_calls"]
    assert [c["function"]["name"] for c in made] == ["write_file", "read_file"]
    spliced = [{"role": "tool", "tool_call_id": made[0]["id"], "name": "write_file",
                "content": "wrote f2.py"},
               {"role": "tool", "tool_call_id": made[1]["id"], "name": "read_file",
                "content": "the text of f1.py"}]
    # The server was asked turn 2 with each result after its own call...
    turn1 = {"role": "assistant", "content": first["content"],
             "reasoning_content": first["reasoning_content"], "tool_calls": made}
    assert second["prompt_token_ids"] == tokens.render([*HEAD, turn1, *spliced], TOOLS,
                                                       thinking=True)
    # ... and the conversation export holds them with the model's ids and the tools' names.
    (row,) = export(tmp_path, redis_url, run_name, "conv.jsonl", "--format", "conversations")
    assert row["conversations"][3:5] == spliced
