"""Services started while Redis is down (or still loading) wait for it with backoff and one
clear line, instead of exiting 1: under compose and restart loops Redis often comes up last."""

from __future__ import annotations

import time

from faultkit import Background, Consumer, check_truth, private_redis, produce_once, sim_kwargs
from pipeline import write_dataset


def test_consumer_and_producer_started_before_redis_wait_then_proceed(
        tmp_path, run_name, sim_factory):
    n = 40
    with private_redis("--appendonly", "yes") as server:
        produce_once(write_dataset(tmp_path / "d.jsonl", n), server.url, run_name)
        server.stop()  # the run is in the AOF; Redis is gone when the services start
        sim = sim_factory(**sim_kwargs(0.1))
        consumer = Consumer(server.url, run_name, sim.url, tmp_path / "out")
        producer = Background(server.url, run_name, "produce", str(tmp_path / "d.jsonl"),
                              "--max-tokens", "300")
        try:
            time.sleep(3)  # both are up and cannot reach Redis
            assert consumer.proc.poll() is None, consumer.log()[-2000:]
            assert producer.proc.poll() is None, producer.log()[-2000:]
            server.start()
            assert consumer.wait(90) == 0, consumer.log()[-3000:]
            assert producer.stop() == 0, producer.log()[-3000:]
            consumer_events = consumer.event_names()
            producer_events = [e.get("event") for e in producer.events()]
        finally:
            consumer.cleanup()
            producer.cleanup()
        r = server.client()
        check_truth(r, server.url, run_name, n, tmp_path)
        r.close()
    # One clear line while waiting (not one per try), one when Redis answers.
    assert consumer_events["waiting_for_redis"] == 1 and consumer_events["redis_available"] == 1
    assert producer_events.count("waiting_for_redis") == 1
    assert "redis_available" in producer_events and "run_registered" in producer_events
