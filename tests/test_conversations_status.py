"""`--turns all` as status and the records count it: every generation in the token totals, finish
reasons and rates; each conversation by where it stands; each turn sent its own seed."""

from __future__ import annotations

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import consume_to_the_end, read_jsonl
from test_conversations import TOOLS, by_conversation, conversation, export, write_rows

from genq.common.queue.keys import RunKeys
from genq.common.task import request_body
from genq.turns import splice


@pytest.mark.timeout(120)
def test_each_turn_of_each_sample_is_sent_its_own_seed_and_its_record_names_it(
        tmp_path, redis_url, r, run_name, sim_factory):
    """Every turn of a conversation is asked with another seed (the same one would make a
    chain's turns sample alike), and asking the server again with the record's prompt and seed
    gives its answer back."""
    rows = [conversation(i) for i in range(6)]
    data = write_rows(tmp_path / "c.jsonl", rows)
    sim = sim_factory(time_scale=1000, tool_call_rate=0.6, length_dist="fixed:20")
    genq("produce", str(data), "--once", "--turns", "all", "--samples", "2", "--max-tokens",
         "60", "--token-ids", redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    records = export(tmp_path, redis_url, run_name, "all.jsonl")
    assert len(records) > 2 * len(rows)  # conversations of several turns
    seeds = [rec["seed"] for rec in records]
    assert len(set(seeds)) == len(seeds), "two generations were sent the same seed"
    assert all(0 <= s < 2**31 for s in seeds)
    params = orjson.loads(r.hget(RunKeys(run_name).params, "1"))
    differ = []
    for sample in (0, 1):
        chains = by_conversation([rec for rec in records if rec["sample"] == sample])
        for index, chain in chains.items():
            made: list[dict] = []
            for rec in chain:
                prompt = splice.prompt(rows[index], rec["turn"], made)
                body = request_body(prompt, {**params, "seed": rec["seed"]}, rec["model"],
                                    tools=TOOLS)
                again = httpx.post(sim.url + "/v1/chat/completions", json=body,
                                   timeout=10).json()["choices"][0]
                if again["response_token_ids"] != rec["completion_token_ids"]:
                    differ.append((index, sample, rec["turn"]))
                made.append(splice.message_of(rec))
    assert not differ
    # A run of one sample records each turn's seed too.
    one = run_name + "-one"
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60",
         redis_url=redis_url, run=one)
    consume_to_the_end(redis_url, one, sim.url, tmp_path / "one")
    out = tmp_path / "one.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=one)
    for chain in by_conversation(read_jsonl(out)).values():
        assert len({rec["seed"] for rec in chain}) == len(chain)
