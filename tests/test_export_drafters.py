"""The exports of a `--turns all --token-ids` run in the shapes drafter pipelines read as they
are: conversations as `{id, conversations, tools, meta}` (one row a conversation, or one a
generation with `--per-turn`), tokens rows that say each generation's turn, whether it called
tools and how its conversation ended (JSON lines or Parquet), the Parquet export's `ended` and
`stopped` as columns, and failed conversations with `--include-failed`. Each loads with HF
datasets as it is."""

from __future__ import annotations

import orjson
import pyarrow.parquet as pq
import pytest
from conftest import genq
from pipeline import consume_to_the_end, read_jsonl
from test_conversations import TOOLS, by_conversation, conversation

from genq.common.turns import splice

N = 10


def odd_rows() -> list[list[dict]]:
    """Conversations as people's logs hold them: a tool answer given as a list of text parts
    (OpenAI allows it), a user message the same, and one whose tool answer the server refuses
    (its second turn fails for good)."""
    rows = [conversation(i) for i in range(N)]
    rows[5][3]["content"] = [{"type": "text", "text": "def parse_1(text):"},
                             {"type": "text", "text": "..."}]  # the tool answer of call_1
    rows[2][1]["content"] = [{"type": "text", "text": "Fix bug number 2 in the parser."}]
    # Conversation 4 (no tools: its first turn calls none, as the row's) fails at its second
    # turn: the server refuses that prompt for good.
    rows[4] = [{"role": "system", "content": "You are a coding agent."},
               {"role": "user", "content": "Say hello."},
               {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "Now REFUSE_ME."},
               {"role": "assistant", "content": "No."}]
    return rows


def write_data(path, rows: list[list[dict]]):
    """The rows as a data set, each with the tools but conversation 4."""
    path.write_text("".join(orjson.dumps({"id": f"c{i}", "messages": m, **(
        {"tools": TOOLS} if i != 4 else {})}).decode() + "\n" for i, m in enumerate(rows)))
    return path


def made_run(tmp_path, redis_url, run_name, sim_factory) -> tuple[list[list[dict]], list[dict]]:
    """A finished `--turns all --token-ids` run of `odd_rows`; (rows, its jsonl export)."""
    rows = odd_rows()
    data = write_data(tmp_path / "conversations.jsonl", rows)
    sim = sim_factory(time_scale=200, tool_call_rate=0.6, length_dist="lognormal:40:0.5",
                      reasoning_parser="qwen3", bad_marker="REFUSE_ME")
    genq("produce", str(data), "--once", "--turns", "all", "--token-ids", "--max-tokens", "200",
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    return rows, export(tmp_path, redis_url, run_name, "all.jsonl")


def export(tmp_path, redis_url, run_name, name: str, *flags: str) -> list[dict]:
    out = tmp_path / name
    genq("export", "--out", str(out), *flags, redis_url=redis_url, run=run_name)
    return read_jsonl(out) if name.endswith(".jsonl") else pq.read_table(out).to_pylist()


def strings(messages: list[dict]) -> list[dict]:
    """The messages with each content a string, list of text parts joined as the server's
    template joins them."""
    def text(content):
        if isinstance(content, list):
            return " ".join(p["text"] for p in content if p.get("type") == "text")
        return content or ""
    return [{**m, "content": text(m.get("content"))} for m in messages]


def cut_after(row: list[dict], chain: list[dict], turn: int) -> list[dict]:
    """The conversation through made turn `turn`: the row's messages with the made turns in
    place of its own."""
    made = [splice.message_of(rec) for rec in chain[:turn]]
    return strings(splice.prompt(row, turn, made[:-1]) + made[-1:])


def ended(chain: list[dict]) -> tuple[str | None, str | None]:
    return chain[-1].get("ended"), chain[-1].get("stopped")


def load(path, fmt: str):
    import datasets

    return datasets.load_dataset(fmt, data_files=str(path), split="train")


@pytest.mark.timeout(120)
def test_conversations_are_rows_drafter_pipelines_read_whole_or_one_a_turn(
        tmp_path, redis_url, run_name, sim_factory):
    rows, records = made_run(tmp_path, redis_url, run_name, sim_factory)
    chains = by_conversation(records)
    done = {i: chain for i, chain in chains.items() if "ended" in chain[-1]}
    assert 4 not in done and len(done) == N - 1  # conversation 4 failed at its second turn
    shaped = export(tmp_path, redis_url, run_name, "conv.jsonl", "--format", "conversations")
    assert [row["meta"]["index"] for row in shaped] == sorted(done)
    for row in shaped:
        index = row["meta"]["index"]
        chain = done[index]
        assert set(row) == {"id", "conversations", "tools", "meta"}
        assert row["id"] == f"c{index}" and row["tools"] == TOOLS
        assert row["conversations"] == cut_after(rows[index], chain, len(chain)), index
        assert all(isinstance(m["content"], str) for m in row["conversations"])
        assert (row["meta"]["ended"], row["meta"].get("stopped")) == ended(chain)
        assert row["meta"]["turns"] == len(chain)
    # The list of parts is the text a loader reads, and pyarrow's JSON reader (datasets) loads
    # every row as it is.
    (five,) = [row for row in shaped if row["meta"]["index"] == 5]
    assert any(m["content"] == "def parse_1(text): ..." for m in five["conversations"])
    ds = load(tmp_path / "conv.jsonl", "json")
    assert len(ds) == len(shaped) and {"id", "conversations", "tools", "meta"} <= set(
        ds.column_names)

    # --per-turn: one row a generation (those of a conversation not done too, as --format
    # tokens), its conversation cut after that turn, every turn's own thinking the last
    # assistant message of its row.
    per_turn = export(tmp_path, redis_url, run_name, "turns.jsonl", "--format",
                      "conversations", "--per-turn")
    want = [(i, t) for i, chain in chains.items() for t in range(1, len(chain) + 1)]
    assert [(row["meta"]["index"], row["meta"]["turn"]) for row in per_turn] == want
    for row in per_turn:
        index, turn = row["meta"]["index"], row["meta"]["turn"]
        chain = chains[index]
        assert row["conversations"] == cut_after(rows[index], chain, turn), (index, turn)
        last = row["conversations"][-1]
        assert last["role"] == "assistant"
        assert last.get("reasoning_content") == chain[turn - 1].get("reasoning_content")
        is_last = turn == len(chain)
        assert row["meta"].get("ended") == (chain[-1].get("ended") if is_last else None)
    assert len(load(tmp_path / "turns.jsonl", "json")) == len(want)


@pytest.mark.timeout(120)
def test_tokens_rows_say_turn_tool_call_and_end_in_jsonl_and_parquet(
        tmp_path, redis_url, run_name, sim_factory):
    _, records = made_run(tmp_path, redis_url, run_name, sim_factory)
    for name in ("tokens.jsonl", "tokens.parquet"):
        rows_out = export(tmp_path, redis_url, run_name, name, "--format", "tokens")
        assert len(rows_out) == len(records) > N
        for row, rec in zip(rows_out, records, strict=True):
            assert (row["index"], row["turn"]) == (rec["index"], rec["turn"])
            assert row["input_ids"] == rec["prompt_token_ids"] + rec["completion_token_ids"]
            assert row["loss_mask"] == [0] * rec["prompt_tokens"] + [1] * rec[
                "completion_tokens"]
            assert row["is_tool_call"] == bool(rec.get("tool_calls"))
            assert (row["ended"], row["stopped"]) == (rec.get("ended"), rec.get("stopped"))
        assert any(row["is_tool_call"] for row in rows_out)
        assert {row["ended"] for row in rows_out} > {None}
        fmt = "parquet" if name.endswith(".parquet") else "json"
        ds = load(tmp_path / name, fmt)
        assert len(ds) == len(records)
        assert {"turn", "is_tool_call", "ended", "stopped", "input_ids", "loss_mask"} <= set(
            ds.column_names)
    # The Parquet export of records: how each conversation ended is a column of its own.
    export(tmp_path, redis_url, run_name, "all.parquet")
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.schema.field("ended").type == "string"
    assert table.column("ended").to_pylist() == [rec.get("ended") for rec in records]
    assert table.column("stopped").to_pylist() == [rec.get("stopped") for rec in records]
    assert len(load(tmp_path / "all.parquet", "parquet")) == len(records)


@pytest.mark.timeout(120)
def test_include_failed_writes_each_failed_conversation_with_its_reason_and_made_turns(
        tmp_path, redis_url, run_name, sim_factory):
    rows, records = made_run(tmp_path, redis_url, run_name, sim_factory)
    made = by_conversation(records)[4]  # the failed one's turns, made before it failed
    assert [rec["turn"] for rec in made] == [1]
    lines = export(tmp_path, redis_url, run_name, "with.jsonl", "--include-failed")
    failed = [rec for rec in lines if rec.get("status") == "failed"]
    assert [(rec["index"], rec["turns"]) for rec in failed] == [(4, 1)]
    assert "400" in failed[0]["error"] and failed[0]["error_kind"]
    assert [rec for rec in lines if rec.get("status") != "failed"] == records
    shaped = export(tmp_path, redis_url, run_name, "with-conv.jsonl", "--format",
                    "conversations", "--include-failed")
    (row,) = [row for row in shaped if row["meta"].get("status") == "failed"]
    assert row["meta"]["index"] == 4 and row["meta"]["turns"] == 1
    assert row["meta"]["error"] == failed[0]["error"]
    # What the failed turn was asked: the made turn, then the row's tool answer it failed on.
    assert row["conversations"] == strings(splice.prompt(
        rows[4], 2, [splice.message_of(made[0])]))
    assert len(load(tmp_path / "with-conv.jsonl", "json")) == len(shaped)
    refused = genq("export", "--out", str(tmp_path / "t.jsonl"), "--format", "tokens",
                   "--include-failed", redis_url=redis_url, run=run_name, check=False)
    assert refused.returncode == 2 and "--include-failed" in refused.stderr
