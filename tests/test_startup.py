"""Services started while Redis is down (or still loading) wait for it with backoff and one
clear line, instead of exiting 1: under compose and restart loops Redis often comes up last."""

from __future__ import annotations

import signal
import time

import orjson
import pytest
from conftest import free_port, genq
from faultkit import Background, Consumer, check_truth, private_redis, produce_once, sim_kwargs
from pipeline import wait_for, write_dataset
from test_monitor import Monitor


@pytest.mark.slow  # Redis down at start, then up
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
        monitor = Monitor(server.url, run_name, tmp_path)
        try:
            # All three are up and cannot reach Redis: each says so once and waits.
            for proc in (consumer, producer):
                wait_for(lambda proc=proc: "waiting_for_redis" in [
                    e.get("event") for e in proc.events()], what="waiting for Redis")
            wait_for(lambda: monitor.get("/api/status")[0] == 503, what="the monitor's 503")
            assert consumer.proc.poll() is None, consumer.log()[-2000:]
            assert producer.proc.poll() is None, producer.log()[-2000:]
            code, body, _ = monitor.get("/api/status")
            assert code == 503 and "cannot reach Redis" in orjson.loads(body)["error"]
            server.start()
            assert consumer.wait(90) == 0, consumer.log()[-3000:]
            wait_for(lambda: "run_registered" in [e.get("event") for e in producer.events()],
                     what="the producer through its backoff")
            assert producer.stop() == 0, producer.log()[-3000:]
            consumer_events = consumer.event_names()
            producer_events = [e.get("event") for e in producer.events()]
            # The monitor serves the run now (its status is up to a second old).
            wait_for(lambda: monitor.status()["done"] == n, timeout=10, what="the monitor's done")
        finally:
            consumer.cleanup()
            producer.cleanup()
            monitor.stop()
        r = server.client()
        check_truth(r, server.url, run_name, n, tmp_path)
        r.close()
    # One clear line while waiting (not one per try), one when Redis answers.
    assert consumer_events["waiting_for_redis"] == 1 and consumer_events["redis_available"] == 1
    assert producer_events.count("waiting_for_redis") == 1
    assert "redis_available" in producer_events and "run_registered" in producer_events


def test_services_stopped_while_waiting_for_redis_exit_cleanly(tmp_path, run_name):
    """SIGTERM to a consumer or windowed producer still waiting for Redis: exit 0 at once."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    consumer = Consumer(dead, run_name, "http://127.0.0.1:9", tmp_path / "out")
    producer = Background(dead, run_name, "produce", str(tmp_path / "d.jsonl"))
    try:
        for proc in (consumer, producer):
            wait_for(lambda proc=proc: any(e.get("event") == "waiting_for_redis"
                                           for e in proc.events()), what="waiting for Redis")
        consumer.signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, consumer.log()[-2000:]
        assert producer.stop() == 0, producer.log()[-2000:]
    finally:
        consumer.cleanup()
        producer.cleanup()


@pytest.mark.slow  # each command waits out its --redis-wait on an unreachable Redis
def test_run_to_the_end_commands_give_up_on_an_unreachable_redis(tmp_path, run_name):
    """--once and --burst are run by a person or a script that waits for them: an unreachable
    Redis ends them after --redis-wait with one line and exit 1, not a wait forever."""
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    data = write_dataset(tmp_path / "d.jsonl", 5)
    commands = {
        "produce": ("produce", str(data), "--once", "--redis-wait", "2"),
        "consume": ("consume", "--server", "http://127.0.0.1:9", "--burst", "--redis-wait", "2",
                    "--out", str(tmp_path / "out")),
    }
    for name, args in commands.items():
        started = time.monotonic()
        proc = genq(*args, redis_url=nobody, run=run_name, check=False, timeout=60)
        took = time.monotonic() - started
        lines = proc.stderr.splitlines()
        errors = [line for line in lines if not line.startswith("{")]  # not log lines
        assert proc.returncode == 1, (name, proc.stderr[-2000:])
        assert len(errors) == 1 and "cannot reach Redis" in errors[0], (name, proc.stderr)
        assert "after 2 s (--redis-wait)" in errors[0] and took < 30, (name, took)
        # The waiting line says how long it waits, not "until Redis answers".
        [waiting] = [orjson.loads(line) for line in lines
                     if line.startswith("{") and '"waiting_for_redis"' in line]
        assert "for up to 2 s (--redis-wait)" in waiting["hint"], (name, waiting)


@pytest.mark.slow  # the monitor's real 10 s reminder
def test_a_monitor_without_redis_logs_its_outage_at_a_slowing_pace(tmp_path, run_name):
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    monitor = Monitor(nobody, run_name, tmp_path, interval=0.2)
    try:
        time.sleep(12)
    finally:
        log = monitor.stop()
    events = [orjson.loads(line).get("event") for line in log.splitlines()
              if line.startswith("{")]
    # Ticks five times a second for 12 s: its start, one reminder after 10 s.
    assert events.count("redis_unavailable") == 1, events
    assert len(events) <= 6, events
