"""A run that finishes says so: every long-running service (consumer, producer, monitor) logs
`run_finished` once when every prompt is done or failed (again after a redo brings work back
and that ends too), and `genq status` says it."""

from __future__ import annotations

import signal

from conftest import genq
from faultkit import Background
from pipeline import ConsumerProcess, wait_for, write_dataset
from test_monitor import Monitor

from genq.common.queue.keys import RunKeys


def said(events) -> int:
    return sum(e.get("event") == "run_finished" for e in events)


def monitor_said(monitor: Monitor) -> int:
    return monitor.log.read_text().count('"run_finished"')


def test_services_say_once_that_the_run_finished(tmp_path, redis_url, r, run_name, sim_factory):
    n = 30
    producer = Background(redis_url, run_name, "produce",
                          str(write_dataset(tmp_path / "d.jsonl", n)), "--interval", "0.1")
    k = RunKeys(run_name)
    wait_for(lambda: r.exists(k.meta), what="the run registered")
    monitor = Monitor(redis_url, run_name, tmp_path)
    consumer = ConsumerProcess(redis_url, run_name, sim_factory(time_scale=1000).url,
                               tmp_path / "out", "--poll", "0.05")
    try:
        wait_for(lambda: r.bitcount(k.done) == n, timeout=60, what="every prompt done")
        wait_for(lambda: said(consumer.events()) == 1 and said(producer.events()) == 1
                 and monitor_said(monitor) == 1, timeout=15, what="run_finished logged")
        assert "finished" in genq("status", redis_url=redis_url, run=run_name).stdout
        genq("requeue", "--redo", "all", redis_url=redis_url, run=run_name)
        wait_for(lambda: said(consumer.events()) == 2 and said(producer.events()) == 2
                 and monitor_said(monitor) == 2, timeout=60, what="the redo's end logged")
        consumer.signal(signal.SIGTERM)
        assert consumer.wait(30) == 0
    finally:
        consumer.kill()
        monitor.stop()
        producer.cleanup()
    assert said(consumer.events()) == 2
