"""`--turns all` on a real SGLang 0.5.23 (the `real_sglang` tier): a three-turn tool chain made
turn by turn with --token-ids on a server launched with a tool-call parser and
--enable-cache-report. Each turn's prompt ids are the server's own render of the row with the
turns made before it; each later turn finds the earlier ones' prefix in the radix cache; the
prefix property (turn k+1's prompt ids begin with turn k's prompt + completion ids) is checked
against what the engine counted (docs/SGLANG.md, "Conversations (--turns all) on a real
server", says what the real template does to it).

The tier's model is tiny and random: left to itself (tool_choice auto) it calls no tool, so its
first turn diverges from the row's; a named tool_choice makes the server's grammar write the
call, so the chain goes on to its end."""

from __future__ import annotations

import json
import re

import httpx
import orjson
import pytest
import redis
from conftest import genq
from pipeline import continue_truncated, one_at_a_time, redone_chains
from sglang_servers import start_server
from test_conversations import PROBE
from test_token_ids_sglang import rendered_by_the_models_tokenizer

from genq.common.queue.keys import RunKeys
from genq.common.turns import splice

pytestmark = pytest.mark.real_sglang
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
# strict: the grammar holds the call's arguments to the schema (else it lets them be `""`).
STRICT = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
NAMED = json.dumps({"type": "function", "function": {"name": "read_file"}})
# A named tool_choice makes the server's grammar write the call; enable_thinking off, since
# with it on the grammar lets the tiny model end inside its reasoning, calling nothing.
FORCED = ("--set", "enable_thinking=false", "--raw", f"tool_choice={NAMED}")
ROWS = 3
FIGURES: list[tuple[int, ...]] = []


def call(n: int) -> dict:
    return {"id": f"call_{n}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{n}.py"})}}


def chain(i: int) -> list[dict]:
    """system, user, a tool call and its result twice, then the final answer: three turns."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix bug number {i} in the parser."}]
    for n in (1, 2):
        messages += [{"role": "assistant", "content": None, "tool_calls": [call(n)]},
                     {"role": "tool", "tool_call_id": f"call_{n}",
                      "content": f"def parse_{n}(text): ..."}]
    return [*messages, {"role": "assistant", "content": f"Bug {i} fixed."}]


@pytest.fixture(scope="module")
def server():
    started = start_server("real", "tools")
    yield started
    started.close()


def made_on_the_server(server, tmp_path, redis_url, run, *flags: str,
                       tools: list[dict] = TOOLS, rows: int = ROWS) -> list[dict]:
    """The rows made with --turns all --token-ids, greedy and 300 tokens unless `flags` say
    otherwise (argparse keeps the last), one request at a time (each turn meets the cache the
    turn before left); the exported records."""
    data = tmp_path / "chains.jsonl"
    data.write_text("".join(orjson.dumps({"id": f"c{i}", "messages": chain(i), "tools": tools})
                            .decode() + "\n" for i in range(rows)))
    genq("produce", str(data), "--once", "--turns", "all", "--token-ids", "--temperature", "0",
         "--max-tokens", "300", *flags, redis_url=redis_url, run=run)
    return one_at_a_time(server, tmp_path, redis_url, run)


def by_row(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rec in records:
        out.setdefault(rec["index"], []).append(rec)
    return {i: sorted(recs, key=lambda rec: rec["turn"]) for i, recs in out.items()}


def check_prompts(chains: dict[int, list[dict]], thinking: bool,
                  tools: list[dict] = TOOLS) -> None:
    """Turns in order, each turn's prompt ids the server's template over the row's messages
    with the turns made before it in place of the row's."""
    assert sorted(chains) == list(range(ROWS))
    for index, recs in chains.items():
        assert [rec["turn"] for rec in recs] == list(range(1, len(recs) + 1)), index
        made: list[dict] = []
        for rec in recs:
            prompt = splice.prompt(chain(index), rec["turn"], made)
            assert rec["prompt_token_ids"] == rendered_by_the_models_tokenizer(
                prompt, tools, thinking=thinking), (index, rec["turn"])
            assert len(rec["completion_token_ids"]) == rec["completion_tokens"]
            made.append(splice.message_of(rec))


def conversations(redis_url, run) -> dict:
    return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run).stdout)[
        "conversations"]


def test_the_tiny_model_left_to_itself_calls_no_tool_and_its_first_turn_diverges(
        server, tmp_path, redis_url, run_name):
    chains = by_row(made_on_the_server(server, tmp_path, redis_url, run_name))
    check_prompts(chains, thinking=True)
    for recs in chains.values():
        (only,) = recs
        assert "tool_calls" not in only, only
        assert (only["ended"], only["stopped"]) == ("diverged", "diverged")
        assert only["stopped_detail"] == ("turn 1 called no tool; the row's called "
                                          "read_file × 1")
    conv = conversations(redis_url, run_name)
    assert conv["stopped"] == {"diverged": ROWS}
    assert (conv["boundary_unstable"], conv["boundary_checked"]) == (0, 0)


def test_a_made_call_whose_arguments_are_no_object_stops_its_conversation(
        server, tmp_path, redis_url, run_name):
    """Without `strict`, SGLang's grammar writes the named call with `"arguments":""`, and
    refuses that turn back in the next turn's prompt ("Assistant tool call function.arguments
    must be a JSON object."): the conversation cannot go on, so it stops there, diverged,
    rather than fail with its made turn."""
    chains = by_row(made_on_the_server(server, tmp_path, redis_url, run_name, *FORCED))
    for recs in chains.values():
        (only,) = recs
        assert only["tool_calls"][0]["function"]["arguments"] == '""'
        assert (only["ended"], only["stopped"]) == ("diverged", "diverged"), only
    conv = conversations(redis_url, run_name)
    assert (conv["done"], conv["stopped"]) == (ROWS, {"diverged": ROWS})


def test_a_named_strict_tool_makes_the_whole_chain_each_turn_on_the_cache(
        server, tmp_path, redis_url, run_name):
    # Sampled, seeded: greedy, the tiny model writes the strict arguments' whitespace forever.
    records = made_on_the_server(server, tmp_path, redis_url, run_name, *FORCED,
                                 "--temperature", "1", "--set", "seed=1", "--max-tokens",
                                 "1500", tools=STRICT)
    chains = by_row(records)
    check_prompts(chains, thinking=False, tools=STRICT)
    unstable = checked = 0
    for index, recs in chains.items():
        print("row", index, [(rec["turn"], rec["finish_reason"], rec.get("ended"),
                              rec.get("stopped_detail"), rec["completion_tokens"],
                              rec.get("tool_calls"), (rec.get("content") or "")[:80])
                             for rec in recs])
        # Sampled, a call may run to max_tokens or fail to parse (the server ignores the seed:
        # docs/SGLANG.md); a turn the chain went on from called the row's tool.
        assert all(rec["tool_calls"][0]["function"]["name"] == "read_file" for rec in recs[:-1])
        for before, rec in zip(recs, recs[1:], strict=False):
            ids = before["prompt_token_ids"] + before["completion_token_ids"]
            now = rec["prompt_token_ids"]
            checked += 1
            unstable += now[:len(ids)] != ids
            # The radix cache holds the turn before's ids; the new prompt finds them up to where
            # the template's render of the made turn parts from them.
            common = next((at for at, (a, b) in enumerate(zip(ids, now, strict=False))
                           if a != b), min(len(ids), len(now)))
            assert rec["cached_tokens"] >= common - 1 > 0, (index, rec["turn"], common)
            FIGURES.append((index, rec["turn"], len(before["prompt_token_ids"]), len(ids),
                            common, rec["cached_tokens"]))
    print("turn figures (row, turn, prompt before, prompt+completion before, common, cached):",
          FIGURES)
    assert checked, "no chain went past its first turn"
    conv = conversations(redis_url, run_name)
    assert sum(conv["stopped"].values()) == ROWS
    assert (conv["boundary_unstable"], conv["boundary_checked"]) == (unstable, checked)
    assert unstable == checked  # the template re-renders a made call otherwise (docs/SGLANG.md)


def requests_served(server) -> int:
    """The server's own count of the generation requests it was asked (/metrics)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return int(sum(float(m.group(1)) for m in re.finditer(
        r"^sglang:num_requests_total(?:{[^}]*})? (\S+)$", text, re.M)))


def test_a_cut_forced_call_is_made_again_and_the_chain_goes_on(
        server, tmp_path, redis_url, run_name):
    """`requeue --redo truncated --continue` on chains whose every turn is a forced call: the
    server's tool-call grammar starts at the answer's first token, and a continuation by
    `input_ids` starts it again after the partial (tried on the tier: the whole answer held a
    second `<tool_call>` opened inside the cut one). So each cut turn is made again from its
    start (no `continued_from`), and the chain goes on from it; no earlier turn is asked again."""
    rows, small, large = 12, 600, 2000  # sampled calls end anywhere in ~50..1500 tokens
    first = by_row(made_on_the_server(server, tmp_path, redis_url, run_name, *FORCED,
                                      "--temperature", "1", "--max-tokens", str(small),
                                      tools=STRICT, rows=rows))
    cut = {i: recs[-1] for i, recs in first.items() if recs[-1]["finish_reason"] == "length"}
    print("cut turns (row: turn):", {i: rec["turn"] for i, rec in cut.items()})
    assert cut, "no turn was cut"

    before = requests_served(server)
    continue_truncated(redis_url, run_name, large, len(cut))
    chains = by_row(one_at_a_time(server, tmp_path, redis_url, run_name, name="again.jsonl"))
    asked = requests_served(server) - before

    made = 0
    for index, recs, t in redone_chains(chains, first, cut):
        partial, again = cut[index], recs[t - 1]
        assert "continued_from" not in again, (index, again.get("content"))
        assert again["params_version"] == 2
        assert again["prompt_token_ids"] == partial["prompt_token_ids"], index
        assert all(rec["params_version"] == 2 for rec in recs[t - 1:]), index
        made += len(recs) - (t - 1)
    went_on = sum(len(chains[i]) > rec["turn"] for i, rec in cut.items())
    print(f"rows {rows}, cut {len(cut)}, made again {len(cut)} cut turns + "
          f"{made - len(cut)} after them, requests {asked}, chains past their cut {went_on}")
    # The consumer's start probe, then the cut turns and the turns after them, nothing earlier.
    assert asked == PROBE + made, (asked, made)
    assert went_on, "no chain went on past its cut turn"
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert status["conversations"]["done"] == rows
    assert not status["continued"], status["continued"]
    assert not redis.Redis.from_url(redis_url).exists(RunKeys(run_name).partials)
