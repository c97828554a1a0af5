"""Whole answers (the default, no --stream) watched through the server's load: a paused
consumer whose requests time out meanwhile, a server without a readable /v1/loads, and one
load read per server however many requests are in flight."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from faultkit import Consumer, claims, produce_once, sim_kwargs
from pipeline import wait_for, write_dataset

from genq.common.queue.keys import RunKeys


@pytest.mark.slow  # a pause past the request timeout
def test_a_consumer_paused_past_the_request_timeout_leaves_no_exception_unretrieved(
        tmp_path, redis_url, r, run_name, sim_factory):
    # Paused with whole answers outstanding: on waking, the request timeout and the socket's
    # read timeout fire together, and the request's own task ends with the socket's error.
    produce_once(write_dataset(tmp_path / "d.jsonl", 8), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(20.0))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--request-timeout", "2",
                 "--stall-timeout", "60", "--max-attempts", "100")
    try:
        wait_for(lambda: httpx.get(sim.url + "/_sim/stats").json()["running"] >= 4,
                 what="whole answers outstanding")
        c.signal(signal.SIGSTOP)
        time.sleep(4)
        c.signal(signal.SIGCONT)
        wait_for(lambda: "no whole answer within" in c.log() or "TimeoutError" in c.log(),
                 timeout=30, what="the timed-out requests given back")
        time.sleep(2)
        c.signal(signal.SIGTERM)
        c.wait(30)
        log = c.log()
    finally:
        c.cleanup()
    assert "was never retrieved" not in log, log[-4000:]


@pytest.mark.slow  # answers three stall timeouts long
def test_whole_answers_without_a_readable_load_finish_and_are_never_taken_for_a_hang(
        tmp_path, redis_url, r, run_name, sim_factory):
    # A server without /v1/loads (404: an older SGLang, a gateway) gives whole answers no sign
    # of life; answers three times --stall-timeout long must still finish, each at its first go.
    n = 16
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(6.0, legacy_get_load=True))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--stall-timeout", "2",
                 "--max-attempts", "1", concurrency=16)
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
        events = c.events()
    finally:
        c.cleanup()
    assert not [e for e in events if "answer silent for" in str(e.get("error", ""))]
    assert [e["event"] for e in events].count("stall_watch_off") == 1
    assert r.bitcount(RunKeys(run_name).done) == n
    assert claims(r, run_name, n) == [1] * n


@pytest.mark.slow  # a frozen load endpoint's window
def test_the_load_is_read_once_per_server_however_many_whole_answers_are_in_flight(
        tmp_path, redis_url, r, run_name, sim_factory):
    # A load endpoint slow to answer (frozen 4 s) leaves every request's watchdog with a load
    # older than it accepts: they must wait for the one read under way, not each send their own.
    n = 64
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(20.0, max_running_requests=n))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", concurrency=n)

    def stats() -> dict:
        return httpx.get(sim.url + "/_sim/stats", timeout=10).json()

    try:
        wait_for(lambda: stats()["running"] >= n, timeout=60, what="every request in flight")
        before, started = stats()["load_reads"], time.monotonic()
        httpx.post(sim.url + "/_sim/faults", json={"info_hang": True, "for_s": 4},
                   timeout=5).raise_for_status()
        time.sleep(7)
        reads, window_s = stats()["load_reads"] - before, time.monotonic() - started
    finally:
        c.cleanup()
    # The follower's read once a second, and a watchdog's when that one is late: a few, not n.
    assert reads <= window_s + 3, (reads, window_s)
