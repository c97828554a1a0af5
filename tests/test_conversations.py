"""`--turns all`: every assistant turn of a row's conversation made anew, in order, each given the
turns made before it; a kill costs only the turns in flight, and a redo of truncated
conversations asks no earlier turn again."""

from __future__ import annotations

import json
import re

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, wait_for

from genq.common.queue.keys import RunKeys
from genq.simulator import tokens
from genq.turns import splice

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


PROBE = 1  # the request a consumer of a --token-ids run sends at its start (does it get ids?)


def call(n: int) -> dict:
    return {"id": f"call_{n}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{n}.py"})}}


def conversation(i: int) -> list[dict]:
    """A system prompt, a request answered after a chain of 0-2 tool calls, a follow-up request
    answered after 0-1 more: 2 to 5 assistant turns."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix bug number {i} in the parser."}]
    n = 0
    for chain, ask in ((i % 3, None), (i % 2, f"Now add a test for bug {i}.")):
        if ask:
            messages.append({"role": "user", "content": ask})
        for _ in range(chain):
            n += 1
            messages += [{"role": "assistant", "content": None, "tool_calls": [call(n)]},
                         {"role": "tool", "tool_call_id": f"call_{n}",
                          "content": f"def parse_{n}(text): ..."}]
        messages.append({"role": "assistant", "content": f"The data set's answer {n}."})
    return messages


def requests_served(*sims) -> int:
    total = 0
    for sim in sims:
        text = httpx.get(sim.url + "/metrics", timeout=5).text
        total += int(float(re.search(r"^sglang:num_requests_total\S* (\S+)$", text,
                                     re.M).group(1)))
    return total


def midway(r, k: RunKeys, server: str) -> list[int]:
    """Conversations with turns recorded, their last not made yet, leased on `server`."""
    out = []
    for task, raw in r.hgetall(k.conv).items():
        owner = r.hget(k.lease_owner, k.job_id(int(task)))  # "exec|server|version|attempt"
        if orjson.loads(raw)["made"] and owner and f"|{server}" in owner.decode():
            out.append(int(task))
    return out


def by_conversation(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rec in records:
        out.setdefault(rec["index"], []).append(rec)
    return {i: sorted(recs, key=lambda rec: rec["turn"]) for i, recs in out.items()}


def export(tmp_path, redis_url, run_name, name: str, *flags: str) -> list[dict]:
    out = tmp_path / name
    genq("export", "--out", str(out), *flags, redis_url=redis_url, run=run_name)
    return read_jsonl(out)


def check_chains(rows: list[list[dict]], records: list[dict]) -> dict[int, list[dict]]:
    """Every conversation has turns 1..m once, m at most its assistant turns, each turn's prompt
    the row's messages with the turns made before it; only the last may say why it stopped."""
    chains = by_conversation(records)
    assert sorted(chains) == list(range(len(rows)))
    for index, chain in chains.items():
        messages = rows[index]
        assert [rec["turn"] for rec in chain] == list(range(1, len(chain) + 1)), index
        assert len(chain) <= len(splice.assistant_turns(messages))
        made = []
        for rec in chain:
            prompt = splice.prompt(messages, rec["turn"], made)
            assert rec["prompt_token_ids"] == tokens.render(prompt, TOOLS, thinking=True), (
                index, rec["turn"])
            made.append(splice.message_of(rec))
        *before, last = chain
        assert all("stopped" not in rec and "ended" not in rec for rec in before)
        assert last["ended"] == ("truncated" if last["finish_reason"] == "length" else
                                 last.get("stopped", "complete"))
        if len(chain) < len(splice.assistant_turns(messages)):
            assert last["stopped"] in ("diverged", "truncated"), last
            assert (last["stopped"] == "truncated") == (last["finish_reason"] == "length")
            assert last["stopped_detail"].startswith(f"turn {last['turn']} ")
        else:
            assert "stopped" not in last
    return chains


@pytest.mark.timeout(240)
def test_every_turn_made_in_order_through_a_kill_and_a_redo_of_the_truncated(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 40
    rows = [conversation(i) for i in range(n)]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(orjson.dumps({"id": f"c{i}", "messages": m, "tools": TOOLS}).decode()
                            + "\n" for i, m in enumerate(rows)))
    sim_kwargs = dict(time_scale=60, tool_call_rate=0.6, length_dist="lognormal:40:0.5",
                      max_running_requests=4)
    sims = [sim_factory(**sim_kwargs), sim_factory(**sim_kwargs)]
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60", "--token-ids",
         redis_url=redis_url, run=run_name)
    flags = ("--burst", "--visibility-timeout", "3")
    doomed = ConsumerProcess(redis_url, run_name, sims[0].url, tmp_path / "a", *flags)
    other = ConsumerProcess(redis_url, run_name, sims[1].url, tmp_path / "b", *flags)
    try:
        k = RunKeys(run_name)
        # Mid-conversation: turns recorded of conversations not ended yet.
        wait_for(lambda: len(midway(r, k, sims[0].url)) >= 2, interval=0.01, timeout=60,
                 what="conversations midway on the doomed consumer")
        doomed.kill()
        killed_at = requests_served(*sims)
        assert other.wait(180) == 0, other.log()[-3000:]
    finally:
        doomed.cleanup()
        other.cleanup()
    records = export(tmp_path, redis_url, run_name, "all.jsonl")
    chains = check_chains(rows, records)
    # Some conversation went on from where the killed consumer left it: its earlier turns were
    # made under one claim (attempt) and kept, its later ones under another.
    assert any(len({rec["attempt"] for rec in chain}) > 1 for chain in chains.values())
    # The kill cost only the turns in flight: at most the doomed server's 4 running requests
    # were asked again. (Each consumer's start asks one 1-token probe: --token-ids.)
    assert requests_served(*sims) - PROBE * 2 - len(records) <= 4, (
        killed_at, requests_served(*sims), len(records))
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    conv = status["conversations"]
    assert (conv["done"], conv["total"], conv["generations"]) == (n, n, len(records))
    # How each ended: cut at max_tokens (at its last turn too), diverged, or complete.
    ends = ["truncated" if chain[-1]["finish_reason"] == "length" else
            chain[-1].get("stopped", "complete") for chain in chains.values()]
    assert conv["stopped"] == {why: ends.count(why) for why in set(ends)}
    truncated = {i: chain[-1] for i, chain in chains.items()
                 if chain[-1]["finish_reason"] == "length"}
    assert truncated, "no conversation was cut at max_tokens: the test's lengths need a look"
    assert conv["truncated_by_turn"] == {
        str(t): sum(1 for rec in truncated.values() if rec["turn"] == t)
        for t in sorted({rec["turn"] for rec in truncated.values()})}
    assert "conversations" in genq("status", redis_url=redis_url, run=run_name).stdout

    # --format conversations: one row a conversation, its made turns in place, cut where it
    # stopped.
    shaped = {row["index"]: row for row in export(tmp_path, redis_url, run_name, "conv.jsonl",
                                                  "--format", "conversations")}
    assert sorted(shaped) == list(range(n))
    for index, chain in chains.items():
        row = shaped[index]
        assert row["id"] == f"c{index}" and row["tools"] == TOOLS
        last = chain[-1]
        made = [splice.message_of(rec) for rec in chain]
        expected = splice.prompt(rows[index], last["turn"], made[:-1]) + [made[-1]]
        tail = splice.after(rows[index], last["turn"], last["finish_reason"],
                            last.get("tool_calls"))
        if "stopped" not in last and isinstance(tail, list):
            expected += tail  # the tool results answering its last call, if it made one
        assert row["messages"] == expected, index

    # The 8k pivot per turn: a truncated conversation is made again from its truncated turn
    # with a larger budget; its earlier turns are kept, never asked again.
    before = requests_served(*sims)
    genq("requeue", "--set", "max_tokens=2000", "--redo", "truncated",
         redis_url=redis_url, run=run_name)
    again = ConsumerProcess(redis_url, run_name, sims[1].url, tmp_path / "b", *flags)
    try:
        assert again.wait(180) == 0, again.log()[-3000:]
    finally:
        again.cleanup()
    redone = export(tmp_path, redis_url, run_name, "redone.jsonl")
    new_chains = check_chains(rows, redone)
    asked = 0
    for index, chain in new_chains.items():
        old = chains[index]
        if index not in truncated:
            assert chain == old, index  # untouched
            continue
        t = truncated[index]["turn"]
        assert chain[:t - 1] == old[:t - 1], index  # the same lines: kept, not made again
        assert chain[t - 1]["finish_reason"] != "length" or chain[t - 1]["completion_tokens"] > 60
        assert chain[t - 1]["params_version"] == 2
        asked += len(chain) - (t - 1)
    assert requests_served(*sims) - before - PROBE == asked
