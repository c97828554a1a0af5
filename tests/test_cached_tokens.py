"""The prompt tokens a server found in its prefix cache (SGLang with --enable-cache-report:
`usage.prompt_tokens_details.cached_tokens`, 0 on a miss) are kept in each record; an answer
that reports nothing (a server without the flag: null) leaves the record without the field,
never a made-up 0."""

from __future__ import annotations

import json

import orjson
import pytest
from conftest import ack_call, genq
from pipeline import consume_to_the_end, exported
from prometheus_client.parser import text_string_to_metric_families
from sglang_servers import KINDS, start_server
from test_scripts import claim, setup_run

from genq.common.queue import feed, scripts
from genq.monitor.metrics import render

SYSTEM = {"role": "system", "content": "You are a careful assistant who reads every word. " * 8}


def _consume(tmp_path, redis_url, run_name, sim, *flags: str) -> list[dict]:
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out", *flags)
    return exported(tmp_path, redis_url, run_name)


def _run(tmp_path, redis_url, run_name, sim, *flags: str, rows: int = 2,
         system: dict = SYSTEM) -> list[dict]:
    data = tmp_path / f"{run_name}.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        system, {"role": "user", "content": f"Question {i}?"}]}) + "\n" for i in range(rows)))
    genq("produce", str(data), "--once", "--max-tokens", "64", redis_url=redis_url, run=run_name)
    return _consume(tmp_path, redis_url, run_name, sim, *flags)


def _status(redis_url, run_name) -> dict:
    return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)


def _agrees(status: dict, records: list[dict]) -> None:
    """The run's cache counters are the sums over the standing records."""
    prompt = sum(rec["prompt_tokens"] for rec in records)
    cached = sum(rec.get("cached_tokens", 0) for rec in records)
    assert 0 < cached < prompt
    assert (status["prompt_tokens_total"], status["cached_prompt_tokens_total"]) == (prompt,
                                                                                     cached)
    assert status["cache_hit_share"] == pytest.approx(cached / prompt, abs=1e-4)


@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_records_keep_the_cached_prompt_tokens_the_server_reports(
        mode, tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400, length_dist="fixed:20", enable_cache_report=True)
    records = _run(tmp_path, redis_url, run_name, sim, *(["--stream"] if mode == "stream" else []))
    assert len(records) == 2
    # Whichever row the server saw first found nothing cached (SGLang 0.5.23 then says 0); the
    # other found the shared system prompt.
    first, second = sorted(records, key=lambda rec: rec.get("cached_tokens", -1))
    assert first["cached_tokens"] == 0
    assert 0 < second["cached_tokens"] < second["prompt_tokens"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_server_reports_the_cached_prefix_of_a_prompt_sent_again(
        kind, tmp_path, redis_url, run_name):
    """The same long system prompt twice, one request after the other (--concurrency 1: two at
    once would both be prefilled before either is cached), whole and streamed answers: the
    second record keeps the hit the server reports, and status counts it. On the real tier
    this checks what SGLang 0.5.23 itself sends with --enable-cache-report."""
    server = start_server(kind, "cache")
    try:
        for mode in ("whole", "stream"):
            run = f"{run_name}-{mode}"
            # Another system prompt each time, so the streamed run starts from an empty cache.
            system = {**SYSTEM, "content": f"({mode}) " + SYSTEM["content"]}
            (tmp_path / mode).mkdir()
            records = _run(tmp_path / mode, redis_url, run, server, "--concurrency", "1",
                           "--server-wait", "300",
                           *(["--stream"] if mode == "stream" else []), system=system)
            # The first found at most the chat template's opening cached (an earlier run's
            # prompts begin with it too); SGLang still says how many, 0 included, never null.
            first, second = sorted(records, key=lambda rec: rec.get("cached_tokens", -1))
            assert 0 <= first["cached_tokens"] < first["prompt_tokens"] // 2, (mode, first)
            assert second["prompt_tokens"] // 2 < second["cached_tokens"] < second[
                "prompt_tokens"], (mode, second)
            status = _status(redis_url, run)
            assert status["cached_prompt_tokens_total"] == (
                first["cached_tokens"] + second["cached_tokens"]), mode
    finally:
        server.close()


def test_a_server_without_cache_report_leaves_the_field_out(
        tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400, length_dist="fixed:20")
    assert all("cached_tokens" not in rec for rec in _run(tmp_path, redis_url, run_name, sim))


@pytest.mark.slow  # a Redis loss and recover
def test_status_shows_the_cache_hit_share_through_a_redo_and_a_recover(
        tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400, length_dist="lognormal:60:0.8", enable_cache_report=True)
    records = _run(tmp_path, redis_url, run_name, sim, rows=8)
    assert any(rec["finish_reason"] == "length" for rec in records)
    _agrees(_status(redis_url, run_name), records)
    # A redo takes the replaced results' counts away and the new ones add theirs.
    genq("requeue", "--set", "max_tokens=500", "--redo", "truncated", redis_url=redis_url,
         run=run_name)
    records = _consume(tmp_path, redis_url, run_name, sim)
    assert all(rec["finish_reason"] == "stop" for rec in records)
    _agrees(_status(redis_url, run_name), records)
    # Recover rebuilds the counters from the shards alone.
    genq("recover", "--shards", str(tmp_path / "out"), redis_url=redis_url, run=run_name)
    status = _status(redis_url, run_name)
    _agrees(status, records)
    table = genq("status", redis_url=redis_url, run=run_name).stdout
    assert f"cached {status['cached_prompt_tokens_total']:,} " in table
    assert f"({status['cache_hit_share']:.1%} cache hits)" in table
    # The monitor's /metrics, made from the same status as /api/status and the page.
    samples = {s.name: s.value for family in text_string_to_metric_families(render(status))
               for s in family.samples}
    assert samples["genq_cached_prompt_tokens_total"] == status["cached_prompt_tokens_total"]
    assert samples["genq_prompt_tokens_total"] == status["prompt_tokens_total"]


def test_a_redo_takes_the_cached_tokens_away_and_a_failed_one_puts_them_back(r, run_name):
    k, runner = setup_run(r, run_name, 1)
    ((jid, idx, ex, att),) = claim(runner, k)
    runner(ack_call(k, jid, idx, ex, completion_tokens=50, prompt_tokens=90, cached=64,
                    finish_reason="length", version=1, attempt=att, server="s"))
    assert r.hget(k.counters, "cached_sum") == b"64"
    assert runner(scripts.redo_call(k, "truncated", 0, 1, 2)) == [1, 1]
    assert r.hget(k.counters, "cached_sum") == b"0"
    feed.enqueue(r, k, [idx], runner)
    ((jid, idx, ex, att),) = claim(runner, k)
    # The new attempt fails for good: the result set aside stands again, with its counts.
    assert runner(scripts.fail_call(k, jid, idx, ex, reason="gave up", worker="w1")) == 2
    assert r.hget(k.counters, "cached_sum") == b"64"
