"""Redis trouble: killed and restarted from its AOF, unreachable for 30 s (a fault proxy
between the services and Redis), and full (maxmemory, noeviction). The windowed producer and
the consumers must ride through all of it, and nothing acknowledged may be lost."""

from __future__ import annotations

import time

import pytest
from faultkit import (
    Background,
    Consumer,
    check_truth,
    done_set,
    private_redis,
    record_figures,
    sim_kwargs,
    wait_done,
)
from faultproxy import FaultProxy
from pipeline import wait_for, write_dataset

from genq.common.queue.keys import RunKeys


def start_producer(data, redis_url: str, run: str, r) -> Background:
    """`genq produce` without --once: it keeps a small window queued and stays up."""
    producer = Background(redis_url, run, "produce", str(data), "--max-tokens", "300",
                          "--window", "8", "--interval", "0.1")
    wait_for(lambda: r.exists(RunKeys(run).meta) and r.llen(RunKeys(run).rq_queue),
             what="the producer registered the run and queued work")
    return producer


def wait_for_more(r, run: str, before: int) -> float:
    start = time.monotonic()
    wait_for(lambda: r.bitcount(RunKeys(run).done) > before, timeout=60, interval=0.02,
             what="progress after Redis came back")
    return round(time.monotonic() - start, 2)


@pytest.mark.slow  # a Redis kill
@pytest.mark.timeout(150)
def test_redis_killed_and_restarted_with_aof_loses_nothing_acknowledged(
        tmp_path, run_name, sim_factory):
    n = 60
    data = write_dataset(tmp_path / "d.jsonl", n)
    sim = sim_factory(**sim_kwargs(0.3))
    with private_redis("--appendonly", "yes") as redis_srv:
        r = redis_srv.client()
        url = redis_srv.url
        producer = start_producer(data, url, run_name, r)
        consumers = [Consumer(url, run_name, sim.url, tmp_path / f"out{i}") for i in range(2)]
        try:
            wait_done(r, run_name, 15)
            acknowledged = done_set(r, run_name, n)
            redis_srv.stop(kill=True)
            time.sleep(2)
            redis_srv.start()
            r = redis_srv.client()
            # Everything acknowledged before the kill is still done after the AOF replay.
            assert acknowledged <= done_set(r, run_name, n)
            recovery_s = wait_for_more(r, run_name, len(done_set(r, run_name, n)))
            for c in consumers:
                assert c.wait(90) == 0, c.log()[-3000:]
            assert producer.proc.poll() is None, producer.log()[-3000:]
            assert producer.stop() == 0
            rode_through = sum(c.event_names()["redis_unavailable"] > 0 for c in consumers)
        finally:
            producer.cleanup()
            for c in consumers:
                c.cleanup()
        assert rode_through >= 1
        figures = check_truth(r, url, run_name, n, tmp_path)
        r.close()
    record_figures("redis_killed_restarted_aof", recovery_s=recovery_s,
                   acknowledged_before_kill=len(acknowledged), acknowledged_lost=0, **figures)


@pytest.mark.slow  # a real 30 s outage, the figure docs/RELIABILITY.md gives
@pytest.mark.timeout(180)
def test_redis_unreachable_for_30s_services_wait_reconnect_and_finish(
        tmp_path, redis_server, r, run_name, sim_factory):
    n = 80
    data = write_dataset(tmp_path / "d.jsonl", n)
    sim = sim_factory(**sim_kwargs(0.5))
    proxy = FaultProxy(redis_server.port).start()
    url = proxy.url()
    producer = start_producer(data, url, run_name, r)
    consumers = [Consumer(url, run_name, sim.url, tmp_path / f"out{i}") for i in range(2)]
    try:
        wait_done(r, run_name, 10)
        # A partition (connects hang, replies never come), then nothing listening at all.
        proxy.set_mode("blackhole")
        time.sleep(15)
        proxy.set_mode("refuse")
        time.sleep(15)
        before = r.bitcount(RunKeys(run_name).done)
        proxy.set_mode("pass")
        recovery_s = wait_for_more(r, run_name, before)
        for c in consumers:
            assert c.wait(120) == 0, c.log()[-3000:]
        assert producer.proc.poll() is None, producer.log()[-3000:]
        assert producer.stop() == 0
        waited = [c.event_names()["redis_unavailable"] for c in consumers]
        producer_waited = sum(e.get("event") == "redis_unavailable" for e in producer.events())
        # A 30 s outage is a few lines per process, not one per retry of every slot: its start,
        # reminders after 10 and 30 s, its end.
        outage_lines = [sum(n for name, n in c.event_names().items()
                            if name.startswith("redis_")) for c in consumers]
    finally:
        proxy.stop()
        producer.cleanup()
        for c in consumers:
            c.cleanup()
    assert all(waited) and producer_waited
    assert waited == [1, 1] and max(outage_lines) <= 5, outage_lines
    figures = check_truth(r, redis_server.url, run_name, n, tmp_path)
    record_figures("redis_unreachable_30s", recovery_s=recovery_s, outage_s=30, **figures)


@pytest.mark.slow  # a full Redis window
@pytest.mark.timeout(150)
def test_redis_at_maxmemory_producer_backs_off_nothing_evicted_nothing_lost(
        tmp_path, run_name, sim_factory):
    # Enough prompts that many are still to be enqueued when Redis fills up.
    n = 120
    data = write_dataset(tmp_path / "d.jsonl", n)
    sim = sim_factory(**sim_kwargs(0.1))
    with private_redis() as redis_srv:
        r = redis_srv.client()
        url = redis_srv.url
        producer = start_producer(data, url, run_name, r)
        consumer = Consumer(url, run_name, sim.url, tmp_path / "out")
        fillers: list[str] = []
        try:
            wait_done(r, run_name, 10)
            r.config_set("maxmemory", r.info("memory")["used_memory"] + (1 << 20))
            while True:
                try:
                    r.set(f"filler:{len(fillers)}", b"x" * 10_000)
                except Exception as e:  # noqa: BLE001 - asserting on its type below
                    assert "maxmemory" in str(e)
                    break
                fillers.append(f"filler:{len(fillers)}")
            # Hold it well over the limit: acks free a little memory, which would otherwise
            # let a few enqueues through at the boundary.
            r.config_set("maxmemory", r.info("memory")["used_memory"] - (256 << 10))
            try:
                wait_for(lambda: any(e.get("event") == "redis_full" for e in producer.events()),
                         timeout=20, what="the producer saying Redis is full")
            except AssertionError as e:
                raise AssertionError(f"{e}\n{producer.log()[-3000:]}") from None
            full_at = r.bitcount(RunKeys(run_name).done)
            time.sleep(2)
            done_while_full = r.bitcount(RunKeys(run_name).done) - full_at
            r.config_set("maxmemory", 0)
            assert consumer.wait(90) == 0, consumer.log()[-3000:]
            assert producer.proc.poll() is None, producer.log()[-3000:]
            assert producer.stop() == 0
            said = [e for e in producer.events() if e.get("event") == "redis_full"]
            resumed = any(e.get("event") == "producer_resumed" for e in producer.events())
        finally:
            producer.cleanup()
            consumer.cleanup()
        assert resumed and "maxmemory" in said[0]["hint"]
        # noeviction: every key written before the limit was hit is still there.
        assert r.exists(*fillers) == len(fillers) and r.info("stats")["evicted_keys"] == 0
        figures = check_truth(r, url, run_name, n, tmp_path)
        r.close()
    record_figures("redis_maxmemory", backoff_lines=len(said), evicted=0,
                   done_while_full=done_while_full, **figures)
