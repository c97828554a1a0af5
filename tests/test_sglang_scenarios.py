"""What a user meets on day one with SGLang 0.5.x, run against the simulator and, in the
real-server tier (`pytest -m real_sglang`, part of .ci/run), against a real SGLang 0.5.23:
the pipeline to the end with token sums equal to the server's own counters, capacity read
from a server launched with and without --max-running-requests, the context limit (requeue
refuses, a long prompt is lowered, never failed), requeue, and a server killed and restarted
with other flags in the middle of a run."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from conftest import genq
from faultkit import check_truth, record_figures
from pipeline import ConsumerProcess, read_jsonl, wait_for, write_dataset
from sglang_servers import CONTEXT, KINDS, SIM_PLAIN_CAPACITY, TUNED_CAPACITY, start_server

from genq.common.queue.keys import RunKeys
from genq.common.report.status import read_status
from genq.consumer.servers import identity

FLAGS = ("--poll", "0.05", "--server-wait", "300", "--visibility-timeout", "20",
         "--stall-timeout", "60", "--grace", "5")


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tuned(kind):
    server = start_server(kind, "tuned")
    yield server
    server.close()


@pytest.fixture(scope="module")
def plain(kind):
    server = start_server(kind, "plain", own=True)  # killed and restarted in another mode
    yield server
    server.close()


def produce(tmp_path, redis_url, run, n, max_tokens=24, extra_rows=()) -> int:
    data = write_dataset(tmp_path / "d.jsonl", n)
    with open(data, "a") as f:
        for i, text in enumerate(extra_rows):
            row = {"id": f"x{i}", "messages": [{"role": "user", "content": text}]}
            f.write(json.dumps(row) + "\n")
    genq("produce", str(data), "--once", "--max-tokens", str(max_tokens), redis_url=redis_url,
         run=run)
    return n + len(extra_rows)


def consume(redis_url, run, server, out, *flags) -> ConsumerProcess:
    return ConsumerProcess(redis_url, run, server.url, out, *FLAGS, *flags)


def finish(c: ConsumerProcess, timeout: float = 600) -> list[dict]:
    try:
        assert c.wait(timeout) == 0, c.log()[-4000:]
        return c.events()
    finally:
        c.cleanup()


def event(events: list[dict], name: str) -> dict:
    found = [e for e in events if e.get("event") == name]
    assert found, f"no {name} event"
    return found[0]


def test_pipeline_to_the_end_with_token_sums_equal_to_the_servers(
        tuned, tmp_path, redis_url, r, run_name):
    n = produce(tmp_path, redis_url, run_name, 12)
    prompt_before, generated_before = tuned.token_counters()
    events = finish(consume(redis_url, run_name, tuned, tmp_path / "out", "--burst"))
    prompt_after, generated_after = tuned.token_counters()
    check_truth(r, redis_url, run_name, n, tmp_path)
    records = read_jsonl(tmp_path / f"export-{run_name}.jsonl")
    completion = sum(rec["completion_tokens"] for rec in records)
    prompt = sum(rec["prompt_tokens"] for rec in records)
    record_figures(f"sglang_pipeline_{tuned.kind}", prompts=n, done=len(records),
                   completion_tokens=completion, server_generation_tokens=generated_after -
                   generated_before, prompt_tokens=prompt,
                   server_prompt_tokens=prompt_after - prompt_before)
    assert completion == generated_after - generated_before
    assert prompt == prompt_after - prompt_before
    assert event(events, "consumer_started")["capacity"] == TUNED_CAPACITY
    assert all(rec["finish_reason"] in ("stop", "length") for rec in records)
    # --reasoning-parser: the thinking is in reasoning_content, never left in content.
    assert all(isinstance(rec["reasoning_content"], str) for rec in records)
    assert not any("</think>" in rec["content"] for rec in records)


def test_capacity_and_load_of_a_server_launched_without_max_running_requests(
        plain, tmp_path, redis_url, r, run_name):
    n = produce(tmp_path, redis_url, run_name, 8)
    c = consume(redis_url, run_name, plain, tmp_path / "out")
    try:
        wait_for(lambda: r.bitcount(RunKeys(run_name).done) == n, timeout=600, what="all done")
        # What `genq status`, the monitor and /metrics show: the server's load and capacity.
        rows = wait_for(lambda: [s for s in read_status(r, run_name)["servers"]
                                 if s.get("load")], timeout=30, what="the server's load")
        c.signal(signal.SIGTERM)
        events = finish(c)
    finally:
        c.cleanup()
    reported = httpx.get(plain.url + "/v1/loads", timeout=10).json()["loads"][0]
    capacity = event(events, "consumer_started")["capacity"]
    assert capacity == reported["max_running_requests"]
    record_figures(f"sglang_plain_capacity_{plain.kind}", capacity=capacity)
    if plain.kind == "sim":
        assert capacity == SIM_PLAIN_CAPACITY
    assert rows[0]["capacity"] == capacity
    assert {"num_reqs", "num_waiting_reqs"} <= set(rows[0]["load"])
    records = check_and_export(r, redis_url, run_name, n, tmp_path)
    # No reasoning parser: genq splits the thinking off content itself (the simulator's
    # model always thinks, in <think> tags; the real tiny model writes no tags).
    assert not any("</think>" in rec["content"] for rec in records)
    if plain.kind == "sim":
        assert all(rec["reasoning_content"] for rec in records)


def check_and_export(r, redis_url, run, n, tmp_path) -> list[dict]:
    check_truth(r, redis_url, run, n, tmp_path)
    return read_jsonl(tmp_path / f"export-{run}.jsonl")


def long_prompt(server, room: int) -> tuple[str, int]:
    """A prompt that leaves about `room` tokens of the context for the answer."""
    short, longer = server.prompt_tokens("go " * 100), server.prompt_tokens("go " * 1100)
    per_word = (longer - short) / 1000
    words = 100 + int((CONTEXT - room - short) / per_word)
    text = "go " * words
    tokens = server.prompt_tokens(text)
    assert CONTEXT - 3 * room < tokens < CONTEXT, tokens
    return text, tokens


def test_context_limit_requeue_refuses_and_long_prompts_are_lowered_not_failed(
        tuned, tmp_path, redis_url, r, run_name):
    text, tokens = long_prompt(tuned, room=12)
    n = produce(tmp_path, redis_url, run_name, 6, max_tokens=24, extra_rows=[text])
    finish(consume(redis_url, run_name, tuned, tmp_path / "out", "--burst"))
    records = check_and_export(r, redis_url, run_name, n, tmp_path)
    lowered = records[-1]
    assert lowered["max_tokens_used"] == CONTEXT - tokens
    assert lowered["prompt_tokens"] == tokens

    k = RunKeys(run_name)
    before = (r.get(k.params_version), r.bitcount(k.done), r.bitcount(k.truncated))
    refused = genq("requeue", "--set", f"max_tokens={CONTEXT}", "--redo", "truncated",
                   redis_url=redis_url, run=run_name, check=False)
    assert refused.returncode == 2
    assert f"context on {identity(tuned.url)} is {CONTEXT} tokens" in refused.stderr
    assert refused.stderr.count("\n") == 1
    assert (r.get(k.params_version), r.bitcount(k.done), r.bitcount(k.truncated)) == before

    genq("requeue", "--set", "max_tokens=32", "--redo", "truncated", redis_url=redis_url,
         run=run_name)
    finish(consume(redis_url, run_name, tuned, tmp_path / "out", "--burst"))
    redone = check_and_export(r, redis_url, run_name, n, tmp_path)
    assert {rec["params_version"] for rec in redone if rec["finish_reason"] == "length"} == {2}


def test_server_killed_and_restarted_with_other_flags_mid_run(
        plain, tmp_path, redis_url, r, run_name):
    # A server without --max-running-requests takes every prompt at once: longer answers keep
    # some of them running when the first ones are done.
    n = produce(tmp_path, redis_url, run_name, 60 if plain.kind == "real" else 300,
                max_tokens=96)
    c = consume(redis_url, run_name, plain, tmp_path / "out", "--max-attempts", "1")
    k = RunKeys(run_name)
    try:
        wait_for(lambda: r.bitcount(k.done) >= 3, timeout=600, interval=0.01,
                 what="first results")
        plain.kill()
        done_at_kill = r.bitcount(k.done)
        plain.restart("tuned")  # the same URL, now with --max-running-requests 16
        wait_for(lambda: r.bitcount(k.done) == n, timeout=600, what="all done")
        wait_for(lambda: "server_capacity_changed" in c.log(), timeout=30,
                 what="the new capacity picked up")
        c.signal(signal.SIGTERM)
        events = finish(c)
    finally:
        c.cleanup()
    changed = event(events, "server_capacity_changed")
    # A refusal logs requests_refused at once; only a pause of 0.5 s or more logs claiming_paused.
    paused = sum(e.get("event") in ("claiming_paused", "requests_refused") for e in events)
    record_figures(f"sglang_kill_restart_{plain.kind}", prompts=n, done_at_kill=done_at_kill,
                   capacity_before=changed["old"], capacity_after=changed["new"],
                   claiming_paused=paused)
    assert done_at_kill < n and paused >= 1  # requests were cut by the crash
    assert changed["new"] == TUNED_CAPACITY and changed["old"] != TUNED_CAPACITY
    # Requests cut by the crash came back without spending an attempt (--max-attempts 1).
    check_truth(r, redis_url, run_name, n, tmp_path)
