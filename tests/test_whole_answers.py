"""Whole answers (the default, no --stream) watched through the server's load: a paused
consumer whose requests time out meanwhile, a server without a readable /v1/loads, and one
load read per server however many requests are in flight."""

from __future__ import annotations

import signal
import time

import httpx
from faultkit import Consumer, produce_once, sim_kwargs
from pipeline import wait_for, write_dataset


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
