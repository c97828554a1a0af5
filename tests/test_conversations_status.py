"""`--turns all` as status and the records count it: every generation in the token totals, finish
reasons and rates; each conversation by where it stands; each turn sent its own seed."""

from __future__ import annotations

import subprocess
from collections import Counter

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import consume_to_the_end, read_jsonl
from test_conversations import TOOLS, by_conversation, conversation, export, write_rows

from genq.common.queue.keys import RunKeys
from genq.common.task import request_body
from genq.common.turns import splice
from genq.monitor import metrics


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


def status_of(redis_url: str, run: str) -> dict:
    return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run).stdout)


def negatives(value, at: str = "") -> list[str]:
    """Where a figure in the status is below 0 (none may be: counts, totals, rates)."""
    if isinstance(value, dict):
        return [n for key, v in value.items() for n in negatives(v, f"{at}.{key}")]
    if isinstance(value, list):
        return [n for i, v in enumerate(value) for n in negatives(v, f"{at}[{i}]")]
    return [f"{at}={value}"] if isinstance(value, int | float) and value < 0 else []


def page_standing(tmp_path, redis_url: str, run: str) -> tuple[int, str]:
    """The monitor's /api/status count of conversations being redone, and what its page says
    of where they stand."""
    from test_monitor import Monitor

    monitor = Monitor(redis_url, run, tmp_path)
    try:
        redoing = monitor.status()["conversations"]["redoing"]
        shown = monitor.conversation_texts("conv-standing")["conv-standing"] or ""
    finally:
        monitor.stop()
    return redoing, shown


def check_counts_every_generation(status: dict, records: list[dict]) -> None:
    """Status's token totals, finish reasons and cache-hit share are the export's sums over
    every generation; no figure is negative."""
    assert not negatives(status)
    prompt = sum(rec["prompt_tokens"] for rec in records)
    cached = sum(rec.get("cached_tokens") or 0 for rec in records)
    assert (status["prompt_tokens_total"], status["output_tokens_total"],
            status["cached_prompt_tokens_total"]) == (
        prompt, sum(rec["completion_tokens"] for rec in records), cached)
    assert status["finish_reasons"] == dict(Counter(rec["finish_reason"] for rec in records))
    assert status["cache_hit_share"] == round(cached / prompt, 4)
    assert status["conversations"]["generations"] == len(records)


@pytest.mark.timeout(240)
def test_status_counts_every_generation_and_each_conversation_where_it_stands(
        tmp_path, redis_url, r, run_name, sim_factory):
    """Tokens, finish reasons, cache hits and requests a second count every turn, as the export
    holds them, before, during and after a redo of the truncated and of all; each conversation
    is counted by where it stands: done (and how it ended), being redone, failed."""
    n = 16
    rows = [conversation(i) for i in range(n)]
    data = write_rows(tmp_path / "c.jsonl", rows)
    sim = sim_factory(time_scale=200, tool_call_rate=0.6, length_dist="lognormal:40:0.5",
                      enable_cache_report=True)
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60",
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    records = export(tmp_path, redis_url, run_name, "all.jsonl")
    status = status_of(redis_url, run_name)
    check_counts_every_generation(status, records)
    assert status["cached_prompt_tokens_total"] > 0  # later turns find their prefix cached
    # Requests a second are generations a second; the ETA's pace is conversations a second.
    conv, rate = status["conversations"], status["rate"]
    assert rate["req_per_s"] == conv["generations_per_s"] == status["servers"][0]["req_per_s"]
    assert rate["req_per_s"] / rate["conversations_per_s"] == pytest.approx(
        len(records) / n, rel=0.01)
    chains = by_conversation(records)
    ends = Counter(chain[-1]["ended"] for chain in chains.values())
    truncated = ends["truncated"]
    assert truncated and (conv["done"], conv["redoing"], conv["failed"]) == (n, 0, 0)
    assert conv["stopped"] == dict(ends)

    # A redo of the truncated: those conversations are being redone, not just "not done".
    genq("requeue", "--set", "max_tokens=2000", "--redo", "truncated", redis_url=redis_url,
         run=run_name)
    status = status_of(redis_url, run_name)
    conv = status["conversations"]
    assert (conv["done"], conv["redoing"], conv["failed"]) == (n - truncated, truncated, 0)
    assert conv["stopped"] == {why: c for why, c in ends.items() if why != "truncated"}
    assert f"{truncated} being redone" in genq("status", redis_url=redis_url,
                                               run=run_name).stdout
    body = metrics.render(status)  # what the monitor's /metrics serves
    for state, count in (("done", n - truncated), ("redoing", truncated), ("failed", 0)):
        assert f'genq_conversations{{run="{run_name}",state="{state}"}} {count}.0' in body
    for why, count in conv["stopped"].items():
        assert f'genq_conversations_ended{{ended="{why}",run="{run_name}"}} {count}.0' in body
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    assert page_standing(tmp_path, redis_url, run_name) == (
        truncated, f"{truncated} being redone")
    check_counts_every_generation(status, export(tmp_path, redis_url, run_name, "mid.jsonl"))
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    status = status_of(redis_url, run_name)
    check_counts_every_generation(status, export(tmp_path, redis_url, run_name, "redone.jsonl"))
    assert (status["conversations"]["done"], status["conversations"]["redoing"]) == (n, 0)

    # A redo of all begins every conversation again: its earlier turns are set aside, and
    # count no more once the turn that replaces them is made.
    genq("requeue", "--set", "max_tokens=80", "--redo", "all", redis_url=redis_url,
         run=run_name)
    conv = status_of(redis_url, run_name)["conversations"]
    assert (conv["done"], conv["redoing"]) == (0, n)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    status = status_of(redis_url, run_name)
    again = export(tmp_path, redis_url, run_name, "again.jsonl")
    assert {rec["params_version"] for rec in again} == {3}
    check_counts_every_generation(status, again)
    assert (status["conversations"]["done"], status["conversations"]["redoing"]) == (n, 0)


@pytest.mark.timeout(120)
def test_export_says_how_many_conversations_lack_a_record(tmp_path, redis_url, r, run_name,
                                                          sim_factory):
    """A shard not given to export: the warning counts the conversations with a generation in
    no shard read (a positive number), not done prompts less the generations written."""
    rows = [conversation(i) for i in range(12)]
    data = write_rows(tmp_path / "c.jsonl", rows)
    sim = sim_factory(time_scale=400, tool_call_rate=0.6, length_dist="fixed:20")
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60",
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out", "--shard-records", "8")
    shard = sorted((tmp_path / "out").glob(f"{run_name}.*.jsonl"))[0]
    lost = {rec["index"] for rec in read_jsonl(shard)}
    shard.rename(tmp_path / shard.name)
    proc = genq("export", "--out", str(tmp_path / "e.jsonl"), redis_url=redis_url,
                run=run_name, check=False)
    assert proc.returncode == 1
    assert f"genq: warning: {len(lost)} conversations have a generation with no record" in \
        proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_recover_rebuilds_the_counts_of_every_generation(tmp_path, run_name, sim_factory):
    """After a Redis loss, `genq recover` rebuilds what status counts of every generation and
    of each conversation, a redo of the truncated under way included."""
    from faultkit import private_redis

    rows = [conversation(i) for i in range(12)]
    data = write_rows(tmp_path / "c.jsonl", rows)
    sim = sim_factory(time_scale=400, tool_call_rate=0.6, length_dist="lognormal:40:0.5",
                      enable_cache_report=True)
    with private_redis() as redis_srv:
        url, r = redis_srv.url, redis_srv.client()
        genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "60",
             redis_url=url, run=run_name)
        consume_to_the_end(url, run_name, sim.url, tmp_path / "out")
        genq("requeue", "--set", "max_tokens=2000", "--redo", "truncated", redis_url=url,
             run=run_name)

        def counts() -> dict:
            status = status_of(url, run_name)
            conv = status["conversations"]
            conv.pop("generations_per_s")  # a live rate: recover rebuilds no rate buckets
            return {"conversations": conv, **{key: status[key] for key in (
                "prompt_tokens_total", "output_tokens_total", "cached_prompt_tokens_total",
                "finish_reasons")}}

        before = counts()
        assert before["conversations"]["redoing"] > 0
        r.flushall()
        genq("recover", "--shards", str(tmp_path / "out"), redis_url=url, run=run_name)
        assert counts() == before
