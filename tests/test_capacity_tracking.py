"""The slot count follows the server: another client sharing it is left its share (no waiting
queue builds up on the server), and its slots come back when it leaves. The pure rules first,
then a real consumer beside a real neighbour on a real simulator."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import REPO, genq
from pipeline import ConsumerProcess, wait_for, write_dataset

from genq.common.report.status import read_status
from genq.consumer.follow import next_capacity, others, target_slots, withdrawn

FLAGS = ("--poll", "0.05", "--server-wait", "60", "--visibility-timeout", "30", "--grace", "2")
MAX, K = 16, 6  # the server's max running requests; the neighbour's requests in flight
# ~0.55 s per request: (0.5 s to the first token + 100 tokens at 87.5 tok/s) / 3.
SIM = dict(max_running_requests=MAX, time_scale=3, length_dist="fixed:100")


# --- the pure rules ----------------------------------------------------------------------
def test_others_are_what_the_server_holds_beyond_ours():
    assert others(running=64, waiting=0, ours=48) == 16  # others running
    assert others(running=64, waiting=16, ours=64) == 16  # others waiting behind us
    assert others(running=40, waiting=0, ours=42) == 0  # ours not arrived yet: never negative


def test_target_leaves_the_others_their_share():
    assert target_slots(running=64, waiting=0, max_running=64, ours=48) == 48
    assert target_slots(running=64, waiting=16, max_running=64, ours=64) == 48
    assert target_slots(running=30, waiting=0, max_running=64, ours=30) == 64  # alone
    assert target_slots(running=64, waiting=0, max_running=64, ours=0) == 1  # never below 1
    assert target_slots(running=64, waiting=90, max_running=64, ours=0) == 1
    # Ours sent but not yet at the server: others are never counted negative.
    assert target_slots(running=10, waiting=0, max_running=64, ours=20) == 64


def test_a_queue_withdraws_our_part_of_it():
    # A neighbour's 16 queue behind our 64: 16 x 64/80 = 12.8 of them are ours to withdraw.
    assert withdrawn(64, running=64, waiting=16, max_running=64, ours=64) == 51
    # Once our slots above 51 have ended, the 3 left over: down to the neighbour's share.
    assert withdrawn(51, running=64, waiting=3, max_running=64, ours=51) == 48
    # Two genqs with 64 each: each withdraws half, and they share the server.
    assert withdrawn(64, running=64, waiting=64, max_running=64, ours=64) == 32
    # Our one request of the 65 held: one slot less (rounded up, never nothing).
    assert withdrawn(64, running=64, waiting=1, max_running=64, ours=1) == 63
    # Never below one slot, however many the others hold.
    assert withdrawn(4, running=64, waiting=200, max_running=64, ours=4) == 1


def test_nothing_is_withdrawn_without_a_queue_of_ours():
    assert withdrawn(64, running=64, waiting=0, max_running=64, ours=64) == 64  # full, fine
    # Our requests above a lowered count are still there: wait for them to end first.
    assert withdrawn(51, running=64, waiting=16, max_running=64, ours=64) == 51
    # A queue while slots are free is the KV pool's doing (the advice's), not the slots'.
    assert withdrawn(64, running=40, waiting=9, max_running=64, ours=49) == 64
    assert withdrawn(64, running=64, waiting=5, max_running=64, ours=0) == 64  # no work here


def test_a_queue_lowers_at_once():
    assert next_capacity(64, target=48, previous=None, lowered=51, waiting=16) == 51
    assert next_capacity(64, target=48, previous=64, lowered=51, waiting=3) == 51


def test_without_a_queue_a_change_needs_two_samples():
    # One sample taken as a request ended looks like a neighbour: noise, ignored.
    assert next_capacity(64, target=63, previous=None, lowered=64, waiting=0) == 64
    assert next_capacity(64, target=63, previous=64, lowered=64, waiting=0) == 64
    # Two agree: lowered, only as far as the smaller move.
    assert next_capacity(64, target=60, previous=62, lowered=64, waiting=0) == 62
    # Raising always needs two samples, and goes as far as the smaller of the two.
    assert next_capacity(48, target=64, previous=None, lowered=48, waiting=0) == 48
    assert next_capacity(48, target=64, previous=48, lowered=48, waiting=0) == 48
    assert next_capacity(48, target=64, previous=60, lowered=48, waiting=0) == 60
    assert next_capacity(48, target=64, previous=64, lowered=48, waiting=0) == 64
    # Samples on either side of the count: no move.
    assert next_capacity(48, target=50, previous=46, lowered=48, waiting=0) == 48
    assert next_capacity(48, target=48, previous=64, lowered=48, waiting=0) == 48


def test_never_raised_while_the_server_has_a_queue():
    assert next_capacity(32, target=40, previous=40, lowered=32, waiting=2) == 32


# --- a consumer beside a neighbour -------------------------------------------------------
class Neighbour:
    """tests/foreign_client.py: another client keeping K requests in flight on the server."""

    def __init__(self, url: str, inflight: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "foreign_client.py"), "--server", url,
             "--inflight", str(inflight)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def leave(self) -> str:
        """SIGTERM: it starts no more requests, lets its last ones finish and says how many."""
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err.decode()[-2000:]
        return out.decode()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)  # reaps it and closes its pipes


def capacity(r, run: str) -> int | None:
    servers = read_status(r, run)["servers"]
    return servers[0]["capacity"] if servers and servers[0]["consumer"] else None


def loads(url: str, seconds: float) -> list[dict]:
    """The server's own counts, sampled every 0.1 s for `seconds`."""
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        got.append(httpx.get(url + "/v1/loads", timeout=5).json()["loads"][0])
        time.sleep(0.1)
    return got


@pytest.fixture
def busy(sim_factory, redis_url, run_name, tmp_path):
    """A simulator with MAX slots and far more prompts than the test will see done."""
    sim = sim_factory(**SIM)
    data = write_dataset(tmp_path / "d.jsonl", 3000)
    genq("produce", str(data), "--once", "--max-tokens", "200", redis_url=redis_url,
         run=run_name)
    started: list = []
    yield sim, started
    for p in started:
        p.cleanup()


@pytest.mark.timeout(240)
def test_slots_leave_a_neighbour_its_share_and_take_it_back(busy, redis_url, run_name, r,
                                                            tmp_path):
    sim, started = busy
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", *FLAGS)
    started.append(consumer)
    wait_for(lambda: capacity(r, run_name) == MAX, timeout=60, what="the server's max")
    neighbour = Neighbour(sim.url, K)
    started.append(neighbour)
    wait_for(lambda: capacity(r, run_name) == MAX - K, timeout=60, interval=0.2,
             what=f"capacity {MAX - K} beside a neighbour holding {K}")
    seen = loads(sim.url, 3.0)
    waiting = sum(s["num_waiting_reqs"] for s in seen) / len(seen)
    # A fixed MAX beside the neighbour keeps ~K waiting (the next test); tracking, ~none.
    assert waiting < 1.0, seen
    assert max(s["num_running_reqs"] for s in seen) == MAX  # the server is still full
    neighbour.leave()
    wait_for(lambda: capacity(r, run_name) == MAX, timeout=60, interval=0.2,
             what="the neighbour's slots taken back")
    events = [e for e in consumer.events() if e.get("event") == "slots_changed"]
    assert events[0]["new"] < MAX and events[-1]["new"] == MAX, events
    assert "background_task_crashed" not in consumer.log()


@pytest.mark.timeout(240)
def test_fixed_concurrency_is_not_tracked(busy, redis_url, run_name, r, tmp_path):
    """--concurrency N keeps N slots whatever the server holds: a neighbour's requests wait."""
    sim, started = busy
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out",
                               "--concurrency", str(MAX), *FLAGS)
    started.append(consumer)
    wait_for(lambda: capacity(r, run_name) == MAX, timeout=60, what="the fixed slots")
    started.append(Neighbour(sim.url, K))
    wait_for(lambda: any(s["num_waiting_reqs"] >= K - 1 for s in loads(sim.url, 1.0)),
             timeout=60, what="the neighbour's requests waiting")
    # Three more load samples read by the consumer: tracking would have moved by now.
    reads = httpx.get(sim.url + "/_sim/stats", timeout=5).json()["load_reads"]
    wait_for(lambda: httpx.get(sim.url + "/_sim/stats", timeout=5).json()["load_reads"]
             >= reads + 3, timeout=30, what="three more load samples")
    assert capacity(r, run_name) == MAX
    assert "slots_changed" not in consumer.log()
