"""`genq produce --token-ids`: every record keeps the server's own prompt and completion ids,
`export --format tokens` writes the pre-tokenized lines drafter pipelines train on, and a run
that keeps ids refuses what cannot give them (streamed answers, a server without ids) at start,
in one line, instead of writing text-only records."""

from __future__ import annotations

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, write_dataset

from genq.common import params
from genq.common.task import request_body


def run_to_the_end(tmp_path, redis_url, run, sim, *produce_flags: str) -> None:
    data = write_dataset(tmp_path / "data.jsonl", 12)
    genq("produce", str(data), "--once", "--max-tokens", "300", *produce_flags,
         redis_url=redis_url, run=run)
    consumer = ConsumerProcess(redis_url, run, sim.url, tmp_path / "out", "--burst")
    try:
        assert consumer.wait(90) == 0, consumer.log()[-3000:]
    finally:
        consumer.cleanup()


@pytest.mark.timeout(120)
def test_records_keep_the_servers_own_ids_and_export_them_for_drafters(
        tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400)
    run_to_the_end(tmp_path, redis_url, run_name, sim, "--token-ids")
    out = tmp_path / "all.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    records = {rec["index"]: rec for rec in read_jsonl(out)}
    assert len(records) == 12
    for rec in records.values():
        assert len(rec["completion_token_ids"]) == rec["completion_tokens"] > 0
        assert len(rec["prompt_token_ids"]) == rec["prompt_tokens"] > 0
    # The ids are the server's: the same request asked again gives the same ids.
    rec = records[5]
    row = orjson.loads((tmp_path / "data.jsonl").read_text().splitlines()[5])
    body = request_body(row["messages"], {**params.DEFAULTS, "max_tokens": 300,
                                          "return_token_ids": True}, rec["model"])
    choice = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30).json()[
        "choices"][0]
    assert rec["prompt_token_ids"] == choice["prompt_token_ids"]
    assert rec["completion_token_ids"] == choice["response_token_ids"]

    # --format tokens, read as the drafter pipelines read their data: HF datasets' JSON loader.
    import datasets

    tokens = tmp_path / "tokens.jsonl"
    genq("export", "--out", str(tokens), "--format", "tokens", redis_url=redis_url, run=run_name)
    ds = datasets.load_dataset("json", data_files=str(tokens), split="train")
    assert sorted(ds.column_names) == ["ended", "finish_reason", "id", "index", "input_ids",
                                       "is_tool_call", "loss_mask", "stopped", "turn"]
    assert len(ds) == 12
    for sample in ds:
        rec = records[sample["index"]]
        assert sample["id"] == rec["id"] and sample["finish_reason"] == rec["finish_reason"]
        assert sample["turn"] == rec["turn"] == 1  # a one-message prompt: the first turn
        assert sample["input_ids"] == rec["prompt_token_ids"] + rec["completion_token_ids"]
        assert sample["loss_mask"] == ([0] * len(rec["prompt_token_ids"])
                                       + [1] * len(rec["completion_token_ids"]))


@pytest.mark.timeout(120)
def test_a_run_without_ids_has_no_token_export(tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400)
    run_to_the_end(tmp_path, redis_url, run_name, sim)
    out = tmp_path / "all.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    assert all("completion_token_ids" not in rec for rec in read_jsonl(out))
    refused = genq("export", "--out", str(tmp_path / "t.jsonl"), "--format", "tokens",
                   redis_url=redis_url, run=run_name, check=False)
    assert refused.returncode != 0
    (line,) = refused.stderr.strip().splitlines()
    assert "no token ids" in line and "--token-ids" in line
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.timeout(120)
def test_a_token_ids_run_refuses_streaming_at_start(tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400)
    data = write_dataset(tmp_path / "data.jsonl", 4)
    genq("produce", str(data), "--once", "--token-ids", redis_url=redis_url, run=run_name)
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--burst",
                               "--stream")
    try:
        assert consumer.wait(60) != 0
        assert "without --stream" in consumer.log()
    finally:
        consumer.cleanup()
    assert not list((tmp_path / "out").glob("**/*.jsonl"))  # not one text-only record


@pytest.mark.timeout(120)
def test_a_server_without_ids_fails_the_consumers_start(tmp_path, redis_url, run_name,
                                                        sim_factory):
    sim = sim_factory(time_scale=400, no_token_ids=True)  # a gateway that drops the ids
    data = write_dataset(tmp_path / "data.jsonl", 4)
    genq("produce", str(data), "--once", "--token-ids", redis_url=redis_url, run=run_name)
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--burst")
    try:
        assert consumer.wait(60) != 0
        assert "returns no token ids" in consumer.log()
    finally:
        consumer.cleanup()
    assert not list((tmp_path / "out").glob("**/*.jsonl"))  # not one text-only record
