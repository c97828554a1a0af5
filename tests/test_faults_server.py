"""Faults of the SGLang server and of the data: 5xx for a while, a request that never answers,
a connection reset mid-response, a prompt the server always rejects, malformed rows. Trouble
with the server must cost no attempt (--max-attempts 1 turns any spent attempt into a failure
the test would see); a bad task fails at once with its reason."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import genq
from faultkit import (
    VT,
    Consumer,
    check_truth,
    claims,
    owners,
    produce_once,
    record_figures,
    sim_kwargs,
    wait_done,
)
from pipeline import read_jsonl, wait_for, write_dataset
from rq.job import Job
from rq.registry import FailedJobRegistry
from sim_fixtures import SimProcess, sim_flags
from timescale import RETRY_AFTER_CAP

from genq.common.errors import reason_kind
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import failure_reasons
from genq.consumer.backoff import MAX_BACKOFF_S


def sim_faults(sim, **body) -> None:
    httpx.post(sim.url + "/_sim/faults", json=body, timeout=5).raise_for_status()


def sim_stats(sim) -> dict:
    return httpx.get(sim.url + "/_sim/stats", timeout=5).json()


@pytest.mark.slow  # a real 20 s outage, the figure docs/RELIABILITY.md gives
@pytest.mark.timeout(150)
def test_server_5xx_for_20s_spends_no_attempt_and_throughput_recovers(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 60
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.3))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1")
    k = RunKeys(run_name)
    try:
        wait_done(r, run_name, 8)
        sim_faults(sim, status=500, for_s=10)
        time.sleep(10)
        sim_faults(sim, status=503, for_s=10)
        time.sleep(9)
        done_during = r.bitcount(k.done)
        time.sleep(1)
        recovery_s = wait_for_more(r, k, done_during)
        assert c.wait(90) == 0, c.log()[-3000:]
        seen = c.event_names()
    finally:
        c.cleanup()
    errors = sim_stats(sim)["fault_errors"]
    assert errors > 0 and seen["claiming_paused"] >= 2 and seen["claiming_resumed"] >= 1
    assert not r.bitcount(k.failed)
    # After the outage the consumer is back at work within the longest (jittered) pause.
    assert recovery_s <= MAX_BACKOFF_S * 1.5 + 3
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    record_figures("server_5xx_20s", recovery_s=recovery_s, requests_refused=errors,
                   claiming_paused=seen["claiming_paused"], attempts_spent=0, **figures)


def test_a_retry_after_of_a_day_pauses_claiming_no_longer_than_the_cap(
        tmp_path, redis_url, r, run_name, sim_factory):
    # A load balancer answers 503 with Retry-After: 86400 while its backend restarts; once it
    # serves again the consumer must be back within the cap, not a day later. The cap is a
    # setting (60 s by default, docs/REFERENCE.md); here it is the tests' scaled one.
    n = 12
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    sim_faults(sim, status=503, retry_after=86400)
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1",
                 "--max-retry-after", str(RETRY_AFTER_CAP))
    try:
        wait_for(lambda: c.event_names()["claiming_paused"] >= 1, timeout=60,
                 what="the consumer paused by the 503")
        sim_faults(sim, status=None, retry_after=None)
        lifted = time.monotonic()
        assert c.wait(60) == 0, c.log()[-3000:]
        back_s = time.monotonic() - lifted
        pauses = [e["pause_s"] for e in c.events() if e.get("event") == "claiming_paused"]
    finally:
        c.cleanup()
    # Each pause was the cap itself: the day asked for was obeyed only up to it.
    assert pauses and set(pauses) == {RETRY_AFTER_CAP}, pauses
    assert back_s < RETRY_AFTER_CAP + 30, back_s
    check_truth(r, redis_url, run_name, n, tmp_path)


@pytest.mark.slow  # a fault run of 120
def test_a_503_now_and_then_is_sent_again_by_its_slot_not_through_the_queue(
        tmp_path, redis_url, r, run_name, sim_factory):
    # A busy server refuses one request in ten: the slot sends it again after a moment, as a
    # plain retrying client does, holding its lease; it is not given back and claimed anew.
    n = 120
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.3, error_rate=0.1))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
        log = c.log()
    finally:
        c.cleanup()
    refused = sim_stats(sim)["fault_errors"]
    claimed_again = sum(claims(r, run_name, n)) - n
    assert refused >= 5 and claimed_again < refused / 2, (refused, claimed_again)
    assert "requests_refused" in log  # still counted, once a minute
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    assert figures["done"] == n and not r.bitcount(RunKeys(run_name).failed)


def wait_for_more(r, k: RunKeys, before: int) -> float:
    start = time.monotonic()
    wait_for(lambda: r.bitcount(k.done) > before, timeout=60, interval=0.02,
             what="progress after the fault ended")
    return round(time.monotonic() - start, 2)


@pytest.mark.slow  # a hang past the lease
def test_server_that_never_answers_times_out_keeps_the_lease_and_redoes_the_task(
        tmp_path, redis_url, r, run_name, sim_factory):
    n, concurrency = 30, 4
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    # Every request hangs until the test ends the fault, so the first one of each slot does: a
    # 0.5 s hang after some progress caught fewer than every slot, or none, on a busy machine.
    sim_faults(sim, hang=True)
    # The check past the visibility timeout has 5.5 s to spare before the requests time out.
    timeout = 4 * VT
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1",
                 "--request-timeout", str(timeout), concurrency=concurrency)
    try:
        wait_for(lambda: sim_stats(sim)["hung"] >= concurrency, what="every slot hung")
        held = owners(r, run_name)
        time.sleep(VT + 0.5)
        still = owners(r, run_name)
        sim_faults(sim, hang=False)
        assert c.wait(60) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    redone = [i for i, a in enumerate(claims(r, run_name, n)) if a > 1]
    # A request that timed out is a hang: its task goes back, not to its slot again.
    assert len(redone) >= concurrency and not r.bitcount(RunKeys(run_name).failed)
    # Past the visibility timeout every hung request's lease was still held, same token.
    hung = [f"{run_name}-{i}" for i in redone]
    assert all(j in held and still.get(j) == held[j] for j in hung), (held, still, hung)
    record_figures("server_never_answers", hung=sim_stats(sim)["hung"], redone=len(redone),
                   request_timeout_s=timeout, **figures)


def test_connection_reset_mid_response_is_retried_and_writes_no_partial_completion(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 30
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2, reset_rate=0.3))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    resets = sim_stats(sim)["resets"]
    assert resets >= 1
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    # A reset answer never became a record: every shard line is whole, and no index has two.
    assert figures["broken_shard_lines"] == 0 and figures["duplicate_lines"] == 0
    # Sent again by its slot, or given back and claimed anew: never an attempt spent.
    assert not r.bitcount(RunKeys(run_name).failed)
    record_figures("connection_reset", resets=resets, **figures)


def test_poison_prompt_fails_after_one_attempt_with_the_servers_message(
        tmp_path, redis_url, r, run_name, sim_factory):
    n, poison = 30, {3, 17}
    produce_once(write_dataset(tmp_path / "d.jsonl", n, poison=tuple(poison)), redis_url,
                 run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out")
    try:
        assert c.wait(60) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    figures = check_truth(r, redis_url, run_name, n, tmp_path, failed=poison)
    attempts = claims(r, run_name, n)
    assert [attempts[i] for i in sorted(poison)] == [1, 1]
    # RQ's failed registry (what `rq info` and rq-dashboard read) has them, with the reason.
    failed = FailedJobRegistry(RunKeys(run_name).queue_name, connection=r).get_job_ids()
    assert sorted(failed) == sorted(f"{run_name}-{i}" for i in poison)
    for i in poison:
        reason = Job.fetch(f"{run_name}-{i}", connection=r).latest_result().exc_string
        assert "HTTP 400" in reason and "rejected marker" in reason
    record_figures("poison_prompt", attempts_spent=1, **figures)


@pytest.mark.timeout(150)
def test_a_prompt_the_server_fails_every_time_fails_after_a_bounded_number_of_claims(
        tmp_path, redis_url, r, run_name, sim_factory):
    # Server trouble spends no attempt, so a prompt that makes the server answer 503 every
    # time (or abort, or die) would be claimed for ever; the claims of a task are bounded
    # (--max-claims, default 10 x --max-attempts) whatever their outcome. Retry-After: 0 keeps
    # the pauses between its claims short.
    n, poison = 20, 5
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    sim_faults(sim, error_marker=f"program number {poison}.", retry_after=0)
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    check_truth(r, redis_url, run_name, n, tmp_path, failed={poison})
    assert claims(r, run_name, n)[poison] == 11  # the 11th claim gives up
    kind = failure_reasons(r, RunKeys(run_name), [poison])[0]  # Redis keeps the kind
    assert "gave up after N claims" in kind and "HTTP 503" in kind, kind
    (line,) = [rec for shard in (tmp_path / "out").glob("**/*.jsonl")
               for rec in read_jsonl(shard) if rec.get("status") == "failed"]  # whole reason
    assert "gave up after 10 claims" in line["error"], line


@pytest.mark.slow  # a server restart window
@pytest.mark.timeout(150)
def test_claims_refused_while_the_server_restarts_do_not_count_towards_max_claims(
        tmp_path, redis_url, r, run_name):
    # A refused connection never reached the server: no prompt can be why, so a server down
    # for many pauses (each a claim of the tasks it refuses) fails none of them.
    n = 40
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    flags = sim_flags(**sim_kwargs(0.3))
    sim = SimProcess(*flags).start()
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1",
                 "--max-claims", "3")
    try:
        wait_done(r, run_name, 5)
        sim.kill()
        wait_for(lambda: c.event_names()["claiming_paused"] >= 5, timeout=60,
                 what="five pauses while the server is down")
        sim = SimProcess(*flags, port=sim.port).start()
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
        sim.cleanup()
    check_truth(r, redis_url, run_name, n, tmp_path)


def test_malformed_rows_fail_with_their_index_and_crash_nothing(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 30
    data = write_dataset(tmp_path / "d.jsonl", n, bad_json=(4,), no_fields=(9,))
    lines = data.read_text().splitlines()
    lines[14] = "[1, 2, 3]"
    lines[21] = '{"prompt": 5}'
    data.write_text("\n".join(lines) + "\n")
    bad = {4, 9, 14, 21}
    produce_once(data, redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out")
    try:
        assert c.wait(60) == 0, c.log()[-3000:]
        reported = {e["index"]: e["reason"] for e in c.events() if e.get("event") == "task_failed"}
    finally:
        c.cleanup()
    assert set(reported) == bad
    assert all(reason.startswith(f"row {i}: ") for i, reason in reported.items())
    # Kept once per reason, its row number blanked (status and export --include-failed show it).
    stored = dict(zip(sorted(bad), failure_reasons(r, RunKeys(run_name), sorted(bad)),
                      strict=True))
    assert stored == {i: reason_kind(reason) for i, reason in reported.items()}
    figures = check_truth(r, redis_url, run_name, n, tmp_path, failed=bad)
    assert {rec["index"] for rec in read_jsonl(tmp_path / f"export-{run_name}.jsonl")} \
        == set(range(n)) - bad
    record_figures("malformed_rows", reported=len(reported), **figures)


@pytest.mark.slow  # an outage window
@pytest.mark.timeout(150)
def test_an_html_page_on_the_info_endpoints_is_waited_out_like_a_server_that_is_down(
        tmp_path, redis_url, r, run_name, sim_factory):
    # A proxy's maintenance page, answered with 200 on /v1/models and /get_server_info: at start
    # the consumer waits for the server; mid-run the context check (every 2.5 s) rides it out.
    n = 120
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.3))
    sim_faults(sim, info_html=True, for_s=3)
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1")
    try:
        wait_for(lambda: r.bitcount(RunKeys(run_name).done) >= 4 or c.proc.poll() is not None,
                 timeout=60, what="4 prompts done")
        assert c.proc.poll() is None, c.log()[-3000:]
        sim_faults(sim, info_html=True, for_s=6)
        assert c.wait(90) == 0, c.log()[-3000:]
        seen = c.event_names()
    finally:
        c.cleanup()
    assert seen["waiting_for_server"] >= 1 and not seen["background_task_crashed"]
    assert seen["server_info_unavailable"] >= 1 and seen["server_info_back"] >= 1
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    assert figures["done"] == n and not r.bitcount(RunKeys(run_name).failed)


def test_failed_records_name_their_row_and_carry_its_id(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 20
    data = write_dataset(tmp_path / "d.jsonl", n, bad_json=(4,), no_fields=(9,), poison=(14,))
    produce_once(data, redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out")
    try:
        assert c.wait(60) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    check_truth(r, redis_url, run_name, n, tmp_path, failed={4, 9, 14})  # the plain export
    out = tmp_path / "with-failed.jsonl"
    genq("export", "--out", str(out), "--include-failed", redis_url=redis_url, run=run_name)
    records = read_jsonl(out)
    assert [rec["index"] for rec in records] == list(range(n))
    failed = {rec["index"]: rec for rec in records if rec.get("status") == "failed"}
    assert set(failed) == {4, 9, 14}
    assert failed[4]["error"].startswith("row 4: not valid JSON") and "id" not in failed[4]
    assert failed[9]["error"] == "row 9: has neither 'messages' nor 'prompt'"
    assert failed[9]["id"] == "p9"  # a row that has one names it, however it failed
    assert "HTTP 400" in failed[14]["error"] and failed[14]["id"] == "p14"
