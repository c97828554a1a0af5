"""The prompt tokens a server found in its prefix cache (SGLang with --enable-cache-report:
`usage.prompt_tokens_details.cached_tokens`) are kept in each record; an answer that reports
none leaves the record without the field, never a made-up 0."""

from __future__ import annotations

import json

import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl

SYSTEM = {"role": "system", "content": "You are a careful assistant who reads every word. " * 8}


def _run(tmp_path, redis_url, run_name, sim, *flags: str) -> list[dict]:
    data = tmp_path / "shared-prefix.jsonl"
    rows = [{"id": f"q{i}", "messages": [SYSTEM, {"role": "user", "content": f"Question {i}?"}]}
            for i in range(2)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    genq("produce", str(data), "--once", "--max-tokens", "64", redis_url=redis_url, run=run_name)
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--burst", *flags)
    try:
        assert consumer.wait(90) == 0, consumer.log()[-3000:]
    finally:
        consumer.cleanup()
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    return read_jsonl(out)


@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_records_keep_the_cached_prompt_tokens_the_server_reports(
        mode, tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400, length_dist="fixed:20", enable_cache_report=True)
    records = _run(tmp_path, redis_url, run_name, sim, *(["--stream"] if mode == "stream" else []))
    assert len(records) == 2
    # Whichever row the server saw first found nothing cached (SGLang then says null); the
    # other found the shared system prompt.
    first, second = sorted(records, key=lambda rec: rec.get("cached_tokens", -1))
    assert "cached_tokens" not in first
    assert 0 < second["cached_tokens"] < second["prompt_tokens"]


def test_a_server_without_cache_report_leaves_the_field_out(
        tmp_path, redis_url, run_name, sim_factory):
    sim = sim_factory(time_scale=400, length_dist="fixed:20")
    assert all("cached_tokens" not in rec for rec in _run(tmp_path, redis_url, run_name, sim))
