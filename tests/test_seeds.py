"""Seeds: the record names the seed that made its answer, so asking the server again with it
gives that answer back (under deterministic inference)."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, write_dataset

from genq.common.errors import UsageError
from genq.common.params import MAX_RETRIES, parse_sets
from genq.common.queue.keys import RunKeys
from genq.common.task import MAX_SAMPLES, request_body, request_seed

SCHEMA = {"type": "object", "required": ["grade"],
          "properties": {"grade": {"enum": ["A", "B", "C"]}, "note": {"type": "string"}}}


@pytest.mark.timeout(240)
def test_the_seed_of_a_retried_answer_reproduces_it(tmp_path, redis_url, r, run_name,
                                                     sim_factory):
    """Half the answers break the schema and are asked again with another seed: every record,
    retried or not, is the simulator's answer to its row under the record's seed."""
    rows = 30
    data = write_dataset(tmp_path / "d.jsonl", rows)
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    sim = sim_factory(time_scale=1000, length_dist="fixed:30", invalid_json_rate=0.5, seed=5)
    genq("produce", str(data), "--once", "--samples", "2", "--schema", str(tmp_path / "s.json"),
         "--max-tokens", "100", "--set", "schema_retries=6", redis_url=redis_url, run=run_name)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--burst")
    assert c.wait(180) == 0, c.log()[-3000:]
    c.cleanup()
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    records = read_jsonl(out)
    sent = httpx.get(sim.url + "/_sim/stats", timeout=5).json()["json_answers"]
    assert len(records) == 2 * rows and sent["invalid"] > 0  # some answers were retried
    messages = {row["id"]: row["messages"] for row in read_jsonl(data)}
    params = orjson.loads(r.hget(RunKeys(run_name).params, "1"))
    differ = []
    for rec in records:
        body = request_body(messages[rec["id"]], {**params, "seed": rec["seed"]}, rec["model"])
        again = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=10).json()
        if again["choices"][0]["message"]["content"] != rec["content"]:
            differ.append((rec["index"], rec["sample"], rec["seed"]))
    assert not differ


def test_seeds_are_distinct_within_a_row_and_below_2_31():
    """For every (sample, retry) of a row, another seed, each a 31-bit one, whatever the base."""
    for base in (0, 7, 2**31 - 1, -3):
        for index in (0, 1, 999_999):
            seeds = [request_seed(base, index, sample, retry)
                     for sample in (0, 1, 2, 15, MAX_SAMPLES - 1)
                     for retry in (0, 1, 2, MAX_RETRIES - 1)]
            assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**31 for s in seeds)
    # A schema_retries past the distinct range is refused where it is set.
    with pytest.raises(UsageError, match="schema_retries"):
        parse_sets([f"schema_retries={MAX_RETRIES}"])
