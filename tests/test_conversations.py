"""`--turns all`: every assistant turn of a row's conversation made anew, in order, each given the
turns made before it; a kill costs only the turns in flight, and a redo of truncated
conversations asks no earlier turn again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, consume_to_the_end, read_jsonl, redone_chains, wait_for

from genq.common.queue.keys import RunKeys
from genq.common.turns import conversations, splice
from genq.simulator import tokens

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


def write_rows(path: Path, rows: list[list[dict]]) -> Path:
    """The conversations as a data set: a line {id, messages, tools} each."""
    path.write_text("".join(orjson.dumps({"id": f"c{i}", "messages": m, "tools": TOOLS}).decode()
                            + "\n" for i, m in enumerate(rows)))
    return path


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
        # The server as leases name it: its URL, and for a loopback one "#" and its node.
        if orjson.loads(raw)["made"] and owner and \
                owner.decode().split("|")[1].split("#")[0] == server:
            out.append(int(task))
    return out


def by_conversation(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rec in records:
        out.setdefault(rec["index"], []).append(rec)
    return {i: sorted(recs, key=lambda rec: rec["turn"]) for i, recs in out.items()}


def ended(last: dict) -> str:
    """How a conversation that reached its row's last turn ended: on a call, or in text."""
    return "unanswered" if last.get("tool_calls") else "complete"


def export(tmp_path, redis_url, run_name, name: str, *flags: str) -> list[dict]:
    out = tmp_path / name
    genq("export", "--out", str(out), *flags, redis_url=redis_url, run=run_name)
    return read_jsonl(out)


def check_chains(rows: list[list[dict]], records: list[dict],
                 only: list[int] | None = None) -> dict[int, list[dict]]:
    """Every conversation (of `only`, else all) has turns 1..m once, m at most its assistant
    turns, each turn's prompt the row's messages with the turns made before it; only the last
    may say why it stopped, and one ending on a call no one answers says so."""
    chains = by_conversation(records)
    assert sorted(chains) == (list(range(len(rows))) if only is None else only)
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
                                 last.get("stopped", ended(last)))
        if len(chain) < len(splice.assistant_turns(messages)):
            assert last["stopped"] in ("diverged", "truncated", "unanswered"), last
            assert (last["stopped"] == "truncated") == (last["finish_reason"] == "length")
            assert last["stopped_detail"].startswith(f"turn {last['turn']} ")
        else:
            assert "stopped" not in last
    return chains


@pytest.mark.slow  # a kill mid-run
@pytest.mark.timeout(240)
def test_every_turn_made_in_order_through_a_kill_and_a_redo_of_the_truncated(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 40
    rows = [conversation(i) for i in range(n)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    sim_kwargs = dict(time_scale=60, tool_call_rate=0.6, length_dist="lognormal:40:0.5",
                      max_running_requests=4)
    # The doomed consumer's server is the slower: its conversations are midway longer.
    sims = [sim_factory(**{**sim_kwargs, "time_scale": 20}), sim_factory(**sim_kwargs)]
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60", "--token-ids",
         redis_url=redis_url, run=run_name)
    flags = ("--burst", "--visibility-timeout", "3")
    doomed = ConsumerProcess(redis_url, run_name, sims[0].url, tmp_path / "a", *flags)
    other = None
    try:
        k = RunKeys(run_name)
        # Mid-conversation: turns recorded of conversations not ended yet. The other consumer
        # starts only then: started together on a loaded machine, it once made every
        # conversation before the doomed one had claimed a second.
        try:
            wait_for(lambda: midway(r, k, sims[0].url), interval=0.01, timeout=90,
                     what="conversations midway on the doomed consumer")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{doomed.log()[-3000:]}") from None
        other = ConsumerProcess(redis_url, run_name, sims[1].url, tmp_path / "b", *flags)
        doomed.kill()
        killed_at = requests_served(*sims)
        assert other.wait(180) == 0, other.log()[-3000:]
    finally:
        doomed.cleanup()
        if other is not None:
            other.cleanup()
    records = export(tmp_path, redis_url, run_name, "all.jsonl")
    chains = check_chains(rows, records)
    # Some conversation went on from where the killed consumer left it: its earlier turns were
    # made under one claim (attempt) and kept, its later ones under another.
    assert any(len({rec["attempt"] for rec in chain}) > 1 for chain in chains.values())
    # The kill cost only the turns in flight: the doomed server's 4 running requests, and the
    # last turns answered but not yet acknowledged (the slot moves on while its answer is
    # written and acked), at most 4 more. (Each consumer's start asks one 1-token probe.)
    assert requests_served(*sims) - PROBE * 2 - len(records) <= 4 + 4, (
        killed_at, requests_served(*sims), len(records))
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    conv = status["conversations"]
    assert (conv["done"], conv["total"], conv["generations"]) == (n, n, len(records))
    # Every generation counts in the rate, not only each conversation's last.
    assert conv["generations_per_s"] == status["rate"]["req_per_s"] > \
        status["rate"]["conversations_per_s"] > 0
    # How each ended: cut at max_tokens (at its last turn too), diverged, or complete.
    ends = ["truncated" if chain[-1]["finish_reason"] == "length" else
            chain[-1].get("stopped", ended(chain[-1])) for chain in chains.values()]
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
    shaped = {row["meta"]["index"]: row for row in export(
        tmp_path, redis_url, run_name, "conv.jsonl", "--format", "conversations")}
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
        assert row["conversations"] == conversations.as_strings(expected), index

    # The 8k pivot per turn: a truncated conversation is made again from its truncated turn
    # with a larger budget; its earlier turns are kept, never asked again.
    before = requests_served(*sims)
    genq("requeue", "--set", "max_tokens=2000", "--redo", "truncated",
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sims[1].url, tmp_path / "b", *flags[1:], timeout=180)
    redone = export(tmp_path, redis_url, run_name, "redone.jsonl")
    new_chains = check_chains(rows, redone)
    asked = 0
    for _, chain, t in redone_chains(new_chains, chains, truncated):
        assert chain[t - 1]["finish_reason"] != "length" or chain[t - 1]["completion_tokens"] > 60
        assert chain[t - 1]["params_version"] == 2
        asked += len(chain) - (t - 1)
    assert requests_served(*sims) - before - PROBE == asked
    # ... and some went past the turn they were cut at.
    assert any(len(new_chains[i]) > rec["turn"] for i, rec in truncated.items())
    # --format tokens: one row a generation, the earlier turns in its prompt under mask 0.
    rows_out = export(tmp_path, redis_url, run_name, "tokens.jsonl", "--format", "tokens")
    assert [(row["index"], row["turn"]) for row in rows_out] == [
        (rec["index"], rec["turn"]) for rec in redone]
    for row, rec in zip(rows_out, redone, strict=True):
        assert row["input_ids"] == rec["prompt_token_ids"] + rec["completion_token_ids"]
        assert row["loss_mask"] == [0] * rec["prompt_tokens"] + [1] * rec["completion_tokens"]


@pytest.mark.timeout(180)
def test_a_failed_turn_is_made_again_by_redo_failed_after_the_turns_before_it(
        tmp_path, redis_url, r, run_name, sim_factory):
    """A conversation failed at its second turn (the server refuses that prompt for good) keeps
    its first; `--redo failed` goes on from the second, on a server that takes it. Each of the
    --samples is its own conversation."""
    bad = [{"role": "system", "content": "You are a coding agent."},
           {"role": "user", "content": "Read f1.py."},
           {"role": "assistant", "content": None, "tool_calls": [call(1)]},
           {"role": "tool", "tool_call_id": "call_1", "content": "REFUSE_ME"},
           {"role": "assistant", "content": "Done."}]
    rows = [bad, conversation(1)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    sim = sim_factory(time_scale=200, length_dist="fixed:20", bad_marker="REFUSE_ME")
    genq("produce", str(data), "--once", "--turns", "all", "--samples", "2", "--max-tokens",
         "100", redis_url=redis_url, run=run_name)

    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert (status["done"], status["failed"]) == (2, 2)  # both samples of the refused row
    first = by_conversation(export(tmp_path, redis_url, run_name, "first.jsonl"))
    assert status["conversations"]["generations"] == sum(map(len, first.values()))
    failed = [rec for rec in export(tmp_path, redis_url, run_name, "first.jsonl")
              if rec["index"] == 0]
    assert sorted((rec["sample"], rec["turn"]) for rec in failed) == [(0, 1), (1, 1)]
    # What is not built for conversations is refused in one line, before anything changes.
    refused = genq("requeue", "--set", "max_tokens=200", "--redo", "truncated", "--continue",
                   "--probe", "1", redis_url=redis_url, run=run_name, check=False)
    assert refused.returncode == 2 and "--probe with --continue is not built for a --turns " \
        "all run" in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
    genq("requeue", "--redo", "failed", redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim_factory(time_scale=200, length_dist="fixed:20").url,
                       tmp_path / "out")
    again = [rec for rec in export(tmp_path, redis_url, run_name, "again.jsonl")
             if rec["index"] == 0]
    for sample in (0, 1):
        chain = sorted((rec for rec in again if rec["sample"] == sample),
                       key=lambda rec: rec["turn"])
        assert [rec["turn"] for rec in chain] == [1, 2]
        assert chain[0] in failed  # the first turn kept, not made again
        assert chain[1]["attempt"] > chain[0]["attempt"] and "ended" in chain[1]
    # The monitor shows what status counts: on the page, in /api/status and in /metrics.
    from test_monitor import Monitor

    monitor = Monitor(redis_url, run_name, tmp_path)
    try:
        conv = monitor.status()["conversations"]
        _, metrics, _ = monitor.get("/metrics")
        shown = monitor.conversation_texts("conv-done", "conv-generations", "conv-ended")
    finally:
        monitor.stop()
    assert conv["done"] == 4 and shown["conv-done"] == "4 / 4"
    assert shown["conv-generations"] == str(conv["generations"])
    assert f"genq_generations_total{{run=\"{run_name}\"}} {conv['generations']}" in \
        metrics.decode()
    assert all(f"{why} {n}" in shown["conv-ended"] for why, n in conv["stopped"].items())


@pytest.mark.timeout(180)
def test_export_of_conversations_reads_more_shards_than_it_may_open_files(
        tmp_path, redis_url, run_name, sim_factory):
    """One shard a record, more shards than RLIMIT_NOFILE lets the export open at once: both
    formats write every generation, as they do without the limit."""
    import resource

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))

    rows = [conversation(i) for i in range(60)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    sim = sim_factory(time_scale=200, tool_call_rate=1.0, length_dist="fixed:20")
    genq("produce", str(data), "--once", "--turns", "all", redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out", "--shard-records", "1")
    shards = list((tmp_path / "out").rglob("*.jsonl"))
    assert len(shards) > 64
    for fmt in ("jsonl", "conversations"):
        whole = export(tmp_path, redis_url, run_name, f"whole-{fmt}.jsonl", "--format", fmt)
        out = tmp_path / f"limited-{fmt}.jsonl"
        proc = genq("export", "--out", str(out), "--format", fmt, redis_url=redis_url,
                    run=run_name, check=False, preexec_fn=few_files)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert read_jsonl(out) == whole and whole


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("parser", "thinking"), [("qwen3", True), (None, True), ("qwen3", False)])
def test_a_tool_chains_made_turns_are_the_next_prompts_start_unless_the_template_drops_them(
        tmp_path, redis_url, run_name, sim_factory, parser, thinking):
    """Inside a tool chain the simulator's template renders a made turn (thinking on) as the
    turn's own ids, call and all, as Qwen3's does: every boundary holds. With thinking off the
    generation prompt's empty think block is not in the history: every one is unstable."""
    rows = [conversation(i) for i in (2, 5, 8)]  # 2 calls, then the answer: 2 boundaries each
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    # Room for words before each call: the "\n" the template writes between them is made too.
    sim = sim_factory(time_scale=200, tool_call_rate=1.0, length_dist="fixed:40",
                      reasoning_parser=parser)
    genq("produce", str(data), "--once", "--turns", "all", "--token-ids", "--max-tokens", "200",
         "--set", f"enable_thinking={str(thinking).lower()}", redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    unstable = checked = 0
    for recs in by_conversation(export(tmp_path, redis_url, run_name, "all.jsonl")).values():
        for before, rec in zip(recs, recs[1:], strict=False):
            ids = before["prompt_token_ids"] + before["completion_token_ids"]
            checked += 1
            unstable += rec["prompt_token_ids"][:len(ids)] != ids
            if thinking:
                assert before["content"] and before["tool_calls"], before
                assert rec["prompt_token_ids"][:len(ids)] == ids, (
                    tokens.decode(ids[-60:]), tokens.decode(rec["prompt_token_ids"][:len(ids)]
                                                            [-60:]))
    assert checked == 2 * len(rows)
    conv = orjson.loads(genq("status", "--json", redis_url=redis_url,
                             run=run_name).stdout)["conversations"]
    assert (conv["boundary_unstable"], conv["boundary_checked"]) == (
        (0, checked) if thinking else (checked, checked))
