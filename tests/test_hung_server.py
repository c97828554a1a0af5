"""A server that accepts requests and never answers (the simulator's `hang` fault) is noticed
within --stall-timeout, not after --request-timeout (an hour by default, which long generations
need): by its load standing still (whole answers, the default) or by the silence of the streamed
answer (--stream). The tasks come back without spending an attempt (--max-attempts 1 would turn
any spent attempt into a failure)."""

from __future__ import annotations

import time
from datetime import datetime

import httpx
import pytest
from faultkit import Consumer, check_truth, claims, produce_once, record_figures, sim_kwargs
from faultkit import wait_done as wait_done_at_least
from pipeline import wait_for, write_dataset

from genq.common.queue.keys import RunKeys

STALL_S = 2.0


def _ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


@pytest.mark.slow  # waits out the stall windows
@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_hung_server_is_noticed_by_silence_and_the_tasks_come_back_unspent(
        tmp_path, redis_url, r, run_name, sim_factory, mode):
    n = 60
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.3))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1",
                 "--request-timeout", "3600", "--stall-timeout", str(STALL_S),
                 *(["--stream"] if mode == "stream" else []))
    try:
        wait_done_at_least(r, run_name, 5)
        hang_at = time.time()
        httpx.post(sim.url + "/_sim/faults", json={"hang": True, "for_s": 3},
                   timeout=5).raise_for_status()
        wait_for(lambda: httpx.get(sim.url + "/_sim/stats").json()["hung"] >= 1,
                 what="a request hung")
        # With an hour's request timeout, only the stall watchdog can finish this run.
        assert c.wait(90) == 0, c.log()[-3000:]
        events = c.events()
    finally:
        c.cleanup()
    stalled = [e for e in events if "answer silent for" in str(e.get("error", ""))]
    assert stalled, "no request was given back for silence"
    assert not r.bitcount(RunKeys(run_name).failed)
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    redone = [i for i, a in enumerate(claims(r, run_name, n)) if a > 1]
    assert redone
    hung = httpx.get(sim.url + "/_sim/stats").json()["hung"]
    noticed_s = round(_ts(stalled[0]) - hang_at, 2)
    record_figures(f"server_hangs_3s_{mode}", hung=hung, redone=len(redone),
                   noticed_after_s=noticed_s,
                   stall_timeout_s=STALL_S, request_timeout_s=3600, **figures)


@pytest.mark.slow  # waits out the stall windows
def test_requests_queued_inside_the_server_are_not_taken_for_a_hang(
        tmp_path, redis_url, r, run_name, sim_factory):
    # One slot on the server and three requests in flight: two wait silently in the server's
    # queue for longer than --stall-timeout, which the server's load explains.
    n = 6
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(max_running_requests=1, time_scale=2, length_dist="fixed:100")
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1",
                 "--stall-timeout", "0.5", concurrency=3)
    try:
        assert c.wait(120) == 0, c.log()[-3000:]
        events = c.events()
    finally:
        c.cleanup()
    assert not [e for e in events if "answer silent for" in str(e.get("error", ""))]
    assert httpx.get(sim.url + "/_sim/stats").json()["max_running_seen"] == 1
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    assert figures["done"] == n and claims(r, run_name, n) == [1] * n


@pytest.mark.slow  # waits out the stall windows
def test_requests_a_busy_server_lost_are_noticed_by_whole_answers_too(
        tmp_path, redis_url, r, run_name, sim_factory):
    # Requests sent in a short window are never answered while the server goes on answering
    # the others: its load keeps moving, but it holds fewer requests than are in flight, and
    # the oldest of those are the ones it lost. They are noticed while it is still busy.
    n = 48
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(4.0))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1",
                 "--request-timeout", "3600", "--stall-timeout", "1")
    done = RunKeys(run_name).done
    try:
        wait_done_at_least(r, run_name, 4)
        # The window lasts until a request fell into it: how soon the next request is sent
        # depends on the answers' lengths, which a window of fixed length would bet on.
        httpx.post(sim.url + "/_sim/faults", json={"hang": True, "for_s": 30.0},
                   timeout=5).raise_for_status()
        wait_for(lambda: httpx.get(sim.url + "/_sim/stats").json()["hung"] >= 1,
                 interval=0.02, what="a request hung")
        httpx.post(sim.url + "/_sim/faults", json={"hang": False},
                   timeout=5).raise_for_status()
        wait_for(lambda: any("answer silent for" in str(e.get("error", "")) for e in c.events()),
                 timeout=60, interval=0.02, what="a lost request noticed")
        busy_when_noticed = httpx.get(sim.url + "/_sim/stats").json()["running"]
        done_when_noticed = r.bitcount(done)
        assert c.wait(120) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    assert busy_when_noticed > 0 and done_when_noticed < n - 16
    assert httpx.get(sim.url + "/_sim/stats").json()["hung"] >= 1
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    assert figures["done"] == n and not r.bitcount(RunKeys(run_name).failed)


@pytest.mark.slow  # waits out the stall windows
@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_a_server_that_stops_decoding_while_it_holds_a_queue_is_noticed_by_silence(
        tmp_path, redis_url, r, run_name, sim_factory, mode):
    # Twice as many requests in flight as the server runs: it always holds a queue, which is
    # no sign of life once its running requests stand still (the simulator's `stall` fault).
    n = 40
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(1.0, max_running_requests=4))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1",
                 "--request-timeout", "3600", "--stall-timeout", str(STALL_S),
                 *(["--stream"] if mode == "stream" else []), concurrency=8)
    try:
        wait_done_at_least(r, run_name, 4)
        wait_for(lambda: httpx.get(sim.url + "/_sim/stats").json()["waiting"] > 0,
                 what="a queue in the server")
        stall_at = time.time()
        httpx.post(sim.url + "/_sim/faults", json={"stall": True, "for_s": 60},
                   timeout=5).raise_for_status()
        # With an hour's request timeout, only the stall watchdog notices while it lasts.
        wait_for(lambda: any("answer silent for" in str(e.get("error", "")) for e in c.events()),
                 timeout=STALL_S + 20, what="the stalled server noticed")
        noticed_s = round(time.time() - stall_at, 2)
        httpx.post(sim.url + "/_sim/faults", json={"stall": False}, timeout=5).raise_for_status()
        assert c.wait(120) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    assert figures["done"] == n and not r.bitcount(RunKeys(run_name).failed)
    record_figures(f"server_stalls_with_a_queue_{mode}", noticed_after_s=noticed_s,
                   stall_timeout_s=STALL_S, **figures)
